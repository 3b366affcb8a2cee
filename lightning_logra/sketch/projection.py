"""The random projection A (r×k): a pure function of (seed, rank, in_features, distribution).

The trainer, every DDP rank and the rollout engine (another process, maybe another torch build) must all
regenerate the *same* A from a seed. torch's generators are stable in practice but not promised across
versions or devices, so A is built from a counter-based hash (SplitMix64) written in plain integer tensor
ops: element i of the flattened matrix depends only on (seed, i). Integer arithmetic is exact everywhere, so
Rademacher entries are bit-identical on any device and torch version. Gaussian entries go through
float64 Box–Muller before rounding to fp32, identical for all processes on the same device type.
"""

from __future__ import annotations

import math

import torch

from lightning_logra.base.hashing import matrix_seed, shr, splitmix64
from lightning_logra.base.settings import check_positive

DISTRIBUTIONS = ("rademacher", "gaussian")


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
    check_positive("make_projection: rank", rank, integer=True)
    check_positive("make_projection: in_features", in_features, integer=True)
    count = rank * in_features
    if distribution == "rademacher":
        bits = splitmix64(seed, count, device)
        # The top bit of a SplitMix64 word is a fair coin: word < 0 ⇔ bit 63 set.
        signs = torch.where(bits < 0, -1.0, 1.0).to(torch.float32)  # (r·k,)
        return (signs * (1.0 / math.sqrt(rank))).view(rank, in_features)
    if distribution == "gaussian":
        bits = splitmix64(seed, 2 * count, device).view(2, count)
        # 53 random bits per word → uniform in (0, 1], never 0 so the log below is finite.
        uniform = (shr(bits, 11).to(torch.float64) + 1.0) * 2.0**-53  # (2, r·k)
        normal = torch.sqrt(-2.0 * torch.log(uniform[0])) * torch.cos(2.0 * math.pi * uniform[1])
        return (normal / math.sqrt(rank)).to(torch.float32).view(rank, in_features)
    raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")


def storage_dtype(rank: int, distribution: str, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype a layer with `weight_dtype` weights keeps its A in: that bf16/fp16 when every entry of A is exact
    there, fp32 otherwise. Rademacher entries are ±c with c = 1/√r in fp32, exact in bf16 and fp16 when r is a power
    of 4 (c a power of 2: the configs' ranks 16 and 256); Gaussian entries are not. Kept so, A costs half its
    fp32 bytes (0.58 GB of the 7B shape's 1.16 at rank 256) with the same values."""
    if distribution == "rademacher" and weight_dtype in (torch.bfloat16, torch.float16):
        c = torch.tensor(1.0 / math.sqrt(rank), dtype=torch.float32)
        if c.to(weight_dtype).float() == c:
            return weight_dtype
    return torch.float32


__all__ = ["DISTRIBUTIONS", "make_projection", "matrix_seed", "storage_dtype"]
