"""One device: the sketch run's strategy, the LoRA run's and the dense run's, each holding the run's settings and
writing checkpoints atomically. What is trained, and how, is the training mode's (`lightning_logra.train.modes`)."""

from __future__ import annotations

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_logra.sketch.config import SketchConfig
from lightning_logra.train.checkpoint import AtomicCheckpointIO
from lightning_logra.train.dense import DenseConfig
from lightning_logra.train.lora import LoRAConfig
from lightning_logra.train.strategies.base import StrategyCollectives


class _OneDevice(StrategyCollectives, SingleDeviceStrategy):
    def __init__(self, device: str | None) -> None:
        super().__init__(checkpoint_io=AtomicCheckpointIO())
        # As in Lightning's parallel strategies: the Trainer's accelerator connector fills an empty `parallel_devices`
        # with the devices that `accelerator` and `devices` select, and one given here makes it check the accelerator
        # against it instead.
        self.parallel_devices = None if device is None else [torch.device(device)]

    @property
    def root_device(self) -> torch.device:
        # Before a Trainer has set it, the CPU: SingleDeviceStrategy's default.
        return self.parallel_devices[0] if self.parallel_devices else self._root_device


class SketchStrategy(_OneDevice):
    """Single-device training of the module's `policy` with LoGRA sketches."""

    strategy_name = "logra_sketch"

    def __init__(self, sketch: SketchConfig = SketchConfig(), device: str | None = None) -> None:
        """
        Args:
            sketch: which matrices are sketched, at what rank, and the sketch optimizer (`SketchConfig`).
            device: the device to train on, e.g. `cuda:1`; None takes the Trainer's (`trainer.accelerator` and
                `trainer.devices`).
        """
        super().__init__(device)
        self.config = sketch


class LoRAStrategy(_OneDevice):
    """Single-device LoRA training of the module's `policy` (peft adapters, AdamW): the paper's comparison method.
    Checkpoints record the adapters' settings; a resume under others is refused."""

    strategy_name = "lora"

    def __init__(self, lora: LoRAConfig = LoRAConfig(), device: str | None = None) -> None:
        """
        Args:
            lora: which matrices are adapted, the adapters' rank, alpha and dropout, and their AdamW (`LoRAConfig`).
            device: the device to train on, e.g. `cuda:1`; None takes the Trainer's.
        """
        super().__init__(device)
        self.config = lora


class DenseStrategy(_OneDevice):
    """Single-device dense training of the module's `policy` (AdamW, or the optimizer `dense.optimizer` names): the
    baseline, and the optimizers users would pick instead."""

    strategy_name = "dense"

    def __init__(self, dense: DenseConfig = DenseConfig(), device: str | None = None) -> None:
        """
        Args:
            dense: what is trained (every parameter, or the target matrices' weights) and by which optimizer
                (`DenseConfig`).
            device: the device to train on, e.g. `cuda:1`; None takes the Trainer's.
        """
        super().__init__(device)
        self.config = dense
