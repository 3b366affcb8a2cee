"""The dense run's settings (`trainer.strategy.init_args.dense`, `DenseStrategy` / `DenseDDPStrategy`): AdamW, or any
torch optimizer by class path, on every parameter or on the weights of the target matrices. A run on one of
Lightning's own strategies trains densely with the defaults."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from lightning_logra.base.schedule import LRSchedule
from lightning_logra.base.settings import check_at_least, check_positive
from lightning_logra.train.optimizers import OptimizerSpec

CONFIG_KEY = "trainer.strategy.init_args.dense"


@dataclass
class DenseConfig:
    """What a dense run trains and with what.

    Args:
        lr: the optimizer's learning rate.
        weight_decay: the optimizer's weight decay.
        optimizer: another torch optimizer by `class_path` and `init_args` (`galore_torch.GaLoreAdamW`,
            `apollo_torch.APOLLOAdamW`, `transformers.optimization.Adafactor`, `bitsandbytes.optim.AdamW8bit`, ...;
            `lightning_logra.train.optimizers`); init_args without `lr` / `weight_decay` take the two above. None:
            AdamW.
        lr_schedule: warm-up and decay of lr, by applied update (`lightning_logra.base.schedule.LRSchedule`).
        target_modules: train only the weights of these nn.Linear layers (named as `sketch.target_modules`: `q_proj`
            selects every `...self_attn.q_proj`), the parameters a sketch or LoRA run trains, and freeze the rest;
            None trains every parameter.
    """

    lr: float = 1e-6
    weight_decay: float = 0.0
    optimizer: dict[str, Any] | str | None = None
    lr_schedule: LRSchedule = field(default_factory=LRSchedule)
    target_modules: list[str] | None = None

    def __post_init__(self) -> None:
        check_positive(f"{CONFIG_KEY}.lr", self.lr, "learning rate")
        check_at_least(f"{CONFIG_KEY}.weight_decay", self.weight_decay, 0)
        self.optimizer_spec()  # the class imports and takes its init_args
        if self.target_modules is not None and not self.target_modules:
            raise ValueError(f"{CONFIG_KEY}.target_modules is empty: name the linear layers the dense run trains, "
                             "e.g. [q_proj, v_proj], or leave it null to train every parameter")

    def optimizer_spec(self) -> OptimizerSpec | None:
        return OptimizerSpec.parse(self.optimizer, f"{CONFIG_KEY}.optimizer")

    def hparams(self) -> dict[str, Any]:
        """The settings as flat hyperparameters for the loggers: `dense/<field>` (the optimizer apart)."""
        settings = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "optimizer"}
        return {f"dense/{k}": v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in settings.items()}
