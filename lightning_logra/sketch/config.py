"""Everything needed to turn a model into a sketch-trained one, as one value shared by the Lightning and Fabric
strategies and plain-PyTorch users: install the sketches, freeze the rest, build the optimizers."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch
from torch import nn

from lightning_logra.base.schedule import LRSchedule
from lightning_logra.base.settings import check_at_least, check_positive
from lightning_logra.sketch.install import install_sketches, select_targets, sketch_carriers
from lightning_logra.sketch.linear import SketchedLinear
from lightning_logra.sketch.optim import SketchAdam, SketchOptimizer, SketchOptimizerFactory
from lightning_logra.sketch.rounding import LOW_PRECISION
from lightning_logra.sketch.shared import SHARED_INPUTS, find_groups

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Where a LightningCLI config sets a SketchConfig: errors name their field under it.
CONFIG_KEY = "trainer.strategy.init_args.sketch"


@dataclass
class SketchConfig:
    """How the policy is trained with sketches: which matrices, at what rank, by which sketch optimizer.

    Args:
        target_modules: the nn.Linear layers to sketch, by the last components of their names (`q_proj` selects
            every `...self_attn.q_proj`); every pattern must select at least one layer.
        rank: r, the rank of each d×r sketch; it must be smaller than in_features (k) of every target matrix.
        seed: the seed of the random projections A (one per matrix, derived from it).
        distribution: the entries of A: `rademacher` (±1/√r, the paper's) or `gaussian` (N(0, 1/r)).
        optimizer: the sketch optimizer, a `class_path` (`lightning_logra.sketch.SketchAdam`, `SketchSGD` or a
            subclass of `SketchOptimizer`) with its `init_args`: `lr` (η of the sketched matrices), its own
            settings, and `refresh_every`, `rounding`, `factor_dtype`.
        lr_schedule: warm-up and decay of the learning rates (the sketch optimizer's and `rest_lr`), by applied
            update; see `lightning_logra.base.schedule.LRSchedule`.
        cache_projection: keep each A (r×k) in memory (in the weights' bf16/fp16 where its entries are exact there,
            `projection.storage_dtype`); false regenerates it from its seed at every use.
        share_projection: one A per input instead of one per matrix: the matrices that read the same tensor (q_proj,
            k_proj, v_proj of a layer; gate_proj, up_proj) share one projection, and the forward pass computes and
            saves their x·Aᵀ once instead of three (two) times. Each sketch is still exactly G·Aᵀ, but those of one
            group become correlated through their common A, and every seed changes: off by default (the paper's
            per-matrix A), and a checkpoint resumes only under the setting it was taken with. It needs at least
            two such matrices of one layer among the targets.
        train_bias: train the biases of the sketched layers densely (AdamW at rest_lr).
        train_rest: train every other parameter (embeddings, norms, ...) densely with AdamW at rest_lr;
            otherwise they are frozen.
        rest_lr: the learning rate of the AdamW over densely trained parameters (train_bias, train_rest).
        rest_weight_decay: the weight decay of the AdamW over densely trained parameters.
    """

    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    rank: int = 64
    seed: int = 0
    distribution: Literal["rademacher", "gaussian"] = "rademacher"
    # The sketch optimizer: a SketchOptimizer subclass, with its hyperparameters bound by a config's init_args
    # (lr, betas, ..., refresh_every, rounding, factor_dtype); it is given the sketched layers when training starts.
    optimizer: SketchOptimizerFactory = SketchAdam
    lr_schedule: LRSchedule = field(default_factory=LRSchedule)
    cache_projection: bool = True
    share_projection: bool = False  # one A per input (q/k/v, gate/up), x·Aᵀ computed and saved once per input
    train_bias: bool = False  # biases of sketched layers, trained densely
    train_rest: bool = False  # every other parameter (embeddings, norms, ...) trained densely with AdamW
    rest_lr: float = 1e-6
    rest_weight_decay: float = 0.0

    def __post_init__(self) -> None:
        # Checked when a config is parsed, before anything is built; the checks that need the model's shapes are
        # in check_targets.
        check_positive(f"{CONFIG_KEY}.rank", self.rank, "integer (the rank r of each d×r sketch, smaller than "
                       "in_features of every target)", integer=True)
        if not isinstance(self.share_projection, bool):
            raise ValueError(f"{CONFIG_KEY}.share_projection must be true or false (one projection per input instead "
                             f"of one per matrix), got {self.share_projection!r}")
        if not self.target_modules:
            raise ValueError(f"{CONFIG_KEY}.target_modules is empty: name the linear layers to sketch, e.g. "
                             "[q_proj, v_proj]")
        check_positive(f"{CONFIG_KEY}.rest_lr", self.rest_lr, "learning rate")
        check_at_least(f"{CONFIG_KEY}.rest_weight_decay", self.rest_weight_decay, 0)

    def check_targets(self, model: nn.Module) -> None:
        """Refuse, naming the key, what install() would refuse: a pattern that selects nothing or something other
        than an nn.Linear, a tied weight, a rank not below a target's in_features. The model's weights need not
        exist: a skeleton on the meta device (built from its config.json) has the names and shapes."""
        with _named_keys():
            selected = select_targets(model, self.target_modules, self.rank)
            if self.share_projection and not find_groups(selected):
                pairs = " or ".join("/".join(children) for children in SHARED_INPUTS)
                raise ValueError(f"share_projection is true, but no two of target_modules {self.target_modules} read "
                                 f"the same input: sharing needs at least two of {pairs} of one layer among the "
                                 "targets; add them or set share_projection false")

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
        self.check_targets(model)
        handles = install_sketches(
            model, self.target_modules, self.rank, self.seed, self.distribution,
            cache_projection=self.cache_projection, train_bias=self.train_bias,
            share_projection=self.share_projection,
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

    def build_schedulers(self, optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.lr_scheduler.LambdaLR]:
        """One `lr_schedule` scheduler per optimizer, advanced by whoever applies the updates (the module)."""
        return [self.lr_schedule.scheduler(optimizer) for optimizer in optimizers]


@contextmanager
def _named_keys() -> Iterator[None]:
    """select_targets' errors begin with the argument they are about ("rank: ...", "target_modules: ..."); said
    under the config key, a user finds the line to change."""
    try:
        yield
    except (ValueError, TypeError) as err:
        raise type(err)(f"{CONFIG_KEY}.{err}") from None


def _describe(factory: SketchOptimizerFactory) -> tuple[str, dict[str, Any]]:
    """(class name, bound init_args) of a sketch optimizer factory: a class, a functools.partial of one, or the
    partial a config's class_path + init_args becomes (the class is among its positional arguments)."""
    if isinstance(factory, functools.partial):
        cls = next((c for c in (factory.func, *factory.args) if isinstance(c, type)), factory.func)
        return getattr(cls, "__name__", str(cls)), dict(factory.keywords)
    return getattr(factory, "__name__", type(factory).__name__), {}
