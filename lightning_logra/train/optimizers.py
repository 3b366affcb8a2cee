"""Any torch optimizer for the dense and LoRA modes, by class path: `trainer.strategy.init_args.dense.optimizer`, as
LightningCLI users write one.

    trainer:
      strategy:
        class_path: lightning_logra.train.strategies.DenseStrategy
        init_args:
          dense:
            optimizer:
              class_path: galore_torch.GaLoreAdamW
              init_args: {lr: 1.0e-5, rank: 128, update_proj_gap: 200, scale: 0.25}

`init_args` are the constructor's; `lr` and `weight_decay`, when left out, are the mode's own
(`trainer.strategy.init_args.dense.lr`, or `...lora.lr` under the LoRA strategy). Most optimizers take the trainable
parameters as they are (torch's, transformers' `Adafactor`, bitsandbytes' `AdamW8bit`, `flora_opt.Flora`). The low-rank
families take their projected matrices in a parameter group of their own that carries the projection's settings: for
those (`FAMILIES`: GaLore, Fira, APOLLO) the settings named in the family are moved from `init_args` into that group,
and the group holds every trained matrix of an nn.Linear whose sides both exceed the rank, the output head excepted
(their papers project the attention and MLP matrices); everything else is a plain group.

Their states keep a projector object per matrix (the projection matrix and its schedule), which a checkpoint loaded
with `weights_only=True` cannot hold (`train.safe_load`): `build` registers hooks that write each projector as a
plain dict of its attributes and rebuild it, as an instance of the family's own class, on load.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_logra.base.settings import check_positive

log = logging.getLogger(__name__)

# Optimizers that cannot take a training step here, and why.
_CANNOT_TRAIN = {
    torch.optim.Optimizer: "it is the base class, with no step of its own",
    torch.optim.LBFGS: "its step needs a closure that recomputes the loss, and a step here is one backward pass",
    torch.optim.SparseAdam: "it takes only sparse gradients, and these are dense",
}
_PROJECTOR = "__projector__"  # the key under which a checkpoint keeps a projector's class


@dataclass(frozen=True)
class Family:
    """Optimizers of one package whose projected matrices need a parameter group of their own."""

    package: str  # what `pip install` takes
    group_settings: dict[str, Any]  # the constructor's settings that belong to the projected group, with the
    # defaults of the package's README (its optimizers read every one from the group; `rank` must be given)
    projectors: tuple[str, ...]  # the classes (module.Class) their states keep per matrix


FAMILIES = {  # by the class path's top-level module
    "galore_torch": Family("galore-torch", {"rank": None, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"},
                           ("galore_torch.galore_projector.GaLoreProjector",)),
    "fira": Family("fira", {"rank": None, "update_proj_gap": 200, "alpha": 1.0, "proj_type": "std"},
                   ("fira.gradient_projection.GradientProjector",)),
    "apollo_torch": Family("apollo-torch", {"rank": None, "proj": "random", "scale_type": "channel", "scale": 1.0,
                                            "update_proj_gap": 200, "proj_type": "std"},
                           ("apollo_torch.random_projector.GradientProjector",
                            "apollo_torch.svd_projector.GaLoreProjector")),
}
_EXTRA = "pip install -e \".[peers]\""


@dataclass(frozen=True)
class OptimizerSpec:
    """A dense or LoRA run's `optimizer` (`key`: where the config sets it): a torch optimizer's class path and its
    constructor's arguments."""

    class_path: str
    init_args: dict[str, Any] = field(default_factory=dict)
    key: str = "optimizer"

    @classmethod
    def parse(cls, value: Any, key: str = "optimizer") -> OptimizerSpec | None:
        """From the config's value (None: the mode's AdamW; a class path; or {class_path, init_args}), checked: the
        class imports, is a torch optimizer, and takes every init_arg."""
        if value is None:
            return None
        if isinstance(value, str):
            value = {"class_path": value}
        if not isinstance(value, dict) or not isinstance(value.get("class_path"), str) or set(value) - {
                "class_path", "init_args"}:
            raise ValueError(f"{key} must be a class path or {{class_path: ..., init_args: {{...}}}} (e.g. "
                             f"class_path: torch.optim.AdamW), got {value!r}")
        init_args = value.get("init_args") or {}
        if not isinstance(init_args, dict):
            raise ValueError(f"{key}.init_args must be a mapping of the constructor's arguments, got {init_args!r}")
        spec = cls(value["class_path"], dict(init_args), key)
        spec.check()
        return spec

    @property
    def family(self) -> Family | None:
        return FAMILIES.get(self.class_path.split(".")[0])

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        module_name, _, name = self.class_path.rpartition(".")
        found = None
        if module_name:
            try:
                found = getattr(importlib.import_module(module_name), name, None)
            except ImportError as err:
                package = self.family.package if self.family else module_name.split(".")[0]
                raise ImportError(f"{self.key}.class_path: {self.class_path} does not import ({err}); install "
                                  f"{package} ({_EXTRA} installs every optimizer the benchmarks compare)") from None
        if not (inspect.isclass(found) and issubclass(found, torch.optim.Optimizer)):
            raise ValueError(f"{self.key}.class_path: {self.class_path} is not a torch.optim.Optimizer subclass "
                             "(give its full dotted path, e.g. torch.optim.AdamW)")
        why = _CANNOT_TRAIN.get(found) or ("it is a sketch optimizer: give it as the strategy's "
                                           "sketch.optimizer (SketchStrategy)" if found.__module__.startswith(
                                               "lightning_logra.sketch") else None)
        if why:
            raise ValueError(f"{self.key}.class_path: {self.class_path} cannot be the dense or LoRA optimizer: "
                             f"{why}; use e.g. torch.optim.AdamW")
        return found

    def check(self) -> None:
        """Refuse, naming the key, what the constructor would not take."""
        parameters = inspect.signature(self.optimizer_class().__init__).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        allowed = set(parameters) - {"self", "params"} | set(self.family.group_settings if self.family else ())
        for key in self.init_args:
            if not takes_any and key not in allowed:
                raise ValueError(f"{self.key}.init_args.{key}: {self.class_path} takes no such argument (it takes "
                                 f"{', '.join(sorted(allowed))})")
        if "lr" in self.init_args:
            check_positive(f"{self.key}.init_args.lr", self.init_args["lr"], why="the run's lr_schedule scales it")
        if self.family:
            check_positive(f"{self.key}.init_args.rank", self.init_args.get("rank"), integer=True,
                           why=f"{self.class_path} projects matrices to this rank (e.g. 128; APOLLO-Mini 1)")
            return
        # What torch would refuse only at the first step (weight_decay -1, betas [2, 0.9]): built once on a stand-in.
        try:
            self.optimizer_class()([nn.Parameter(torch.zeros(1))], **{"lr": 1e-3, **self.init_args})
        except (ValueError, TypeError) as err:
            raise ValueError(f"{self.key}.init_args: {self.class_path} refuses them ({err})") from None

    def build(self, policy: nn.Module, params: list[nn.Parameter], lr: float, weight_decay: float
              ) -> torch.optim.Optimizer:
        """The optimizer of `params` (the mode's trainable parameters, all in `policy`); `lr` and `weight_decay` are
        the mode's, used where init_args leave them out."""
        optimizer_class = self.optimizer_class()
        args = {"lr": lr, "weight_decay": weight_decay, **self.init_args}
        if "weight_decay" not in inspect.signature(optimizer_class.__init__).parameters:
            args.pop("weight_decay")
        family = self.family
        if family is None:
            return optimizer_class(params, **args)
        group = {key: args.pop(key, default) for key, default in family.group_settings.items()}
        projected = projected_matrices(policy, params, group["rank"], self.key)
        if not projected:
            log.warning("%s.init_args.rank=%d is at or above both sides of every trained matrix: %s projects none of "
                        "them and trains as its plain optimizer (AdamW) would; give a smaller rank", self.key,
                        group["rank"], self.class_path)
        plain = [p for p in params if id(p) not in {id(q) for q in projected}]
        groups = [g for g in ({"params": plain}, {"params": projected, **group}) if g["params"]]
        optimizer = optimizer_class(groups, **args)
        optimizer.register_state_dict_post_hook(_projectors_to_dicts)
        optimizer.register_load_state_dict_pre_hook(_dicts_to_projectors(family))
        return optimizer


