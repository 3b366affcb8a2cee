"""The step-size contract: between proposing a training step's update and applying it, the module asks the run's
step-size controller for the scale α of the whole update — its sketched and its densely trained parts alike.

A controller is a Lightning callback that also subclasses `StepSizeController` (`PredictedKLBudget`): it stays a
config-toggled piece of the run, and the module finds it among `trainer.callbacks` when fitting starts (at most
one). Without a controller every update is taken at α = 1.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

from lightning_logra.batch import Rollout
from lightning_logra.update import Update


class StepSizeController(ABC):
    @abstractmethod
    def choose_alpha(self, module: Any, proposal: Update, rollout: Rollout) -> float:
        """α ≥ 0 for `proposal`, the step's update at α = 1 (the policy's weights are still the step's starting
        point). `module` is the RLVRModule, `rollout` the step's batch. Every rank must return the same α."""


def find_controller(callbacks: Iterable[Any]) -> StepSizeController | None:
    """The run's step-size controller among the Trainer's callbacks, if any; two would fight over α: refused."""
    controllers = [callback for callback in callbacks if isinstance(callback, StepSizeController)]
    if len(controllers) > 1:
        names = [type(controller).__name__ for controller in controllers]
        raise ValueError(f"trainer.callbacks: {names} each choose the step size α; keep one of them")
    return controllers[0] if controllers else None
