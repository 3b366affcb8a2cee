"""Learning-rate schedules: linear warm-up over the first updates, then constant, linear or cosine decay to a floor.

One `LRSchedule` scales every optimizer of a run by the same factor of its own learning rate: the sketch optimizer
(`sketch.optimizer.init_args.lr`) and the AdamW of densely trained parameters (`sketch.rest_lr`) under a sketch
strategy, or the dense baseline's AdamW (`trainer.strategy.init_args.dense.lr`), so that a sketch run and its baseline
follow the same schedule.

The schedule counts *applied* updates: the module advances it after each update that reached the weights, and a
skipped update (a NaN anywhere, `train/update_skipped`) leaves it where it was, so the warm-up and the decay are
spent on updates that happened. It is a torch `LambdaLR` over each optimizer, which Lightning checkpoints with the
optimizers: a resumed run continues it exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from lightning_logra.base.settings import check_at_least

Decay = Literal["constant", "linear", "cosine"]


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate of update i (counted from 0) is lr × factor(i).

    Args:
        warmup_steps: the factor rises linearly over this many updates, (i + 1) / warmup_steps, reaching 1 at the
            last of them; 0 starts at the full learning rate.
        decay: after the warm-up, `constant` keeps the full learning rate; `linear` and `cosine` lower it to
            min_lr_ratio × lr at update total_steps and keep it there.
        total_steps: the update at which a decay reaches its floor (usually trainer.max_steps); required for
            linear and cosine decay, and larger than warmup_steps.
        min_lr_ratio: the floor of a decay as a fraction of the learning rate, in [0, 1].
    """

    warmup_steps: int = 0
    decay: Decay = "constant"
    total_steps: int | None = None
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        check_at_least("lr_schedule.warmup_steps", self.warmup_steps, 0, "number of updates", integer=True)
        if self.decay not in ("constant", "linear", "cosine"):
            raise ValueError(f"lr_schedule.decay must be constant, linear or cosine, got {self.decay!r}")
        if self.decay != "constant" and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            raise ValueError(f"lr_schedule.total_steps: decay {self.decay!r} needs the update at which it reaches its "
                             f"floor, larger than warmup_steps={self.warmup_steps} (usually trainer.max_steps); got "
                             f"{self.total_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"lr_schedule.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    def factor(self, update: int) -> float:
        """The multiplier of the learning rate at applied update `update` (0 is the first)."""
        if update < self.warmup_steps:
            return (update + 1) / self.warmup_steps
        if self.decay == "constant":
            return 1.0
        progress = min((update - self.warmup_steps) / (self.total_steps - self.warmup_steps), 1.0)
        shape = 1.0 - progress if self.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape

    def scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        """A LambdaLR that sets each group's lr to its initial lr × factor(updates taken), starting at factor(0).
        Its state (the count) is checkpointed; the factor is not (a plain function), so a resumed run takes the
        schedule from its own config."""
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: self.factor(update))
