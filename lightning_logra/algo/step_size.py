"""The step-size contract: between proposing a training step's update and applying it, the module asks the run's
step-size controller for the scale α of the whole update — its sketched and its densely trained parts alike — and,
once it is applied, tells the controller what was applied.

A controller is a Lightning callback that also subclasses `StepSizeController` (`PredictedKLBudget`): it stays a
config-toggled piece of the run, and the module finds it among `trainer.callbacks` when fitting starts (at most
one). Without a controller every update is taken at α = 1. What it measures with (the policy, the sampling
temperature, the step, the ranks) is handed to it in a `StepContext`; it reads nothing out of the module. Before the
step's forward passes it may name rows whose current-policy states those passes should keep for it (`recorder`): the
policy is at the same point then, and a forward pass it would run again is saved.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_logra.algo.kl import StateRecorder
from lightning_logra.algo.update import Update
from lightning_logra.base.batch import Rollout


@dataclass
class StepContext:
    """What a controller measures a step's proposal with."""

    policy: nn.Module  # the policy the step trains, at the step's starting point until the update is applied
    temperature: float  # the distribution the rollouts were sampled from
    step: int  # the training step (0 first): what budgets are scheduled by and subsets drawn with
    rank: int
    world_size: int
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor]  # a collective every rank calls at the same point
    # (N,) where each of this rank's rows stands in the step's global batch as one process holds it (dynamic
    # sampling: `Drawn.positions`); None: rank-major
    positions: torch.Tensor | None = None
    # what the update's forward passes recorded for the controller (its `recorder`), once they ran
    recorded: StateRecorder | None = None


class StepSizeController(ABC):
    def recorder(self, rollout: Rollout, context: StepContext) -> StateRecorder | None:
        """Called before the step's forward passes: a `StateRecorder` of the rows whose current-policy states the
        controller will measure, kept from those passes (None: nothing to keep). It comes back in
        `choose_alpha`'s context as `recorded`."""
        return None

    @abstractmethod
    def choose_alpha(self, proposal: Update, rollout: Rollout, context: StepContext) -> float:
        """α ≥ 0 for `proposal`, the step's update at α = 1 (the policy's weights are still the step's starting
        point); `rollout` is this rank's share of the step's batch. Every rank must return the same α."""

    @abstractmethod
    def applied(self, update: Update | None) -> dict[str, float]:
        """Called once the step's update is applied (None: it was skipped, the weights unchanged), after every
        `choose_alpha` and on every rank; returns the step's metrics to log (NaN where they do not apply)."""


def find_controller(callbacks: Iterable[Any]) -> StepSizeController | None:
    """The run's step-size controller among the Trainer's callbacks, if any; two would fight over α: refused."""
    controllers = [callback for callback in callbacks if isinstance(callback, StepSizeController)]
    if len(controllers) > 1:
        names = [type(controller).__name__ for controller in controllers]
        raise ValueError(f"trainer.callbacks: {names} each choose the step size α; keep one of them")
    return controllers[0] if controllers else None
