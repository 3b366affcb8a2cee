"""LoGRA's sketch core in plain PyTorch: projections, sketched linear layers, sketch optimizers, accounting. No
Lightning, nothing from the engines (imports only base/).

- projection.py   make_projection(seed, rank, in_features, distribution): A, bit-identical in every process
- linear.py       SketchedLinear: saves x·Aᵀ in forward, accumulates S = δᵀ(x·Aᵀ) in backward
- install.py      install_sketches / select_targets (suffix matching, clear errors), sketch_carriers
- shared.py       one projection per input (share_projection): the groups, x·Aᵀ computed once per input
- optim.py        SketchOptimizer (the base a new one subclasses), SketchSGD, SketchAdam: propose() → U, apply(α) →
                  W −= α·η·U·A; the update counter, the landed fraction, the settings of a resume
- update.py       LowRankDelta (F, A's seed, the rounding key: the one type of a low-rank update) and
                  apply_low_rank_update_, the in-place merge shared with the rollout engine; apply_stacked_update_
- rounding.py     stochastic rounding into bf16/fp16 with bits keyed by (seed, update, row, column)
- memory.py       memory_breakdown: bytes by category (weights, sketches, optimizer state, ...)
- config.py       SketchConfig: install + freeze the rest + build the optimizers, shared by all entry points
"""

from lightning_logra.sketch.install import install_sketches, sketched_layers
from lightning_logra.sketch.linear import SketchedLinear
from lightning_logra.sketch.memory import MemoryBreakdown, memory_breakdown
from lightning_logra.sketch.optim import SketchAdam, SketchOptimizer, SketchSGD
from lightning_logra.sketch.projection import DISTRIBUTIONS, make_projection, matrix_seed
from lightning_logra.sketch.update import apply_low_rank_update_

__all__ = [
    "DISTRIBUTIONS",
    "MemoryBreakdown",
    "SketchAdam",
    "SketchOptimizer",
    "SketchSGD",
    "SketchedLinear",
    "apply_low_rank_update_",
    "install_sketches",
    "make_projection",
    "matrix_seed",
    "memory_breakdown",
    "sketched_layers",
]
