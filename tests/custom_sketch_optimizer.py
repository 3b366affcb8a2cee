"""A sketch optimizer defined outside the package, as a user would: one class in one file (test_cli selects it)."""

import torch

from lightning_logra.sketch import SketchOptimizer


class SketchSignSGD(SketchOptimizer):
    """U = sign(S): signSGD on the sketch coordinates; no state."""

    def __init__(self, layers: dict, lr: float, refresh_every: int | None = None, rounding: str = "stochastic",
                 factor_dtype: str = "float32") -> None:
        super().__init__(layers, dict(lr=lr), refresh_every, rounding, factor_dtype)
        self.directions: dict[str, torch.Tensor] = {}  # the last U per layer, for the test to check the merge

    def _direction(self, sketch, state, group):
        direction = torch.sign(sketch)
        self.directions[self._layer_of_sketch(sketch)] = direction
        return direction

    def _layer_of_sketch(self, sketch):
        return next(layer.name for layer in self.layers if layer.sketch is sketch)

    def state_tensors_per_layer(self) -> int:
        return 0
