"""The policy-gradient losses, registered by name (`LOSSES`, `@loss("dapo")`; `model.loss_type` chooses one), and the
importance weights that correct for a sampler whose log-probs differ from the trainer's.

Each batch of rollouts is used for exactly one update, so the PPO/GRPO ratio π_θ/π_θ_old is 1 at the point
where the gradient is taken and its clipping never binds: the objective reduces to REINFORCE with a group
baseline, −Σ w_t · A · log π_θ(token_t). The losses differ only in the per-token weights w, which a loss computes for
the whole batch (so that any split into micro-batches sums to the same loss):

    dapo:    token mean over the batch                            1 / (tokens in the batch)
    grpo:    mean over sequences of the per-sequence token mean   1 / (sequences · length_i)
    dr_grpo: a constant normalizer                                1 / (sequences · max_new_tokens)

When the batch is sharded over processes, `total_tokens` / `total_sequences` are the counts of the global batch, so
that the processes' summed gradients equal the gradient of the global loss.

With a KL penalty to the starting policy (`model.beta` = β > 0, TRL's `beta`), each token's term gains
β · w_t · kl_t (`reference_kl`), weighted as the policy-gradient term but by neither the advantage nor the importance
weight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

# (completion_mask (N, C), max_new_tokens, total_tokens, total_sequences) → per-token weights (N, C)
TokenWeights = Callable[[torch.Tensor, int, float, int], torch.Tensor]
LOSSES: dict[str, TokenWeights] = {}


def loss(name: str) -> Callable[[TokenWeights], TokenWeights]:
    """Registers a loss's per-token weights under `name` (`model.loss_type: <name>`)."""

    def register(fn: TokenWeights) -> TokenWeights:
        LOSSES[name] = fn
        return fn

    return register


@loss("dapo")
def _dapo(mask: torch.Tensor, max_new_tokens: int, tokens: float, sequences: int) -> torch.Tensor:
    return mask / max(float(tokens), 1.0)


@loss("grpo")
def _grpo(mask: torch.Tensor, max_new_tokens: int, tokens: float, sequences: int) -> torch.Tensor:
    return mask / (mask.sum(1, keepdim=True).clamp(min=1) * sequences)


@loss("dr_grpo")
def _dr_grpo(mask: torch.Tensor, max_new_tokens: int, tokens: float, sequences: int) -> torch.Tensor:
    return mask / (sequences * max_new_tokens)


LossType = Literal[tuple(LOSSES)]  # the registered names, for the config's check of model.loss_type


def token_weights(
    completion_mask: torch.Tensor,
    loss_type: str,
    max_new_tokens: int,
    total_tokens: float | None = None,
    total_sequences: int | None = None,
) -> torch.Tensor:
    """Per-token weights (N, C) of the whole batch under the loss `loss_type` (one of `LOSSES`)."""
    if loss_type not in LOSSES:
        raise ValueError(f"model.loss_type must be one of {sorted(LOSSES)}, got {loss_type!r}")
    mask = completion_mask.float()
    tokens = mask.sum() if total_tokens is None else total_tokens
    sequences = mask.shape[0] if total_sequences is None else total_sequences
    return LOSSES[loss_type](mask, max_new_tokens, tokens, sequences)


def importance_weights(
    logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, cap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance sampling between the sampler (the rollout engine) and the trainer's policy.

    With Δ = log π_θ − log π_sampler per token (both at the sampling temperature), each token's loss is weighted by
    w = min(exp Δ, cap): the completions were drawn from the sampler, and w re-weights them towards π_θ; the cap
    bounds the variance that a few tokens with tiny sampler probability would otherwise add. `cap=None` gives w = 1
    (no correction: `model.is_cap: null`), the mismatch still measured.

    Args: logprobs, sampler_logprobs, mask: (m, w) — the trainer's (detached), the sampler's, 1 on real tokens.
    Returns: w (m, w), 0 on padding; and the sums over real tokens of (|Δ|, exp Δ − 1 − Δ — the "k3" estimate of
    KL(π_sampler ‖ π_θ) —, tokens clipped by the cap, tokens), for logging.
    """
    mask = mask.to(logprobs.dtype)
    delta = (logprobs - sampler_logprobs) * mask  # (m, w)
    ratio = delta.exp()
    weight = torch.ones_like(ratio) if cap is None else ratio.clamp(max=cap)  # None: the correction off
    clipped = (ratio > cap).to(mask.dtype) if cap is not None else torch.zeros_like(mask)
    stats = torch.stack([
        delta.abs().sum(), ((ratio - 1.0 - delta) * mask).sum(), (clipped * mask).sum(), mask.sum()
    ])
    return weight * mask, stats


def mismatch_metrics(stats: torch.Tensor) -> dict[str, torch.Tensor]:
    """`importance_weights`' sums (added up over micro-batches and ranks) as per-token means: how far the sampler's
    log-probs are from the trainer's on the tokens trained on."""
    abs_diff, k3, clipped, tokens = stats.unbind()
    tokens = tokens.clamp(min=1)
    return {"rollout/logprob_abs_diff": abs_diff / tokens, "rollout/sampler_kl": k3 / tokens,
            "rollout/is_clipped_frac": clipped / tokens}


def reference_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The per-token "k3" estimate of KL(π_θ ‖ π_ref) on sampled tokens, the KL penalty's term (TRL's GRPO `beta`):

        kl_t = exp(r_t − l_t) − (r_t − l_t) − 1,   l_t = log π_θ(token_t),  r_t = log π_ref(token_t)

    both at the sampling temperature. Never negative (e^x ≥ 1 + x), 0 where the two agree, and unbiased for
    KL(π_θ ‖ π_ref) on tokens drawn from π_θ (E[exp(r − l)] = 1, so E[kl_t] = E[l − r]). Its gradient flows through
    l only: ∂kl_t/∂l_t = 1 − exp(r_t − l_t); in expectation over tokens from π_θ that is, per context, the gradient of
    KL(π_ref ‖ π_θ), which is what the penalty pulls on (as in TRL). exp(x) − x − 1 is computed as expm1(x) − x,
    exact near 0 where the policy is close to the reference (exp(x) − 1 would lose the x²/2 that is the answer).

    Args: logprobs (m, w): the policy's, differentiable; ref_logprobs (m, w): the reference's, no gradient;
        mask (m, w): 1 on real tokens.
    Returns: kl (m, w), 0 on padding (where r − l is set to 0 first, so that exp cannot overflow).
    """
    mask = mask.to(logprobs.dtype)
    delta = (ref_logprobs - logprobs) * mask  # (m, w): r − l, 0 on padding
    return (torch.expm1(delta) - delta) * mask
