"""Lightning wiring for sketch training: a strategy that installs the sketches when the Trainer sets up, and the
same installer for Fabric users. All the math lives in `lightning_logra.sketch`."""

from __future__ import annotations

from typing import Literal

import torch
from lightning.fabric import Fabric
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_logra.checkpoint import AtomicCheckpointIO
from lightning_logra.sketch.config import DEFAULT_TARGETS, SketchConfig
from lightning_logra.sketch.install import sketched_layers


class SketchStrategy(SingleDeviceStrategy):
    """Single-device training of the module's `policy` with LoGRA sketches on `target_modules`.

    The module's own `configure_optimizers` (its dense baseline) is not used: this strategy builds the sketch
    optimizer (and AdamW for the non-target parameters if `train_rest`). Checkpoints are written atomically.
    """

    strategy_name = "logra_sketch"

    def __init__(
        self,
        target_modules: list[str] = list(DEFAULT_TARGETS),
        rank: int = 64,
        seed: int = 0,
        distribution: Literal["rademacher", "gaussian"] = "rademacher",
        refresh_every: int | None = None,
        optimizer: Literal["sgd", "adam"] = "adam",
        lr: float = 1e-5,
        momentum: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        cache_projection: bool = True,
        train_bias: bool = False,
        train_rest: bool = False,
        rest_lr: float = 1e-6,
        rest_weight_decay: float = 0.0,
        device: str | None = None,
    ) -> None:
        if device is None:
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        super().__init__(device=device, checkpoint_io=AtomicCheckpointIO())
        self.config = SketchConfig(
            list(target_modules), rank, seed, distribution, refresh_every, optimizer, lr, momentum, tuple(betas), eps,
            cache_projection, train_bias, train_rest, rest_lr, rest_weight_decay,
        )
        self.handles: dict = {}

    @property
    def policy(self) -> nn.Module:
        return self.lightning_module.policy

    def setup(self, trainer: Trainer) -> None:
        # configure_model (which loads the policy) has run by now; the optimizers are built inside super().setup.
        if trainer.state.fn == TrainerFn.FITTING:
            self.handles = sketched_layers(self.policy) or self.config.install(self.policy)
        super().setup(trainer)

    def setup_optimizers(self, trainer: Trainer) -> None:
        self.optimizers = self.config.build_optimizers(self.policy, self.handles)
        self.lr_scheduler_configs = []


def setup_fabric(
    fabric: Fabric, model: nn.Module, config: SketchConfig
) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    """The Fabric adapter: install sketches with `config`, then `fabric.setup` the model and its optimizers."""
    handles = config.install(model)
    optimizers = config.build_optimizers(model, handles)
    model, *optimizers = fabric.setup(model, *optimizers)
    return model, optimizers


__all__ = ["SketchConfig", "SketchStrategy", "setup_fabric"]
