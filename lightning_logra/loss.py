"""The policy-gradient objective: group-normalized advantages, per-token weights, completion log-probs.

Each batch of rollouts is used for exactly one update, so the PPO/GRPO ratio π_θ/π_θ_old is 1 at the point
where the gradient is taken and its clipping never binds: the objective reduces to REINFORCE with a group
baseline, −Σ w_t · A · log π_θ(token_t). The three loss types differ only in the per-token weights w.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import nn

from lightning_logra.batch import positions

LossType = Literal["dapo", "grpo", "dr_grpo"]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """rewards (N,) with N = groups·group_size, samples of one prompt adjacent → advantages (N,).

    A = r − mean(group), divided by std(group) + eps when `scale` (Dr. GRPO argues for scale=False: dividing by the
    std up-weights prompts that are almost always right or wrong).
    """
    grouped = rewards.view(-1, group_size)  # (groups, G)
    centered = grouped - grouped.mean(1, keepdim=True)
    if scale:
        centered = centered / (grouped.std(1, keepdim=True) + eps)
    return centered.reshape(-1)


def token_weights(
    completion_mask: torch.Tensor,
    loss_type: LossType,
    max_new_tokens: int,
    total_tokens: float | None = None,
    total_sequences: int | None = None,
) -> torch.Tensor:
    """Per-token weights (N, C) of the whole batch, so that any split into micro-batches sums to the same loss.

    dapo:    token mean over the batch        1 / (tokens in the batch)
    grpo:    mean over sequences of the per-sequence token mean   1 / (sequences · length_i)
    dr_grpo: a constant normalizer            1 / (sequences · max_new_tokens)

    When the batch is sharded over processes, `total_tokens` / `total_sequences` are the counts of the global
    batch, so that the processes' summed gradients equal the gradient of the global loss.
    """
    mask = completion_mask.float()
    tokens = mask.sum() if total_tokens is None else total_tokens
    sequences = mask.shape[0] if total_sequences is None else total_sequences
    if loss_type == "dapo":
        return mask / max(float(tokens), 1.0)
    if loss_type == "grpo":
        return mask / (mask.sum(1, keepdim=True).clamp(min=1) * sequences)
    if loss_type == "dr_grpo":
        return mask / (sequences * max_new_tokens)
    raise ValueError(f"loss_type must be one of {list(LOSS_TYPES)}, got {loss_type!r}")


def completion_logits(
    policy: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> torch.Tensor:
    """Logits (n, C, V) that predict each completion token, from one forward pass over prompt + completion."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (n, P + C)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    width = completion_ids.shape[1]
    # Only the last C + 1 positions are needed (the position before each completion token predicts it), so the
    # LM head never runs over the prompt.
    logits = policy(input_ids=ids, attention_mask=mask, position_ids=positions(mask), logits_to_keep=width + 1).logits
    return logits[:, :-1]  # (n, C, V)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What log-probs are computed in: fp32 for bf16/fp16/fp32 logits, fp64 kept for float64 references."""
    return torch.promote_types(dtype, torch.float32)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log π(token) (n, C) from logits (n, C, V) at the sampling temperature, in fp32 (fp64 for fp64 logits).

    One sequence at a time: the fp32 copy of the logits then takes C·V·4 bytes, not n·C·V·4 (with a 152k vocabulary
    and 2k-token completions that is 1.2 GB instead of n times that).
    """
    rows = []
    for row_logits, row_tokens in zip(logits, tokens):
        row = row_logits.to(compute_dtype(row_logits.dtype)) / temperature  # (C, V) fp32/fp64
        rows.append(row.gather(-1, row_tokens[:, None]).squeeze(-1) - row.logsumexp(-1))
    return torch.stack(rows)  # (n, C)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """H(π(· | ctx)) (n, C) in nats over the full vocabulary at the sampling temperature, one sequence at a time (the
    fp32 transient is C·V, as in `token_logprobs`)."""
    rows = []
    for row_logits in logits:
        logp = torch.log_softmax(row_logits.to(compute_dtype(row_logits.dtype)) / temperature, dim=-1)  # (C, V)
        rows.append(-(logp.exp() * logp).sum(-1))
    return torch.stack(rows)  # (n, C)


def importance_weights(
    logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, cap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance sampling between the sampler (the rollout engine) and the trainer's policy.

    With Δ = log π_θ − log π_sampler per token (both at the sampling temperature), each token's loss is weighted by
    w = min(exp Δ, cap): the completions were drawn from the sampler, and w re-weights them towards π_θ; the cap
    bounds the variance that a few tokens with tiny sampler probability would otherwise add. `cap=None` gives w = 1.

    Args: logprobs, sampler_logprobs, mask: (m, w) — the trainer's (detached), the sampler's, 1 on real tokens.
    Returns: w (m, w), 0 on padding; and the sums over real tokens of (|Δ|, exp Δ − 1 − Δ — the "k3" estimate of
    KL(π_sampler ‖ π_θ) —, tokens clipped by the cap, tokens), for logging.
    """
    mask = mask.to(logprobs.dtype)
    delta = (logprobs - sampler_logprobs) * mask  # (m, w)
    ratio = delta.exp()
    weight = ratio if cap is None else ratio.clamp(max=cap)
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
