"""LoGRA's sketch core in plain PyTorch: projections, sketched linear layers, sketch optimizers, accounting."""

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
