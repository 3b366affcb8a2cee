"""Merging a low-rank update into a weight in place: W ← W − F·A, with A given or regenerated from its seed.

The trainer and the rollout engine both call this, so the same factor F, seed and rounding key give the same
weights on both sides: bit for bit on the same kind of device (a GPU's GEMM kernels may differ from the trainer's
in the last bit of the fp32 product, which a stochastic rounding can then resolve differently).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from lightning_logra.sketch.projection import make_projection
from lightning_logra.sketch.rounding import rounding_bits, stochastic_round_

# Rows per chunk are chosen so the fp32 transient of a low-precision merge stays near 64 MiB.
_CHUNK_ELEMENTS = 16 * 1024 * 1024


@torch.no_grad()
def apply_low_rank_update_(
    weight: torch.Tensor,
    factor: torch.Tensor,
    projection: torch.Tensor,
    rounding_key: int | None = None,
    first_row: int = 0,
    first_col: int = 0,
) -> None:
    """W (d, k) −= F (d, r) @ A (r, k), in place, computed in fp32 (or W's own fp64) and rounded into W once.

    A bf16/fp16 W is rounded stochastically with the bits of `rounding_key` when one is given, to nearest otherwise
    (fp32/fp64 weights need neither). `first_row`/`first_col` place W inside a larger matrix (a tensor-parallel
    shard or a fused slice), so that its elements draw the bits the whole matrix would give them.
    """
    apply_stacked_update_(weight, [RowBlock(factor, rounding_key, first_row)], projection, first_col)


class RowBlock(NamedTuple):
    """Consecutive rows of a stacked weight that are one matrix's: its factor, rounding key and first global row."""

    factor: torch.Tensor  # (d_i, r)
    rounding_key: int | None
    first_row: int  # of these rows in their own matrix (where its rounding bits are drawn)


@torch.no_grad()
def apply_stacked_update_(weight: torch.Tensor, blocks: list[RowBlock], projection: torch.Tensor,
                          first_col: int = 0) -> None:
    """W (Σ d_i, k) −= [F_1; F_2; …] @ A (r, k) in one GEMM, for row blocks of one weight whose updates share A.

    vLLM fuses q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj`; when their deltas share A
    (`sketch.share_projection`) the engine merges a whole fused weight with one product. Each block keeps its own
    rounding key and row numbering, so every element gets the bits a merge of its matrix alone would give it.
    """
    factor = blocks[0].factor if len(blocks) == 1 else torch.cat([block.factor for block in blocks])  # (Σ d_i, r)
    if factor.shape[0] != weight.shape[0]:
        raise ValueError(f"apply_stacked_update_: the factors have {factor.shape[0]} rows, "
                         f"the weight {weight.shape[0]}")
    if weight.dtype in (torch.float32, torch.float64):
        factor = factor.to(device=weight.device, dtype=weight.dtype)
        projection = projection.to(device=weight.device, dtype=weight.dtype)
        weight.addmm_(factor, projection, alpha=-1.0)  # no d×k temporary at all
        return
    factor = factor.to(device=weight.device, dtype=torch.float32)
    projection = projection.to(device=weight.device, dtype=torch.float32)
    ends = [sum(block.factor.shape[0] for block in blocks[: i + 1]) for i in range(len(blocks))]
    spans = [(end - block.factor.shape[0], end, block) for end, block in zip(ends, blocks)]  # rows [low, high) of W
    # bf16/fp16 W: a product F·A rounded to bf16 and then subtracted would round twice and lose the small update
    # against the large weight; do the subtraction in fp32 a chunk of rows at a time instead.
    rows = max(1, _CHUNK_ELEMENTS // weight.shape[1])
    cols = range(first_col, first_col + weight.shape[1])
    for start in range(0, weight.shape[0], rows):
        chunk = weight[start : start + rows]  # (rows, k) view into W
        merged = chunk.float().addmm_(factor[start : start + rows], projection, alpha=-1.0)  # (rows, k) fp32
        for low, high, block in spans:
            a, b = max(low, start), min(high, start + chunk.shape[0])  # the block's rows inside this chunk
            if a >= b:
                continue
            target, value = chunk[a - start : b - start], merged[a - start : b - start]
            if block.rounding_key is None:
                target.copy_(value)
            else:
                global_rows = range(block.first_row + a - low, block.first_row + b - low)
                stochastic_round_(target, value, rounding_bits(block.rounding_key, global_rows, cols, weight.device))


@torch.no_grad()
def merge_stays_finite(weight: torch.Tensor, factor: torch.Tensor, projection: torch.Tensor) -> bool:
    """Whether W (d, k) − F (d, r) @ A (r, k), rounded into W's dtype as `apply_stacked_update_` rounds it, is finite
    wherever W is: a finite factor of 3e38 left Inf in the weights. Nothing is written.

    A bound first, which settles every sane update at the cost of one read of W: |W − F·A| ≤ max|W| + max over rows
    of Σ_j |F_ij|·max|A_j|. Only past half the dtype's largest number is the merge worked out, a chunk of rows at a
    time, in the merge's own arithmetic (entries of W already NaN or Inf, which a load repairs, are not counted)."""
    if weight.numel() == 0:
        return True
    largest = torch.finfo(weight.dtype).max
    low, high = torch.aminmax(weight)
    spread = factor.double().abs() @ projection.double().abs().amax(dim=1).to(factor.device)  # (d,)
    bound = max(-float(low), float(high)) + float(spread.max())
    if bound <= largest / 2:  # (a NaN bound, from a NaN in W, is not)
        return True
    compute = torch.float64 if weight.dtype == torch.float64 else torch.float32
    factor = factor.to(device=weight.device, dtype=compute)
    projection = projection.to(device=weight.device, dtype=compute)
    rows = max(1, _CHUNK_ELEMENTS // weight.shape[1])
    for start in range(0, weight.shape[0], rows):
        chunk = weight[start : start + rows]  # (rows, k) view into W
        merged = chunk.to(compute, copy=True).addmm_(factor[start : start + rows], projection, alpha=-1.0)  # (rows, k)
        if bool((torch.isfinite(chunk) & ~(merged.abs() <= largest)).any()):
            return False
    return True


@dataclass
class LowRankDelta:
    """W ← W − F·A for one matrix, with A = make_projection(seed, rank, in_features, distribution) — or, for a change
    that no seed regenerates (a LoRA step, `lightning_logra.train.lora`), the explicit `matrix` A, sent along with F."""

    factor: torch.Tensor  # F = α·η·U (d, r)
    seed: int | None
    distribution: str | None
    in_features: int  # k
    rounding_key: int | None = None  # the bits of a stochastic rounding into bf16/fp16 weights; None: nearest
    matrix: torch.Tensor | None = None  # an explicit A (r, k); None: regenerated from the seed

    @property
    def rank(self) -> int:
        return self.factor.shape[1]

    def projection(self, device: torch.device | str | None = None) -> torch.Tensor:
        if self.matrix is not None:
            return self.matrix.to(device)  # (r, k)
        return make_projection(self.seed, self.rank, self.in_features, self.distribution, device=device)  # (r, k)

    def apply_(self, weight: torch.Tensor) -> None:
        """Merge into a full (d, k) weight in place (a tensor-parallel shard uses `apply_shard_`)."""
        apply_low_rank_update_(weight, self.factor, self.projection(weight.device), self.rounding_key)

    def apply_shard_(self, weight: torch.Tensor, rows: slice, cols: slice) -> None:
        """Merge into `weight`, the block W[rows, cols] of the full matrix: F[rows]·A[:, cols] is that block's delta."""
        projection = self.projection(weight.device)[:, cols]
        apply_low_rank_update_(weight, self.factor[rows], projection, self.rounding_key, rows.start or 0,
                               cols.start or 0)
