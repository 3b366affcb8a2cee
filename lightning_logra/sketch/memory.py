"""Memory accounting by category for a model with sketches installed.

The numbers are the steady-state footprint of training, not a snapshot: a sketch counts d×r fp32 and a
trainable dense parameter counts its gradient even between steps when `.grad` happens to be None, because both
exist during every backward pass. Optimizer state counts what the optimizers hold (a sketch optimizer's
d×r tensors by its kind, since it allocates them lazily on the first step).

Under FSDP the figures are this process's: its shards of the weights, of their gradients and of the dense optimizer
state, and sketch-optimizer state for its rows only; each sketch is whole (every rank accumulates all d×r of it
before the reduction).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_logra.sketch.linear import SketchedLinear
from lightning_logra.sketch.optim import SketchOptimizer

_FP32 = 4


@dataclass
class MemoryBreakdown:
    weights: int = 0  # every parameter's storage (sketched or not)
    sketches: int = 0  # d×r fp32 per sketched weight
    sketch_optimizer_state: int = 0  # momentum / Adam moments, d×r fp32 each
    projections: int = 0  # cached A buffers, r×k each, fp32 or the weights' bf16/fp16 (`storage_dtype`)
    dense_gradients: int = 0  # .grad of densely trained parameters
    dense_optimizer_state: int = 0  # state of ordinary optimizers (e.g. AdamW on non-sketched parameters)
    # What dense fp32 gradients of the sketched weights would take instead of `sketches` (for comparison only).
    dense_equivalent_gradients: int = 0

    @property
    def total(self) -> int:
        """Bytes actually needed (the comparison figure excluded)."""
        return sum(v for k, v in asdict(self).items() if k != "dense_equivalent_gradients")

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def _nbytes(t: torch.Tensor) -> int:
    """The bytes this process holds for `t`: a sharded (DTensor) one's local shard."""
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def state_nbytes(value: object, seen: set[int] | None = None) -> int:
    """The bytes of every tensor in an optimizer's state entry, each storage once: tensors inside dicts, lists and
    tuples, and the attributes of objects some optimizers keep there (GaLore's, Fira's and APOLLO's projectors hold
    their projection matrix so)."""
    seen = set() if seen is None else seen
    if torch.is_tensor(value):
        local = value.to_local() if isinstance(value, DTensor) else value
        key = local.untyped_storage().data_ptr() if local.device.type != "meta" else id(local)
        if key in seen:
            return 0
        seen.add(key)
        return _nbytes(value)
    if isinstance(value, dict):
        return sum(state_nbytes(v, seen) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(state_nbytes(v, seen) for v in value)
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return state_nbytes(vars(value), seen)
    return 0


def memory_breakdown(model: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> MemoryBreakdown:
    out = MemoryBreakdown()
    layers = [m for m in model.modules() if isinstance(m, SketchedLinear)]
    sketch_params = {id(layer.sketch_param) for layer in layers}
    for param in model.parameters():  # de-duplicated, so tied weights count once
        if id(param) in sketch_params:
            continue  # B is a stride-0 zero: 4 bytes, not d×r
        out.weights += _nbytes(param)
        if param.requires_grad:
            out.dense_gradients += _nbytes(param)
    projections = {}  # matrices that share A (share_projection) hold one tensor between them: count it once
    for layer in layers:
        d, k, r = layer.out_features, layer.in_features, layer.rank
        out.sketches += d * r * _FP32
        out.dense_equivalent_gradients += d * k * _FP32
        if layer.cached_projection is not None:
            projections[id(layer.cached_projection)] = _nbytes(layer.cached_projection)
    out.projections = sum(projections.values())
    for optimizer in optimizers:
        if isinstance(optimizer, SketchOptimizer):
            per_layer = optimizer.state_tensors_per_layer()
            out.sketch_optimizer_state += sum(per_layer * len(range(layer.out_features)[layer.rows]) * layer.rank
                                              * _FP32 for layer in optimizer.layers)
        else:
            out.dense_optimizer_state += state_nbytes(list(optimizer.state.values()))
    return out


def saved_activation_bytes(forward: Callable[[], object], params: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the tensors that autograd saves for the backward pass while `forward()` runs, `params` (weights,
    which are referenced, not copied) left out. Each storage counts once however many times it is saved: a tensor
    saved by several layers (a shared x·Aᵀ) costs its bytes once, which is what it holds in memory. Exact and
    deterministic (no allocator is read), so a test can compare two settings byte for byte."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    storages: dict[int, int] = {}
    kept = []  # every saved tensor stays alive until counted, so no address is reused by another storage meanwhile

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
            kept.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = forward()
    del output  # the graph (and what it saved) goes with it, and with `kept`
    kept.clear()
    return sum(storages.values())
