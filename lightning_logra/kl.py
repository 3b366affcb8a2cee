"""Predicted-KL step control, in plain PyTorch: measure how far a proposed update would move the policy's
next-token distribution on a few responses, then scale the update to stay inside a budget δ.

For a proposal Δ (an `Update` at α = 1: per sketched matrix −η·U·A, plus the full step of densely trained
parameters) and a subset D of the batch's responses:

    q(D) = mean over completion tokens of KL(π_θ(·|ctx) ‖ π_{θ+Δ}(·|ctx)), full vocabulary, fp32, at temperature T
    α    = min(α_max, √(δ / q))          since locally KL(αΔ) ≈ α²·q

The proposed model is evaluated without modifying any weight: a sketched layer's output under Δ is
y − η·(x·Aᵀ)·Uᵀ, added by a forward hook, and densely trained parameters are swapped for their proposed values
(θ + α·Δ) by `functional_call`.

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
from lightning_logra.sketch.rounding import LOW_PRECISION
from lightning_logra.update import Update


@dataclass
class Responses:
    """The subset D: prompt + completion token ids and masks, as a rollout holds them."""

    prompt_ids: torch.Tensor  # (n, P)
    prompt_mask: torch.Tensor  # (n, P)
    completion_ids: torch.Tensor  # (n, C)
    completion_mask: torch.Tensor  # (n, C)


@contextmanager
def low_rank_perturbation(policy: nn.Module, proposal: Update, alpha: float = 1.0) -> Iterator[None]:
    """Within the block, each sketched layer computes y − α·(x·Aᵀ)·Fᵀ (F = η·U): the model θ + αΔ, weights
    untouched. The sketched layers' own (cached) projections are used: the proposal's seeds are theirs."""

    def hook_for(factor: torch.Tensor, projection: torch.Tensor):  # (d, r), (r, k)
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
            x = inputs[0]  # (..., k)
            return output - alpha * (x @ projection.T.to(x.dtype)) @ factor.T.to(x.dtype)  # (..., d)

        return hook

    handles = []
    for name, delta in proposal.low_rank.items():
        layer = policy.get_submodule(name.removesuffix(".weight"))
        handles.append(layer.register_forward_hook(hook_for(delta.factor, layer.projection())))
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

    def restore(module: nn.Module, *_) -> None:
        for (_, name), (table, tensor) in module.__dict__.pop("_float32_saved", {}).items():
            table[name] = tensor

    low = [m for m in model.modules()
           if any(t.dtype in LOW_PRECISION for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))]
    handles = [h for m in low for h in (m.register_forward_pre_hook(cast), m.register_forward_hook(restore))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module in low:  # a forward that raised skipped its restore hooks
            restore(module)


def _completion_logprobs(
    policy: nn.Module, responses: Responses, temperature: float, dense: Mapping[str, torch.Tensor] | None = None,
    alpha: float = 1.0,
) -> torch.Tensor:
    """log π(· | ctx) over the full vocabulary (n, C, V), fp32, at the temperature. `dense` {parameter name: value
    at α = 1} replaces those parameters by θ + α·(value − θ) for this pass (the others stay in place)."""
    model = policy
    if dense:
        params = dict(policy.named_parameters())
        # lerp is exact at α = 1: the optimizer's own step, not θ + (value − θ) rounded twice.
        shifted = {name: torch.lerp(params[name].detach(), value, alpha) for name, value in dense.items()}
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
    policy: nn.Module, proposal: Update, responses: Responses, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, log-probs of the current policy (n, C, V)): q is the KL of the whole proposal (sketched and dense
    parts) at α = 1 on `responses`. The current log-probs are returned so that the realized KL after the update
    needs one forward pass, not two."""
    current = _completion_logprobs(policy, responses, temperature)
    with low_rank_perturbation(policy, proposal):
        proposed = _completion_logprobs(policy, responses, temperature, proposal.dense)
    return mean_token_kl(current, proposed, responses.completion_mask), current


@torch.no_grad()
def intended_kl(
    policy: nn.Module, proposal: Update, responses: Responses, before: torch.Tensor, alpha: float,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The exact KL of the step α·Δ, before it is merged: what the realized KL would be without any rounding of
    the merge (with stochastic rounding into bf16 the realized KL adds the rounding noise on top)."""
    with low_rank_perturbation(policy, proposal, alpha):
        stepped = _completion_logprobs(policy, responses, temperature, proposal.dense, alpha)
    return mean_token_kl(before, stepped, responses.completion_mask)


@torch.no_grad()
def realized_kl(policy: nn.Module, responses: Responses, before: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(π_before ‖ π_now) on the same responses, after the update was applied."""
    after = _completion_logprobs(policy, responses, temperature)
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
