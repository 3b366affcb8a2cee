"""Everything needed to turn a model into a sketch-trained one, as one value shared by the Lightning and Fabric
strategies and plain-PyTorch users: install the sketches, freeze the rest, build the optimizers."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch
from torch import nn

from lightning_logra.sketch.install import install_sketches, sketch_carriers
from lightning_logra.sketch.linear import SketchedLinear
from lightning_logra.sketch.optim import SketchAdam, SketchOptimizer, SketchOptimizerFactory
from lightning_logra.sketch.rounding import LOW_PRECISION

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class SketchConfig:
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    rank: int = 64
    seed: int = 0
    distribution: Literal["rademacher", "gaussian"] = "rademacher"
    # The sketch optimizer: a SketchOptimizer subclass, with its hyperparameters bound by a config's init_args
    # (lr, betas, ..., refresh_every, rounding, factor_dtype); it is given the sketched layers when training starts.
    optimizer: SketchOptimizerFactory = SketchAdam
    cache_projection: bool = True
    train_bias: bool = False  # biases of sketched layers, trained densely
    train_rest: bool = False  # every other parameter (embeddings, norms, ...) trained densely with AdamW
    rest_lr: float = 1e-6
    rest_weight_decay: float = 0.0

    def hparams(self) -> dict[str, Any]:
        """The settings as flat hyperparameters for the loggers (TensorBoard's HParams view tells runs apart by
        them): `sketch/<field>`, and `sketch/optimizer` with `sketch/optimizer/<init_arg>`."""
        settings = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "optimizer"}
        settings["optimizer"], arguments = _describe(self.optimizer)
        settings.update({f"optimizer/{k}": v for k, v in arguments.items()})
        return {f"sketch/{k}": v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
                for k, v in settings.items()}

    def install(self, model: nn.Module) -> dict[str, SketchedLinear]:
        """Install the sketches; freeze every other parameter unless `train_rest`."""
        handles = install_sketches(
            model, self.target_modules, self.rank, self.seed, self.distribution,
            cache_projection=self.cache_projection, train_bias=self.train_bias,
        )
        carriers = sketch_carriers(model)
        biases = {id(h.bias) for h in handles.values() if h.bias is not None}
        for param in model.parameters():
            if id(param) not in carriers and id(param) not in biases and param.requires_grad:
                param.requires_grad_(self.train_rest)
        return handles

    def build_optimizers(self, model: nn.Module, handles: dict[str, SketchedLinear]) -> list[torch.optim.Optimizer]:
        """[sketch optimizer] plus, when anything else is trainable, an AdamW over it."""
        sketch = self.optimizer(handles)
        if not isinstance(sketch, SketchOptimizer):
            raise TypeError(f"sketch.optimizer must build a lightning_logra.sketch.SketchOptimizer (SketchAdam, "
                            f"SketchSGD or a subclass), got {type(sketch).__name__}")
        carriers = sketch_carriers(model)
        dense = [p for p in model.parameters() if p.requires_grad and id(p) not in carriers]
        if not dense:
            return [sketch]
        low = sorted({str(p.dtype).removeprefix("torch.") for p in dense if p.dtype in LOW_PRECISION})
        if low:
            # torch's AdamW rounds each step into the parameter to nearest: at RL learning rates most of it is lost.
            raise ValueError(
                f"sketch.train_rest / sketch.train_bias: the densely trained parameters are {low}, and AdamW rounds "
                "their updates to nearest, which loses most of each step at RL learning rates; train them in fp32 "
                "(model.dtype float32 with trainer.precision bf16-mixed) or leave train_rest and train_bias off"
            )
        return [sketch, torch.optim.AdamW(dense, lr=self.rest_lr, weight_decay=self.rest_weight_decay)]


def _describe(factory: SketchOptimizerFactory) -> tuple[str, dict[str, Any]]:
    """(class name, bound init_args) of a sketch optimizer factory: a class, a functools.partial of one, or the
    partial a config's class_path + init_args becomes (the class is among its positional arguments)."""
    if isinstance(factory, functools.partial):
        cls = next((c for c in (factory.func, *factory.args) if isinstance(c, type)), factory.func)
        return getattr(cls, "__name__", str(cls)), dict(factory.keywords)
    return getattr(factory, "__name__", type(factory).__name__), {}
