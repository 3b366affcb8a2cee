"""The Lightning strategies of sketch and LoRA runs: how training is distributed (one device, DDP, FSDP2), and the
settings of the run they carry (`sketch`, `lora`). Fabric users have `fabric.SketchFabricStrategy`.

- base.py     Collectives: what a step asks of the ranks
- single.py   SketchStrategy, LoRAStrategy: one device
- ddp.py      SketchDDPStrategy: the d×r sketches summed once per step
- fsdp.py     SketchFSDPStrategy: FSDP2 shards by rows, sketches reduce-scattered once per step, state and merges for a
              rank's rows, sharded checkpoints
- fabric.py   SketchFabricStrategy: sketches installed at fabric.setup
"""

from lightning_logra.sketch.config import SketchConfig
from lightning_logra.train.lora import LoRAConfig
from lightning_logra.train.strategies.base import Collectives, LightningCollectives, collectives_of
from lightning_logra.train.strategies.ddp import SketchDDPStrategy
from lightning_logra.train.strategies.fsdp import SketchFSDPStrategy
from lightning_logra.train.strategies.single import LoRAStrategy, SketchStrategy

__all__ = ["Collectives", "LightningCollectives", "LoRAConfig", "LoRAStrategy", "SketchConfig",
           "SketchDDPStrategy", "SketchFSDPStrategy", "SketchStrategy", "collectives_of"]
