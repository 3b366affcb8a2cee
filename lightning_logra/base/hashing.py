"""Counter-based hashes: every random number the project draws is a pure function of integers.

Projections (A), sampling uniforms and stochastic-rounding bits must be reproduced bit for bit by other
processes (DDP ranks, the rollout engine's workers, a resumed run) and on other devices. torch's generators are
stable in practice but not promised across versions or devices, so random words come from SplitMix64's finalizer,
written in plain int64 tensor ops (exact everywhere); seeds that name a thing (a matrix, a prompt) come from a
cryptographic digest of its description, because Python's `hash()` is salted per process.

This module imports nothing from the project, so the math, the data and the engines can all use it.
"""

from __future__ import annotations

import hashlib

import torch

_MASK64 = (1 << 64) - 1


def as_int64(value: int) -> int:
    """Reinterpret an unsigned 64-bit constant as the signed int64 that torch stores."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


GOLDEN = as_int64(0x9E3779B97F4A7C15)
_MIX1 = as_int64(0xBF58476D1CE4E5B9)
_MIX2 = as_int64(0x94D049BB133111EB)


def shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's >> is arithmetic: mask off the copied sign bits)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 words: a bijection that scatters nearby inputs across all 64 bits.

    z ← (z ^ z >>> 30)·M1; z ← (z ^ z >>> 27)·M2; z ^ z >>> 31, with >>> the logical shift. int64 multiplication
    wraps modulo 2^64 on every torch backend, which is exactly the unsigned arithmetic SplitMix64 needs. Written
    in place on one copy with one scratch buffer: on the CPU, allocating a fresh tensor per operation made it 5×
    slower (it hashes every element of a matrix at each stochastically rounded merge).
    """
    z = z.clone()
    scratch = torch.empty_like(z)
    for bits, multiplier in ((30, _MIX1), (27, _MIX2), (31, None)):
        torch.bitwise_right_shift(z, bits, out=scratch)
        scratch.bitwise_and_((1 << (64 - bits)) - 1)  # torch's >> is arithmetic: clear the copied sign bits
        z.bitwise_xor_(scratch)
        if multiplier is not None:
            z.mul_(multiplier)
    return z


def splitmix64(seed: int, count: int, device: torch.device | str | None = None) -> torch.Tensor:
    """`count` pseudo-random 64-bit words (as int64) for stream `seed`; word i depends only on (seed, i)."""
    index = torch.arange(1, count + 1, dtype=torch.int64, device=device)  # (count,)
    return mix64(index * GOLDEN + as_int64(seed))


def counter_uniform(keys: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) (float64) per int64 key, a pure function of the key on any device."""
    return shr(mix64(keys * GOLDEN + GOLDEN), 11).to(torch.float64) * 2.0**-53


def stable_seed(*parts: object) -> int:
    """A 63-bit seed named by `parts` (joined with ':'), identical in every process: a non-negative int64 that
    torch, JSON and vLLM's seed arguments all accept."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def matrix_seed(base_seed: int, name: str, refresh_index: int = 0) -> int:
    """Seed of one matrix's projection: (base seed, module name, refresh index)."""
    return stable_seed(base_seed, name, refresh_index)


def hash_split(count: int, split: str, salt: int, one_in: int) -> torch.Tensor:
    """The indices (int64, ascending) of items 0..count-1 in `split` ("train" or "eval"): an item is held out for
    evaluation when the hash of its index (xor `salt`) is 0 modulo `one_in`; the same split on every machine."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    index = torch.arange(count, dtype=torch.int64)  # (count,)
    held_out = mix64(index ^ salt) % one_in == 0  # (count,) bool
    return index[held_out] if split == "eval" else index[~held_out]


def prompt_seeds(seed: int, step: int, first_index: int, count: int) -> list[int]:
    """One sampling seed per prompt: (run seed, step, the prompt's index in the global batch).

    Seeding each prompt, not the batch, makes a prompt's completions independent of which other prompts share
    its batch or its process: a run sharded over 2 ranks samples what the same run on 1 process samples.
    """
    return [stable_seed(seed, step, first_index + i) for i in range(count)]