def build_optimizer(spec: OptimizerSpec | None, policy: nn.Module, params: list[nn.Parameter], lr: float,
                    weight_decay: float) -> torch.optim.Optimizer:
    """A dense or LoRA run's optimizer: the `optimizer` its strategy names, or torch's AdamW when it names none."""
    if spec is None:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    return spec.build(policy, params, lr, weight_decay)


def projected_matrices(policy: nn.Module, params: list[nn.Parameter], rank: int, key: str = "optimizer"
                       ) -> list[nn.Parameter]:
    """The matrices a low-rank family projects: each trained weight of an nn.Linear other than the output head, with
    both sides above `rank` (a narrower one has nothing to gain). Each must be held whole: a projection of one
    process's shard (FSDP) is not the projection of the matrix, and the ranks' projections would differ."""
    trained = {id(p) for p in params}
    head = policy.get_output_embeddings() if hasattr(policy, "get_output_embeddings") else None
    head_weight = getattr(head, "weight", None)
    layers = [(name, m) for name, m in policy.named_modules() if isinstance(m, nn.Linear) and id(m.weight) in trained
              and m.weight is not head_weight and min(m.in_features, m.out_features) > rank]
    for name, m in layers:
        local = m.weight.to_local() if isinstance(m.weight, DTensor) else m.weight
        if local is not m.weight or tuple(local.shape) != (m.out_features, m.in_features):
            raise ValueError(f"{key}: {name}.weight is sharded ({type(m.weight).__name__} of local shape "
                             f"{tuple(local.shape)}), and a low-rank family projects each matrix's whole gradient: "
                             "train it on one device or with DDP (whole weights on every rank), or pick an optimizer "
                             "without a projection")
    return [m.weight for _, m in layers]


def _projectors_to_dicts(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """A state_dict post-hook: each projector object as {__projector__: its class, its attributes}. (The state_dict's
    per-parameter dicts are the optimizer's own: each is replaced, not changed.)"""
    for index, state in state_dict["state"].items():
        projector = state.get("projector")
        if projector is not None and not isinstance(projector, dict):
            kind = type(projector)
            saved = {_PROJECTOR: f"{kind.__module__}.{kind.__qualname__}", **vars(projector)}
            state_dict["state"][index] = {**state, "projector": saved}
    return state_dict


def _dicts_to_projectors(family: Family):
    """A load_state_dict pre-hook: each projector rebuilt from its dict, as the family's own class (no other)."""

    def hook(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        for index, state in state_dict["state"].items():
            saved = state.get("projector")
            if not isinstance(saved, dict):
                continue
            attributes = dict(saved)
            path = attributes.pop(_PROJECTOR, None)
            if path not in family.projectors:
                raise ValueError(f"the checkpoint's optimizer state holds a projector of class {path!r}, not one of "
                                 f"{family.package}'s ({', '.join(family.projectors)})")
            module_name, _, name = path.rpartition(".")
            projector = object.__new__(getattr(importlib.import_module(module_name), name))
            projector.__dict__.update(attributes)  # data only: tensors, numbers and strings
            state_dict["state"][index] = {**state, "projector": projector}

    return hook
