"""A Fabric strategy that installs the sketches: Fabric users get what `SketchStrategy` gives the Trainer.

    fabric = Fabric(accelerator="cuda", devices=1, strategy=SketchFabricStrategy(SketchConfig(rank=64)))
    model = fabric.setup(model)                                      # installs the sketches, freezes the rest
    optimizer = fabric.setup_optimizers(*fabric.strategy.optimizers)  # the sketch optimizer (+ AdamW, see below)

Why two calls and not `fabric.setup(model, optimizer)`: the sketch optimizer's parameters are the layers' d×r
sketch carriers, which exist only once the sketches are installed, so no optimizer can be built before set-up.
This is the order Fabric already asks for when a strategy changes the model's parameters (FSDP: `setup_module`,
then build the optimizer, then `setup_optimizers`). The strategy builds the optimizers from its `SketchConfig`
(`build_optimizers`: SketchSGD or SketchAdam, plus an AdamW over the densely trained parameters when `train_rest`
or `train_bias`) and keeps them in `strategy.optimizers`, and their `lr_schedule` in `strategy.lr_schedulers` (one
per optimizer: call `.step()` on each after every update you apply). An optimizer built by the user is refused
rather than ignored: it would hold the dense weights that the sketches have just frozen.
"""

from __future__ import annotations

import torch
from lightning.fabric.strategies import SingleDeviceStrategy
from torch import nn

from lightning_logra.sketch.config import SketchConfig
from lightning_logra.sketch.install import sketched_layers
from lightning_logra.sketch.linear import SketchedLinear
from lightning_logra.train.checkpoint import AtomicCheckpointIO

_USAGE = "model = fabric.setup(model); optimizer = fabric.setup_optimizers(*fabric.strategy.optimizers)"


class SketchFabricStrategy(SingleDeviceStrategy):
    """One device, the one Fabric's `accelerator` and `devices` select. `fabric.save` writes atomically
    (AtomicCheckpointIO); the sketch optimizer's state records its sketch settings, so `fabric.load` refuses a
    checkpoint taken under other ones. After set-up, `handles` maps each sketched layer's name to its
    SketchedLinear (`.weight`, `.projection()`, `.sketch`)."""

    def __init__(self, sketch: SketchConfig | None = None) -> None:
        super().__init__(checkpoint_io=AtomicCheckpointIO())
        self.config = sketch or SketchConfig()
        self.handles: dict[str, SketchedLinear] = {}
        self.optimizers: list[torch.optim.Optimizer] = []
        self.lr_schedulers: list[torch.optim.lr_scheduler.LambdaLR] = []
        self._parallel_devices: list[torch.device] | None = None

    # As in Lightning's parallel strategies: Fabric's accelerator connector fills an empty `parallel_devices` with
    # the devices that `accelerator` and `devices` select (SingleDeviceStrategy's own `device` would stay "cpu").
    @property
    def parallel_devices(self) -> list[torch.device] | None:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        if devices is not None and len(devices) > 1:
            raise ValueError(f"SketchFabricStrategy trains on one device, but Fabric selected {len(devices)} "
                             f"({[str(d) for d in devices]}): pass devices=1, or one GPU's index as devices=[i]")
        self._parallel_devices = devices

    @property
    def root_device(self) -> torch.device:
        # Before Fabric has set it, the CPU: SingleDeviceStrategy's default.
        return self._parallel_devices[0] if self._parallel_devices else self._root_device

    def setup_module(self, module: nn.Module) -> nn.Module:
        # Fabric has converted the module to its precision and moved it to root_device by now, so the projections
        # are generated on the device they are used on.
        if self.handles:
            raise RuntimeError("SketchFabricStrategy trains one model and has set one up already; move other models "
                               "(e.g. a frozen reference) with fabric.to_device(model) and run them under "
                               "fabric.autocast()")
        if sketched_layers(module):
            raise ValueError(f"the model already has sketches installed ({len(sketched_layers(module))} "
                             "SketchedLinear layers): pass it without them, SketchFabricStrategy installs them "
                             "from its SketchConfig")
        handles = self.config.install(module)
        self.optimizers = self.config.build_optimizers(module, handles)  # may refuse (bf16 with train_rest)
        self.lr_schedulers = self.config.build_schedulers(self.optimizers)
        self.handles = handles
        return module

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[torch.optim.Optimizer],
                                    scheduler=None) -> tuple:
        # fabric.setup(model, optimizer, ...): the optimizer was built before the sketches existed.
        names = ", ".join(type(o).__name__ for o in optimizers)
        raise ValueError(f"SketchFabricStrategy builds its optimizers from its SketchConfig once the sketches are "
                         f"installed, so it cannot take the optimizers passed to fabric.setup ({names}). Set up the "
                         f"model alone, then the strategy's optimizers: {_USAGE}")

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if not self.optimizers:
            raise RuntimeError(f"set up the model before the optimizers: {_USAGE}")
        if not any(optimizer is own for own in self.optimizers):
            raise ValueError(f"SketchFabricStrategy only sets up the optimizers it built ({_USAGE}), not this "
                             f"{type(optimizer).__name__}: parameters outside the sketched layers are frozen, or "
                             "trained by the AdamW it adds with sketch.train_rest / sketch.train_bias")
        return optimizer


__all__ = ["SketchFabricStrategy"]
