"""What a strategy gives a training step: only its collectives. The training mode (`lightning_logra.train.modes`)
decides what is reduced, clipped, proposed and applied, and asks the run's `Collectives` to do it over the ranks.

The project's strategies (one device, DDP, FSDP2) are `Collectives` themselves (`StrategyCollectives`); a run on one of
Lightning's own strategies or on `DenseDDPStrategy` (Lightning's DDP wrapper) gets `LightningCollectives`
(`collectives_of`). Reductions over the ranks (`sum_over_ranks`, `max_over_ranks`) are theirs too.
"""

from __future__ import annotations

import math

import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_logra.sketch.update import LowRankDelta


class Collectives:
    """One process holding everything: what every method does unless a strategy distributes it."""

    # Whether each rank holds only shards of the weights (FSDP): a rollout engine with weights of its own cannot
    # follow them yet (its full loads would need whole tensors).
    shards_weights: bool = False

    @property
    def lockstep(self) -> bool:
        """Whether every forward pass is a collective, so that every rank must run as many as the others (every
        micro-batch of the step, and generation until every rank's rows have finished)."""
        return self.shards_weights

    @property
    def loss_scale(self) -> float:
        """What the loss is multiplied by before each backward pass (1: gradients are summed as they are)."""
        return 1.0

    def sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """Elementwise the sum of every rank's `value` (one process: itself)."""
        return value

    def max_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """Elementwise the largest of every rank's `values`; NaN travels as inf, which the maximum keeps."""
        return values.nan_to_num(nan=math.inf)

    def sum_gradients(self, params: list[torch.Tensor]) -> None:
        """Sum the gradients of `params` over the ranks, once per step before clipping (one process: nothing)."""

    def reduction_metrics(self) -> dict[str, float]:
        """What the last `sum_gradients` sent, for the logs (one process: nothing)."""
        return {}

    def gradient_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The total norm of the gradients of `params` as the optimizers will use them (after `sum_gradients`)."""
        return torch.nn.utils.get_total_norm([p.grad for p in params])

    def whole_factors(self, low_rank: dict[str, LowRankDelta]) -> dict[str, LowRankDelta]:
        """Low-rank deltas with all d rows of F (a sharded strategy gathers them; here they are whole already)."""
        return low_rank

    def whole_policy_state(self) -> dict[str, torch.Tensor] | None:
        """The policy's whole state dict for an export, gathered on rank 0 where the weights are sharded; None where
        every rank holds them whole (rank 0 saves its own). Every rank calls it."""
        return None

    def all_finished(self, finished: torch.Tensor) -> bool:
        """Whether in-process generation may stop: every row of this rank finished (under FSDP: of every rank)."""
        return bool(finished.all())


class StrategyCollectives(Collectives):
    """The project's strategies, which are Lightning strategies too: reductions through the strategy's own."""

    def sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        return self.reduce(value, reduce_op="sum")

    def max_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        values = values.to(self.root_device).nan_to_num(nan=math.inf)
        return values if getattr(self, "world_size", 1) == 1 else self.reduce(values, reduce_op="max")


class LightningCollectives(Collectives):
    """A run on one of Lightning's own strategies: one device, or DDP's wrapper, which averages the gradients over
    the ranks inside every backward pass (a collective: every rank runs as many). The module normalizes its loss by
    the global batch's counts, so the loss is scaled by the world size to make that average the sum."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    @property
    def wrapped(self) -> bool:
        return isinstance(self.trainer.model, DistributedDataParallel)  # (wrapped when the strategy sets up)

    @property
    def lockstep(self) -> bool:
        return self.wrapped

    @property
    def loss_scale(self) -> float:
        return float(self.trainer.world_size) if self.wrapped else 1.0

    def sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        return self.trainer.strategy.reduce(value, reduce_op="sum")

    def max_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        values = values.to(self.trainer.strategy.root_device).nan_to_num(nan=math.inf)
        return values if self.trainer.world_size == 1 else self.trainer.strategy.reduce(values, reduce_op="max")


def collectives_of(trainer) -> Collectives:
    """The run's `Collectives`: its strategy's, or Lightning's own wrapped."""
    strategy = trainer.strategy
    return strategy if isinstance(strategy, Collectives) else LightningCollectives(trainer)
