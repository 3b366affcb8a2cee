"""The random projection A (r×k): a pure function of (seed, rank, in_features, distribution).

The trainer, every DDP rank and the rollout engine (another process, maybe another torch build) must all
regenerate the *same* A from a seed. torch's generators are stable in practice but not promised across
versions or devices, so A is built from a counter-based hash (SplitMix64) written in plain integer tensor
ops: element i of the flattened matrix depends only on (seed, i). Integer arithmetic is exact everywhere, so
Rademacher entries are bit-identical on any device and torch version. Gaussian entries go through
float64 Box–Muller before rounding to fp32, identical for all processes on the same device type.
"""

from __future__ import annotations

import hashlib
import math

import torch

DISTRIBUTIONS = ("rademacher", "gaussian")

_MASK64 = (1 << 64) - 1


def _as_int64(value: int) -> int:
    """Reinterpret an unsigned 64-bit constant as the signed int64 that torch stores."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _as_int64(0x9E3779B97F4A7C15)
_MIX1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX2 = _as_int64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic; mask off the copied sign bits to get a logical shift.
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 words: a bijection that scatters nearby inputs across all 64 bits."""
    # int64 multiplication wraps modulo 2^64 on every torch backend, which is exactly the unsigned arithmetic
    # SplitMix64 needs.
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def counter_uniform(keys: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) (float64) per int64 key, a pure function of the key on any device."""
    return _shr(mix64(keys * _GOLDEN + _GOLDEN), 11).to(torch.float64) * 2.0**-53


def _splitmix64(seed: int, count: int, device: torch.device | str | None) -> torch.Tensor:
    """`count` pseudo-random 64-bit words (as int64) for stream `seed`; word i depends only on (seed, i)."""
    index = torch.arange(1, count + 1, dtype=torch.int64, device=device)  # (count,)
    return mix64(index * _GOLDEN + _as_int64(seed))


def make_projection(
    seed: int,
    rank: int,
    in_features: int,
    distribution: str = "rademacher",
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Return A of shape (rank, in_features), fp32, with E[AᵀA] = I.

    rademacher: entries ±1/√r with equal probability; gaussian: entries N(0, 1/r).
    `device` only says where to compute (default CPU); the values do not depend on it for Rademacher.
    """
    if rank < 1 or in_features < 1:
        raise ValueError(f"make_projection: rank ({rank}) and in_features ({in_features}) must be positive")
    count = rank * in_features
    if distribution == "rademacher":
        bits = _splitmix64(seed, count, device)
        # The top bit of a SplitMix64 word is a fair coin: word < 0 ⇔ bit 63 set.
        signs = torch.where(bits < 0, -1.0, 1.0).to(torch.float32)  # (r·k,)
        return (signs * (1.0 / math.sqrt(rank))).view(rank, in_features)
    if distribution == "gaussian":
        bits = _splitmix64(seed, 2 * count, device).view(2, count)
        # 53 random bits per word → uniform in (0, 1], never 0 so the log below is finite.
        uniform = (_shr(bits, 11).to(torch.float64) + 1.0) * 2.0**-53  # (2, r·k)
        normal = torch.sqrt(-2.0 * torch.log(uniform[0])) * torch.cos(2.0 * math.pi * uniform[1])
        return (normal / math.sqrt(rank)).to(torch.float32).view(rank, in_features)
    raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")


def matrix_seed(base_seed: int, name: str, refresh_index: int = 0) -> int:
    """Seed of one matrix's projection: a stable hash of (base seed, module name, refresh index).

    Python's hash() is salted per process, so a cryptographic digest is used instead; 63 bits keep it a
    non-negative int64 that torch, JSON and every process agree on.
    """
    digest = hashlib.blake2b(f"{base_seed}:{name}:{refresh_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
