"""One type for a change to the policy's weights: low-rank deltas of sketched matrices and new values of densely
trained parameters.

The same value is, in turn, a training step's *proposal* (at α = 1, before a step-size controller has chosen α: the
factors are η·U, the dense values those of the optimizer's full step), the update the module *applied* (factors
α·η·U in the dtype they were merged in, with the key of their rounding), and — as bytes — what a rollout engine
with its own weights receives (`to_bytes`, because that is what crosses vLLM's `collective_rpc`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch.distributed.tensor import DTensor

from lightning_logra.sketch.update import LowRankDelta


@dataclass
class Update:
    """Keys are the policy's (transformers) parameter names, e.g. "model.layers.0.self_attn.q_proj.weight"."""

    low_rank: dict[str, LowRankDelta] = field(default_factory=dict)  # W ← W − F·A
    dense: dict[str, torch.Tensor] = field(default_factory=dict)  # the parameter's new value

    def __bool__(self) -> bool:
        return bool(self.low_rank or self.dense)

    @property
    def tensor_bytes(self) -> int:
        """Σ d·r·bytes(factor dtype) + the dense tensors' bytes: the numbers alone, without any header."""
        tensors = [d.factor for d in self.low_rank.values()] + list(self.dense.values())
        tensors += [d.matrix for d in self.low_rank.values() if d.matrix is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def to_bytes(self) -> bytes:
        """safetensors bytes; a seeded A is not sent: its seed, distribution and k (and the rounding key) go in the
        header. An explicit A (a LoRA step's) is sent as `projection/<name>`."""
        tensors = {f"lowrank/{name}": d.factor.detach().contiguous().cpu() for name, d in self.low_rank.items()}
        tensors.update({f"projection/{name}": d.matrix.detach().contiguous().cpu()
                        for name, d in self.low_rank.items() if d.matrix is not None})
        tensors.update({f"dense/{name}": t.detach().contiguous().cpu() for name, t in self.dense.items()})
        header = {name: [d.seed, d.distribution, d.in_features, d.rounding_key] for name, d in self.low_rank.items()}
        return save_tensors(tensors, metadata={"low_rank": json.dumps(header)})

    @classmethod
    def from_bytes(cls, data: bytes) -> Update:
        tensors = load_tensors(data)
        header = _metadata(data).get("low_rank", "{}")
        low_rank = {
            name: LowRankDelta(tensors[f"lowrank/{name}"], seed, distribution, in_features, rounding_key,
                               tensors.get(f"projection/{name}"))
            for name, (seed, distribution, in_features, rounding_key) in json.loads(header).items()
        }
        dense = {key.removeprefix("dense/"): t for key, t in tensors.items() if key.startswith("dense/")}
        return cls(low_rank, dense)


def _metadata(data: bytes) -> dict[str, str]:
    # safetensors: an 8-byte little-endian header length, then a JSON header whose "__metadata__" holds strings.
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + length]).get("__metadata__", {})


@torch.no_grad()
def swap_values(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Puts `value` into `param` and returns the values it held, bit for bit (no arithmetic on either).

    A plain parameter swaps tensors (`.data`). FSDP all-gathers a sharded parameter (a DTensor) from its own storage,
    not from what `.data` points to, so there the values are copied in, and the old ones returned as a copy."""
    if isinstance(param, DTensor):
        old = param.detach().clone()
        param.detach().copy_(value)
        return old
    old = param.data
    param.data = value
    return old


@torch.no_grad()
def propose_dense(optimizer: torch.optim.Optimizer, step: Callable[[], Any]) -> dict[torch.Tensor, torch.Tensor]:
    """Run a dense optimizer's `step` as a proposal: returns {parameter: its value after the step} and leaves every
    parameter exactly where it was, so that a step-size controller can scale the step before it is taken.

    The optimizer's state (Adam's moments, its step count) advances as for any step. Until `apply_dense_`, one
    extra copy of the stepped parameters exists (the values before the step, swapped back in)."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    before = [p.detach().clone() for p in params]
    step()
    # θ again, bit for bit (no subtraction that would round); the stepped values θ + Δ kept as the proposal
    return {param: swap_values(param, old) for param, old in zip(params, before)}


@torch.no_grad()
def apply_dense_(proposed: dict[torch.Tensor, torch.Tensor], alpha: float) -> None:
    """Take α of a proposed dense step: θ ← θ + α·(value − θ), which is exactly the optimizer's step at α = 1."""
    for param, value in proposed.items():
        param.lerp_(value, alpha)
