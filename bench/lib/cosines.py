"""How much of the gradient a sketch sees: cos(G, S·A) between each target matrix's dense gradient G and its rank-r
reconstruction from the sketch S = G·Aᵀ (bench.rank_sweep's part 1, bench.frontier's sketch cosines). Both gradients
are of the trainer's policy-gradient objective on one batch (`bench.lib.policy_step`), in one pass over its logits."""

from __future__ import annotations

import copy

import torch

from bench.lib.policy_step import Batch, objective
from lightning_logra.sketch import install_sketches
from lightning_logra.sketch.config import DEFAULT_TARGETS
from lightning_logra.train.settings import TrainingSettings


def gradient_pass(model: torch.nn.Module, batch: Batch) -> None:
    """The batch's policy-gradient loss backward into `model`'s .grad (its sketches' under sketched layers): one
    micro-batch, the whole (n, C, V) logits at once."""
    training = TrainingSettings(micro_batch_size=len(batch), logprob_chunk_tokens=None)
    objective(model, training, batch.rollout.completion_ids.shape[1]).accumulate(batch.rollout, batch.advantages)


def dense_gradients(model: torch.nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
    """{module name: G (d, k) float64} of every target matrix."""
    model.zero_grad()
    gradient_pass(model, batch)
    return {
        name: module.weight.grad.double().clone()
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in DEFAULT_TARGETS
    }


def reconstruction_cosines(model: torch.nn.Module, batch: Batch, gradients: dict[str, torch.Tensor], rank: int,
                           distribution: str, seed: int, share_projection: bool = False) -> dict[str, float]:
    """{module name: cos(G, S·A)} for every target matrix that a rank-`rank` sketch fits."""
    fits = sorted({name.rsplit(".", 1)[-1] for name, g in gradients.items() if rank < g.shape[1]})
    if not fits:
        return {}
    sketched = copy.deepcopy(model)
    handles = install_sketches(sketched, fits, rank, seed, distribution, share_projection=share_projection)
    gradient_pass(sketched, batch)
    cosines = {}
    for name, handle in handles.items():
        g = gradients[name]
        reconstruction = handle.sketch.double() @ handle.projection().double()  # S·A (d, k)
        cosines[name] = float((g * reconstruction).sum() / (g.norm() * reconstruction.norm()))
    return cosines
