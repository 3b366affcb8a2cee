"""Selecting target weights and swapping their `nn.Linear`s for `SketchedLinear`s."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_logra.base.settings import check_positive
from lightning_logra.sketch.linear import SketchedLinear
from lightning_logra.sketch.projection import DISTRIBUTIONS
from lightning_logra.sketch.shared import find_groups


def _matches(name: str, pattern: str) -> bool:
    # Suffix match on whole name components: "q_proj" selects "model.layers.0.self_attn.q_proj" but not "xq_proj".
    return name == pattern or name.endswith("." + pattern)


def install_sketches(
    model: nn.Module,
    target_modules: Sequence[str],
    rank: int,
    seed: int = 0,
    distribution: str = "rademacher",
    *,
    cache_projection: bool = True,
    train_bias: bool = False,
    share_projection: bool = False,
) -> dict[str, SketchedLinear]:
    """Replace every `nn.Linear` whose name ends with one of `target_modules` by a `SketchedLinear`.

    Returns {module name: handle}, in module order. Each handle exposes `.weight`, `.projection()` and `.sketch`.
    Sketched weights are frozen (no `.grad`); their biases are trained densely only if `train_bias`. Nothing
    else in the model is changed. `cache_projection=False` regenerates A from its seed at every use instead of
    keeping an r×k buffer per layer (less memory, more compute). `share_projection=True` gives the matrices that read
    one input (q/k/v, gate/up of a layer) one A and one x·Aᵀ between them (`lightning_logra/sketch/shared.py`).
    """
    if isinstance(target_modules, str):
        target_modules = [target_modules]
    if not target_modules:
        raise ValueError("target_modules is empty: name the linear layers to sketch, e.g. ['q_proj', 'v_proj']")
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    check_positive("rank", rank, integer=True)
    selected = select_targets(model, target_modules, rank)
    groups = find_groups(selected) if share_projection else {}
    handles: dict[str, SketchedLinear] = {}
    for name, linear in selected.items():
        handle = SketchedLinear(linear, name, rank, seed, distribution, cache_projection, groups.get(name))
        if linear.bias is not None:
            linear.bias.requires_grad_(train_bias)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, handle)
        handles[name] = handle
    return handles


def select_targets(model: nn.Module, target_modules: Sequence[str], rank: int) -> dict[str, nn.Linear]:
    """{name: nn.Linear} of every module `target_modules` selects, in module order; an error naming the pattern for
    one that selects nothing, something other than an nn.Linear, a layer already sketched, a weight shared with
    another module, or a matrix whose in_features is not larger than `rank`. Each message begins with the argument
    it is about ("target_modules: ", "rank: "), so a caller can say where that argument is set. Only names and
    shapes are read: the model may be a skeleton on the meta device."""
    modules = dict(model.named_modules())
    owners: dict[int, list[str]] = {}
    for pname, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(pname)
    selected: dict[str, nn.Linear] = {}
    for pattern in target_modules:
        names = [name for name in modules if _matches(name, pattern)]
        if not names:
            linear_suffixes = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items() if isinstance(m, nn.Linear)})
            raise ValueError(
                f"target_modules: {pattern!r} matches no module of {type(model).__name__}; "
                f"linear layers it has: {linear_suffixes}"
            )
        for name in names:
            selected[name] = _check_target(modules[name], name, pattern, rank, owners)
    return {name: selected[name] for name in sorted(selected, key=list(modules).index)}


def _check_target(module: nn.Module, name: str, pattern: str, rank: int, owners: dict[int, list[str]]) -> nn.Linear:
    if isinstance(module, SketchedLinear):
        raise ValueError(f"target_modules: {name!r} is already sketched (install_sketches ran twice?)")
    if not isinstance(module, nn.Linear):
        raise TypeError(
            f"target_modules: {pattern!r} matches {name!r}, a {type(module).__name__}, not an nn.Linear; "
            "use a more specific pattern"
        )
    if rank >= module.in_features:
        # The sketch (d×r) replaces the gradient (d×k): it saves memory exactly when r < k. r ≥ d is fine (k/v
        # projections with few KV heads have small d), since A still compresses the k inputs.
        raise ValueError(
            f"rank: {rank} must be smaller than in_features={module.in_features} of {name!r}: the d×r sketch "
            f"replaces the d×k gradient, so it saves memory only when r < k; lower the rank below "
            f"{module.in_features} or drop {pattern!r} from target_modules"
        )
    tied = owners.get(id(module.weight), [])
    if len(tied) > 1:
        raise ValueError(
            f"target_modules: the weight of {name!r} is shared by {tied} (tied embeddings?); sketching it "
            "would change all of them through one projection; drop this target"
        )
    return module


def sketched_layers(model: nn.Module) -> dict[str, SketchedLinear]:
    """The handles of a model whose sketches were installed earlier (e.g. after loading it elsewhere)."""
    return {name: module for name, module in model.named_modules() if isinstance(module, SketchedLinear)}


def sketch_carriers(model: nn.Module) -> set[int]:
    """The ids of the model's sketch carriers: the stride-0 zero parameters B whose .grad is a layer's sketch. They
    are not weights of the model: never trained densely, synced to an engine or broadcast between ranks."""
    return {id(layer.sketch_param) for layer in sketched_layers(model).values()}
