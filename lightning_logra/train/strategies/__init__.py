"""The Lightning strategies of sketch and LoRA runs: how training is distributed (one device, DDP, FSDP2), and the
settings of the run they carry (`sketch`, `lora`). Fabric users have `fabric.SketchFabricStrategy`."""

from lightning_logra.sketch.config import SketchConfig
from lightning_logra.train.lora import LoRAConfig
from lightning_logra.train.strategies.base import Distribution, LightningDistribution, distribution_of
from lightning_logra.train.strategies.ddp import SketchDDPStrategy
from lightning_logra.train.strategies.fsdp import SketchFSDPStrategy
from lightning_logra.train.strategies.single import LoRAStrategy, SketchStrategy

__all__ = ["Distribution", "LightningDistribution", "LoRAConfig", "LoRAStrategy", "SketchConfig",
           "SketchDDPStrategy", "SketchFSDPStrategy", "SketchStrategy", "distribution_of"]
