"""Unbiased rounding of a merged fp32 weight into bf16/fp16, reproducible bit for bit by the rollout engine.

At RL learning rates an update α·η·U·A is far below half an ulp of a bf16 weight (|w| ≈ 0.02 has an ulp of 1.2e-4;
the update is about 1e-6): rounding W − F·A to nearest leaves almost every entry where it was, so almost nothing
is learned. Stochastic rounding rounds up with probability equal to the distance to the lower neighbour over the
gap, so E[round(x)] = x: every update lands in expectation, with zero-mean noise of at most one ulp per entry that
changes, and no d×k fp32 master copy.

The random bits are a pure function of (the rounding key, the element's global row and column): the key mixes the
matrix's own seed (its projection's, unless that is shared) with the optimizer's global update counter, so the
trainer, a DDP rank, a resumed run and the engine's workers — which may hold only a tensor-parallel shard or a fused
slice — draw the same bits for the same element. One 64-bit SplitMix64 word gives the 16-bit draws of four
adjacent columns.
"""

from __future__ import annotations

import torch

from lightning_logra.base.hashing import GOLDEN, as_int64, mix64

ROUNDING_MODES = ("stochastic", "nearest")
LOW_PRECISION = (torch.bfloat16, torch.float16)

# Keeps the rounding stream apart from the projections' (A is generated from the plain matrix seed).
_ROUNDING_SALT = as_int64(0xC2B2AE3D27D4EB4F)
_COLUMN_GOLDEN = as_int64(0xD6E8FEB86659FD93)


def check_rounding(rounding: str, key: str = "rounding") -> None:
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"{key} must be one of {ROUNDING_MODES}, got {rounding!r}: 'stochastic' makes bf16/fp16 "
                         "merges unbiased (a no-op for fp32 weights), 'nearest' rounds each merge once")


def is_rounding_key(key: object) -> bool:
    """Whether `key` is one `rounding_bits` can draw from: a whole number in the int64 range (what `rounding_key`
    makes). A key sent to an engine is checked with this before any merge: a string, 2⁸⁰ or 1.5 made the merge raise
    part-way."""
    return type(key) is int and -(2**63) <= key < 2**63


def rounding_key(matrix_seed: int, update: int) -> int:
    """The key of one merge's rounding bits: (the matrix's own seed, the global update counter)."""
    seed = torch.tensor([as_int64(matrix_seed) ^ _ROUNDING_SALT], dtype=torch.int64)
    counter = torch.tensor([update + 1], dtype=torch.int64)
    return int(mix64(mix64(seed) + counter * GOLDEN)[0])


def rounding_bits(key: int, rows: range, cols: range, device: torch.device | str | None = None) -> torch.Tensor:
    """Uniform 16-bit integers (len(rows), len(cols)) int32 in [0, 65536) for the elements (rows × cols) of a matrix.

    Element (i, j) takes the 16-bit lane j mod 4 of the word mix64(mix64(key + i·G) + (j div 4)·G'), so a block of
    the matrix (any rows, any columns) gets exactly the bits the whole matrix would give it.
    """
    first, last = cols.start // 4, (cols.stop + 3) // 4  # the groups of 4 columns that cover the block
    row_keys = mix64(torch.arange(rows.start, rows.stop, dtype=torch.int64, device=device) * GOLDEN + key)
    groups = torch.arange(first, last, dtype=torch.int64, device=device) * _COLUMN_GOLDEN
    words = mix64(row_keys[:, None] + groups[None, :])  # (rows, groups)
    # Each int64 word read as four int16 lanes (little-endian on CPUs and GPUs alike): lane l is bits 16l..16l+15.
    lanes = words.view(torch.int16)  # (rows, 4·groups)
    offset = cols.start - 4 * first
    return lanes[:, offset : offset + len(cols)].to(torch.int32) & 0xFFFF


def stochastic_round_(target: torch.Tensor, value: torch.Tensor, bits: torch.Tensor) -> None:
    """target (bf16/fp16) ← value (fp32, same shape) rounded up with probability (value − lower)/(upper − lower).

    `value` is clobbered (it is the caller's fp32 scratch block).
    """
    if target.dtype == torch.bfloat16:
        # bf16 is fp32 without its low 16 mantissa bits: adding a uniform 16-bit integer to those bits carries into
        # the kept bits with probability (low bits)/2^16, and truncating then rounds the magnitude up exactly that
        # often (for either sign, since floats are sign-magnitude).
        ints = value.view(torch.int32)
        ints.add_(bits).bitwise_and_(-65536)  # -65536 = 0xFFFF0000: keep sign, exponent and 7 mantissa bits
        target.copy_(value)  # exact: the value is a bf16 number now
        return
    nearest = value.to(target.dtype)
    error = value - nearest.float()  # (rows, k): where the exact value lies from the nearest neighbour
    other = torch.nextafter(nearest, torch.where(error > 0, torch.inf, -torch.inf).to(target.dtype))
    gap = other.float() - nearest.float()
    p = torch.where(error == 0, 0.0, error / gap)  # in [0, ½]: the chance of taking the farther neighbour
    target.copy_(torch.where(bits.float() * 2.0**-16 < p, other, nearest))
