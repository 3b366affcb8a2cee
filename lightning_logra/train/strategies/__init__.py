"""The Lightning strategies of sketch and LoRA runs: how training is distributed (one device, DDP, FSDP2), and the
settings of the run they carry (`sketch`, `lora`). Fabric users have `fabric.SketchFabricStrategy`."""

from lightning_logra.sketch.config import SketchConfig
from lightning_logra.train.lora import LoRAConfig
from lightning_logra.train.strategies.base import Collectives, LightningCollectives, collectives_of
from lightning_logra.train.strategies.ddp import SketchDDPStrategy
from lightning_logra.train.strategies.fsdp import SketchFSDPStrategy
from lightning_logra.train.strategies.single import LoRAStrategy, SketchStrategy

__all__ = ["Collectives", "LightningCollectives", "LoRAConfig", "LoRAStrategy", "SketchConfig",
           "SketchDDPStrategy", "SketchFSDPStrategy", "SketchStrategy", "collectives_of"]
