"""Predicted-KL step control, in plain PyTorch: measure how far a proposed update would move the policy's
next-token distribution on a few responses, then scale the update to stay inside a budget δ.

For a proposal Δ (per sketched matrix −η·U·A at α = 1, plus optional deltas of densely trained parameters) and
a subset D of the batch's responses:

    q(D) = mean over completion tokens of KL(π_θ(·|ctx) ‖ π_{θ+Δ}(·|ctx)), full vocabulary, fp32, at temperature T
    α    = min(α_max, √(δ / q))          since locally KL(αΔ) ≈ α²·q

The proposed model is evaluated without copying or modifying any sketched weight: a sketched layer's output
under Δ is y − η·(x·Aᵀ)·Uᵀ, added by a forward hook.

With bf16/fp16 weights both forward passes run in fp32 end to end (`float32_compute`): a perturbation of relative
size 1e-6 added into a bf16 residual stream (8 significant bits) would be lost in its rounding, and q would measure
rounding noise instead of the proposal (it read 14× the true value at η = 1e-6 on the tiny model).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from lightning_logra.loss import completion_logits
from lightning_logra.sketch.linear import SketchedLinear
from lightning_logra.sketch.rounding import LOW_PRECISION

# {layer name: (U (d, r), A (r, k), η)}: the proposal a SketchOptimizer hands out, Δ = −η·U·A at α = 1.
Proposal = Mapping[str, tuple[torch.Tensor, torch.Tensor, float]]


@dataclass
class Responses:
    """The subset D: prompt + completion token ids and masks, as a rollout holds them."""

    prompt_ids: torch.Tensor  # (n, P)
    prompt_mask: torch.Tensor  # (n, P)
    completion_ids: torch.Tensor  # (n, C)
    completion_mask: torch.Tensor  # (n, C)


@contextmanager
def low_rank_perturbation(layers: Mapping[str, SketchedLinear], proposal: Proposal, alpha: float = 1.0) -> Iterator[None]:
    """Within the block, each sketched layer computes y − α·η·(x·Aᵀ)·Uᵀ: the model θ + αΔ, weights untouched."""

    def hook_for(u: torch.Tensor, a: torch.Tensor, scale: float):
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
            x = inputs[0]  # (..., k)
            return output - scale * (x @ a.T.to(x.dtype)) @ u.T.to(x.dtype)  # (..., d)

        return hook

    handles = [layers[name].register_forward_hook(hook_for(u, a, alpha * lr)) for name, (u, a, lr) in proposal.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def float32_compute(model: nn.Module) -> Iterator[None]:
    """Within the block, every module computes from fp32 copies of its own bf16/fp16 parameters and buffers, made
    just before it runs and dropped just after: the forward pass is fp32 end to end (from the embedding on, every
    activation is fp32), while at most one module's weights exist in fp32 at a time — no fp32 copy of the model."""

    def cast(module: nn.Module, _inputs) -> None:
        saved = {}
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None and tensor.dtype in LOW_PRECISION:
                    saved[(id(table), name)] = (table, tensor)
                    fp32 = tensor.detach().float()
                    table[name] = nn.Parameter(fp32, requires_grad=False) if table is module._parameters else fp32
        module._float32_saved = saved

    def restore(module: nn.Module, _inputs, _output) -> None:
        for (_, name), (table, tensor) in module._float32_saved.items():
            table[name] = tensor
        del module._float32_saved

    low = [m for m in model.modules()
           if any(t.dtype in LOW_PRECISION for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))]
    handles = [h for m in low for h in (m.register_forward_pre_hook(cast), m.register_forward_hook(restore))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _completion_logprobs(
    policy: nn.Module, responses: Responses, temperature: float, dense_deltas: Mapping[str, torch.Tensor] | None
) -> torch.Tensor:
    """log π(· | ctx) over the full vocabulary (n, C, V), fp32, at the temperature; θ + dense deltas if given."""
    model = policy
    if dense_deltas:
        params = dict(policy.named_parameters())
        # Only the densely trained parameters are replaced (θ + Δ); functional_call leaves the rest in place.
        shifted = {name: params[name] + delta for name, delta in dense_deltas.items()}
        model = lambda **kw: functional_call(policy, shifted, args=(), kwargs=kw)  # noqa: E731
    low_precision = any(p.dtype in LOW_PRECISION for p in policy.parameters())
    with float32_compute(policy) if low_precision else contextlib.nullcontext():
        logits = completion_logits(model, responses.prompt_ids, responses.prompt_mask, responses.completion_ids,
                                   responses.completion_mask)
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def mean_token_kl(logp: torch.Tensor, logq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked positions of KL(p ‖ q) = Σ_v p_v (log p_v − log q_v); logp, logq (n, C, V), mask (n, C)."""
    kl = (logp.exp() * (logp - logq)).sum(-1)  # (n, C)
    mask = mask.to(kl.dtype)
    return (kl * mask).sum() / mask.sum().clamp(min=1)


@torch.no_grad()
def predicted_kl(
    policy: nn.Module,
    layers: Mapping[str, SketchedLinear],
    proposal: Proposal,
    responses: Responses,
    temperature: float = 1.0,
    dense_deltas: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, log-probs of the current policy (n, C, V)): q is the KL of the proposal at α = 1 on `responses`.

    The current log-probs are returned so that the realized KL after the update needs one forward pass, not two.
    `dense_deltas` {parameter name: Δ} covers parameters trained densely, already in the form θ + Δ.
    """
    current = _completion_logprobs(policy, responses, temperature, None)
    with low_rank_perturbation(layers, proposal):
        proposed = _completion_logprobs(policy, responses, temperature, dense_deltas)
    return mean_token_kl(current, proposed, responses.completion_mask), current


@torch.no_grad()
def intended_kl(
    policy: nn.Module,
    layers: Mapping[str, SketchedLinear],
    proposal: Proposal,
    responses: Responses,
    before: torch.Tensor,
    alpha: float,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The exact KL of the step α·Δ, before it is merged: what the realized KL would be without any rounding of
    the merge (with stochastic rounding into bf16 the realized KL adds the rounding noise on top)."""
    with low_rank_perturbation(layers, proposal, alpha):
        stepped = _completion_logprobs(policy, responses, temperature, None)
    return mean_token_kl(before, stepped, responses.completion_mask)


@torch.no_grad()
def realized_kl(policy: nn.Module, responses: Responses, before: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(π_before ‖ π_now) on the same responses, after the update was applied."""
    after = _completion_logprobs(policy, responses, temperature, None)
    return mean_token_kl(before, after, responses.completion_mask)


def step_scale(q: float, budget: float, alpha_max: float) -> float:
    """α = min(α_max, √(δ/q)): the largest step whose predicted KL α²·q stays within the budget δ."""
    if not (math.isfinite(budget) and budget > 0) or not (math.isfinite(alpha_max) and alpha_max > 0):
        raise ValueError(f"the KL budget and alpha_max must be positive finite numbers, got {budget}, {alpha_max}")
    if not math.isfinite(q):
        return 0.0  # a proposal whose effect cannot be measured is not taken
    if q <= 0:
        return alpha_max  # the proposal does not move the distribution (measurably): only α_max bounds it
    return min(alpha_max, math.sqrt(budget / q))
