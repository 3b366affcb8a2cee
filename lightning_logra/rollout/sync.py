"""Keeping a rollout engine's own weights equal to the trainer's: the contract the module calls after every step
(`WeightSync`), what trainer and engine exchange besides an `Update` (named tensors as bytes), and the fingerprint
both sides compare.

After an update W ← W − F·A the engine does not need W: it needs F (d×r), what regenerates A (the seed, the
distribution, r, k) and, for bf16/fp16 weights, the key of the merge's stochastic rounding: an `Update`
(`lightning_logra.algo.update`), sent as its bytes; their size is what `sync/bytes` reports.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

from lightning_logra.algo.update import Update
from lightning_logra.base.hashing import mix64


class WeightSync(ABC):
    """Keeps a rollout engine with weights of its own (vLLM) equal to the trainer's. A Lightning callback that also
    subclasses it (`lightning_logra.callbacks.RolloutWeightSync`) is found by the module among the Trainer's callbacks
    (at most one); an engine with weights of its own and no sync is refused before the first step."""

    @abstractmethod
    def attach(self, engine, tensors: Callable[[], dict[str, torch.Tensor]],
               max_over_ranks: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Before generation starts (fit, validate, test): keep `engine` in step from now on, starting by loading
        whatever differs from the trainer's weights (they may be a resumed checkpoint's). `tensors()` gives every
        tensor the engine holds, by the model's names, as the trainer holds them now: under sharded training (FSDP)
        each rank's shards as DTensors, whose whole values every rank gathers together (`whole`);
        `max_over_ranks` (elementwise) is a collective every rank calls at the same point (each rank keeps its own
        engine)."""

    @abstractmethod
    def sync(self, update: Update | None, sampler_diff: float) -> dict[str, float]:
        """After every training step, on every rank: send `update` (None: the step was skipped) and, when due, check
        the engine for drift. `sampler_diff` is the step's mean |log π_sampler − log π_θ| per token: a sampler far
        from the trainer asks for a check at once. Returns the step's metrics (NaN where they do not apply).
        `payload`, `send` and `after_step` are its three parts, which overlapped rollouts call apart."""

    @abstractmethod
    def payload(self, update: Update, copy: bool = False) -> Update:
        """What the engine receives of `update`, made on the trainer's thread by every rank (it may gather sharded
        values); with `copy`, nothing in it is a live parameter, so a later step cannot change it before it is
        sent."""

    @abstractmethod
    def send(self, update: Update) -> dict[str, float]:
        """Send a `payload` to this rank's engine: no collective, so it can run on another thread. Returns the
        send's metrics (`sync/bytes`, `sync/dense_bytes`, `sync/seconds`)."""

    @abstractmethod
    def after_step(self, sent: bool, sampler_diff: float, settle: Callable[[], None] = lambda: None
                   ) -> dict[str, float]:
        """On every rank, once the step's update was sent (`sent`) or skipped: when a check is due, call `settle`
        (the engine must then hold the trainer's weights and be idle) and compare; returns the other metrics."""


def find_sync(callbacks) -> WeightSync | None:
    """The run's weight sync among the Trainer's callbacks, if any; two would each load the engine: refused."""
    syncs = [callback for callback in callbacks if isinstance(callback, WeightSync)]
    if len(syncs) > 1:
        raise ValueError(f"trainer.callbacks: {[type(s).__name__ for s in syncs]} each keep the engine's weights in "
                         "step; keep one of them")
    return syncs[0] if syncs else None


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a tensor the trainer may hold sharded (a DTensor: all-gathered, a collective every rank
    calls at the same point); any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def whole_fingerprint(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    """`fingerprint` of the whole tensor (d,) fp64. Of a DTensor sharded by rows, each rank fingerprints its rows
    and the d numbers are all-gathered (a collective): the d×k weight is never gathered."""
    if not isinstance(tensor, DTensor):
        return fingerprint(tensor, seed)
    local = fingerprint(tensor.to_local(), seed)  # the rank's rows: FSDP2 shards dim 0 (all columns held)
    rows = DTensor.from_local(local, tensor.device_mesh, tensor.placements, run_check=False,
                              shape=(tensor.shape[0],), stride=(1,))
    return rows.full_tensor()


def fingerprint_vector(in_features: int, seed: int, device: torch.device | str | None = None) -> torch.Tensor:
    """v (k,) fp64 of seeded ±1 entries: W·v is a d-number fingerprint of a (d, k) matrix."""
    index = torch.arange(in_features, dtype=torch.int64, device=device)
    bits = mix64(index + (seed & ((1 << 62) - 1)))
    return torch.where(bits < 0, -1.0, 1.0).to(torch.float64)


_FINGERPRINT_BLOCK_NUMBERS = 1 << 23  # float64 numbers converted at once: 64 MiB


def fingerprint(weight: torch.Tensor, seed: int, col_start: int = 0) -> torch.Tensor:
    """W·v in float64 for a (d, k) weight — or the part W[:, cols]·v[cols] for a column block starting at col_start.

    Comparing fingerprints instead of weights costs d numbers per matrix. Equal weights give equal fingerprints
    (float64 sums of the same numbers); a change ε in one entry moves its row by exactly ε; a change spread over a
    row can cancel only by a ±1 coincidence that a new `seed` each check makes vanishingly unlikely to persist.
    A 1-D parameter (a bias, a norm) is its own fingerprint.
    """
    if weight.dim() == 1:
        return weight.detach().to(torch.float64)
    v = fingerprint_vector(col_start + weight.shape[1], seed, weight.device)[col_start:]
    # A block of rows at a time: the float64 copy of a whole embedding (152k × 3584 on Qwen2.5-7B) would take 4 GiB.
    rows = max(1, _FINGERPRINT_BLOCK_NUMBERS // weight.shape[1])
    return torch.cat([block.detach().to(torch.float64) @ v for block in weight.split(rows)])  # (d,)
