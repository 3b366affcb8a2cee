"""The optimizers a user would pick instead of LoGRA, as rows of the benchmarks: each one's settings from its own
paper or README, whether its package imports here, its layer-wise mode, and its state bytes for a model's matrices
counted from the tensors the optimizer itself allocates (bench/memory.py runs them; `--at-shape` computes the 7B and
32B figures without running a model).

Every row trains the target matrices (q, k, v, o, gate, up, down) and freezes the rest, as LoGRA, LoRA and
`dense_adamw_targets` do, through `trainer.strategy.init_args.dense.optimizer`'s own builder
(`lightning_logra.train.optimizers`): GaLore, Fira and APOLLO project the matrices wider than their rank, the narrower
ones (k/v at rank 128 on 0.5B) are stepped by the same class as a plain group.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch
from torch import nn

from lightning_logra.sketch.memory import state_nbytes
from lightning_logra.train.optimizers import OptimizerSpec

RANK = None  # stands for the benchmark's --rank in the settings below

# name: (class path, init_args). Each at its paper's / README's recommendation: GaLore's update_proj_gap 200 and
# scale 0.25; Fira's alpha 1; APOLLO channel-wise at the GaLore rank with scale 1, APOLLO-Mini tensor-wise at rank 1
# with scale 128; Flora's compressed momentum (beta1 0.9) at the rank, resampled every kappa = 1000 steps, factored
# second moments; Adafactor without momentum and without its relative step (a fixed lr, as the RL configs set);
# bitsandbytes' block-wise 8-bit AdamW.
PEERS: dict[str, tuple[str, dict[str, Any]]] = {
    "galore": ("galore_torch.GaLoreAdamW", {"rank": RANK, "update_proj_gap": 200, "scale": 0.25,
                                           "no_deprecation_warning": True}),
    "fira": ("fira.FiraAdamW", {"rank": RANK, "update_proj_gap": 200, "alpha": 1.0, "no_deprecation_warning": True}),
    "apollo": ("apollo_torch.APOLLOAdamW", {"rank": RANK, "proj": "random", "scale_type": "channel", "scale": 1.0,
                                            "update_proj_gap": 200}),
    "apollo_mini": ("apollo_torch.APOLLOAdamW", {"rank": 1, "proj": "random", "scale_type": "tensor", "scale": 128,
                                                 "update_proj_gap": 200}),
    "flora": ("flora_opt.Flora", {"rank": RANK, "beta1": 0.9, "kappa": 1000, "relative_step": False,
                                  "scale_parameter": False}),
    "adafactor": ("transformers.optimization.Adafactor", {"scale_parameter": False, "relative_step": False,
                                                          "warmup_init": False}),
    "adamw_8bit": ("bitsandbytes.optim.AdamW8bit", {}),
}
# GaLore's layer-wise mode (its paper's "per-layer weight updates"): one optimizer per matrix, stepped by a hook as
# soon as the backward pass has accumulated that matrix's gradient, which is then freed. It is not a
# `trainer.strategy.init_args.dense.optimizer`: the trainer accumulates a step's gradient over micro-batches, clips its
# total norm, sums it over ranks and lets a step-size controller scale the step, and a step taken inside the backward
# allows none of these. Here it steps once per micro-batch (the same forward and backward work; more optimizer steps).
LAYERWISE = {"galore_layerwise": "galore"}


def spec(name: str, rank: int) -> OptimizerSpec:
    """The peer's `trainer.strategy.init_args.dense.optimizer`, at `rank` where its settings say RANK."""
    class_path, init_args = PEERS[LAYERWISE.get(name, name)]
    return OptimizerSpec(class_path, {k: rank if v is RANK and k == "rank" else v for k, v in init_args.items()})


def missing(name: str) -> str | None:
    """Why the peer cannot run here (its package does not import), or None (also for a name that is not a peer)."""
    if LAYERWISE.get(name, name) not in PEERS:
        return None
    class_path = PEERS[LAYERWISE.get(name, name)][0]
    module = class_path.split(".")[0]
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed (pip install -e .[peers])"
    try:
        spec(name, 8).optimizer_class()
    except (ImportError, ValueError) as err:
        return str(err)
    return None


class LayerWise:
    """Per-matrix optimizers stepped from the backward pass (`register_post_accumulate_grad_hook`), each gradient
    freed once its step is taken; `step` and `zero_grad` have nothing left to do."""

    def __init__(self, peer: OptimizerSpec, model: nn.Module, params: list[nn.Parameter], lr: float) -> None:
        self.optimizers = {param: peer.build(model, [param], lr, 0.0) for param in params}
        for param in params:
            param.register_post_accumulate_grad_hook(self._step)

    def _step(self, param: torch.Tensor) -> None:
        optimizer = self.optimizers[param]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    @property
    def state(self) -> dict:
        return {p: s for optimizer in self.optimizers.values() for p, s in optimizer.state.items()}


def build(name: str, model: nn.Module, params: list[nn.Parameter], rank: int, lr: float):
    """The peer's optimizer of `params` (LayerWise for a layer-wise row)."""
    if name in LAYERWISE:
        return LayerWise(spec(name, rank), model, params, lr)
    return spec(name, rank).build(model, params, lr, 0.0)


def optimizer_state_bytes(optimizers: list) -> int:
    """What the optimizers hold, counted from their state's tensors (projectors and quantized states included)."""
    return sum(state_nbytes(list(optimizer.state.values())) for optimizer in optimizers)


@functools.cache
def matrix_state_bytes(name: str, shape: tuple[int, int], rank: int, dtype: torch.dtype) -> int:
    """The state the peer allocates for one trained matrix of `shape` in `dtype`: one real step on a random gradient
    (GaLore's SVD included), counted from the tensors. What 7B and 32B shapes need, without their models. `name`
    "adamw": torch's AdamW, the baseline."""
    if name in LAYERWISE:  # the same optimizer per matrix, stepped from the backward: the same state
        return matrix_state_bytes(LAYERWISE[name], shape, rank, dtype)
    weight = nn.Linear(shape[1], shape[0], bias=False, dtype=dtype)
    holder = nn.Sequential(weight)
    gradient = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    peer = OptimizerSpec("torch.optim.AdamW") if name == "adamw" else spec(name, rank)
    optimizer = peer.build(holder, [weight.weight], 1e-6, 0.0)
    weight.weight.grad = gradient
    optimizer.step()
    return optimizer_state_bytes([optimizer])
