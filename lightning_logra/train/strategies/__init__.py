"""The Lightning strategies of sketch, LoRA and dense runs: how training is distributed (one device, DDP, FSDP2), and
the settings of the run they carry (`sketch`, `lora`, `dense`). Fabric users have `fabric.SketchFabricStrategy`.

- base.py     Collectives: what a step asks of the ranks
- single.py   SketchStrategy, LoRAStrategy, DenseStrategy: one device
- ddp.py      SketchDDPStrategy: the d×r sketches summed once per step; DenseDDPStrategy: Lightning's DDP wrapper
- fsdp.py     SketchFSDPStrategy: FSDP2 shards by rows, sketches reduce-scattered once per step, state and merges for a
              rank's rows, sharded checkpoints
- fabric.py   SketchFabricStrategy: sketches installed at fabric.setup
"""

from lightning_logra.sketch.config import SketchConfig
from lightning_logra.train.dense import DenseConfig
from lightning_logra.train.lora import LoRAConfig
from lightning_logra.train.strategies.base import Collectives, LightningCollectives, collectives_of
from lightning_logra.train.strategies.ddp import DenseDDPStrategy, SketchDDPStrategy
from lightning_logra.train.strategies.fsdp import SketchFSDPStrategy
from lightning_logra.train.strategies.single import DenseStrategy, LoRAStrategy, SketchStrategy

__all__ = ["Collectives", "DenseConfig", "DenseDDPStrategy", "DenseStrategy", "LightningCollectives", "LoRAConfig",
           "LoRAStrategy", "SketchConfig", "SketchDDPStrategy", "SketchFSDPStrategy", "SketchStrategy",
           "collectives_of"]
