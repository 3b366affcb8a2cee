"""The policy-gradient losses and the sampler corrections, each registered by name (`LOSSES`, `@loss("dapo")`:
`model.loss.type`; `CORRECTIONS`, `@correction("token_truncate")`: `model.rollouts.is_mode`).

A loss is two things: its per-token weights w, which say how the batch's tokens are averaged (computed for the whole
batch, so that any split into micro-batches sums to the same loss), and its surrogate, the per-token objective o_t whose
gradient is the policy gradient; the loss is −Σ w_t·o_t.

    dapo:    token mean over the batch                            w = 1 / (tokens in the batch)
    grpo:    mean over sequences of the per-sequence token mean   w = 1 / (sequences · length_i)
    dr_grpo: a constant normalizer                                w = 1 / (sequences · max_new_tokens)

These three use REINFORCE's surrogate, o_t = ρ_t·A·log π_θ(token_t), with ρ the sampler correction's weight (below):
each batch is used for exactly one update, so the PPO/GRPO ratio π_θ/π_θ_old is 1 where the gradient is taken and
its clip never binds. Two losses take their ratio against the sampler itself, r = π_θ/π_sampler (both at the sampling
temperature), and clip it; that ratio is the correction, so the sampler correction does not apply to them. With one
update per batch and a sampler equal to the trainer r is 1 and they reduce to grpo and dapo; they differ once the
samples are stale (`model.rollouts.max_staleness` > 0) or the sampler's kernels differ:

    gspo:  (Zheng et al., 2025) the sequence's length-normalized ratio s_i = exp(mean_t log r_t), clipped as PPO
           clips, o_t = min(s_i·A_i, clip(s_i, 1 − ε, 1 + ε_high)·A_i); grpo's weights (a mean over sequences)
    cispo: (MiniMax-M1, 2025) each token's ratio, clipped from above and held constant,
           o_t = sg(min(r_t, ε_high))·A·log π_θ(token_t); dapo's weights (TRL's convention: ε_high is the cap itself)

When the batch is sharded over processes, `total_tokens` / `total_sequences` are the counts of the global batch, so
that the processes' summed gradients equal the gradient of the global loss.

With a KL penalty to the starting policy (`model.loss.beta` = β > 0, TRL's `beta`), each token's term gains
β · w_t · kl_t (`reference_kl`), weighted as the policy-gradient term but by neither the advantage nor the importance
weight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

# (completion_mask (N, C), max_new_tokens, total_tokens, total_sequences) → per-token weights (N, C)
TokenWeights = Callable[[torch.Tensor, int, float, int], torch.Tensor]
# (logprobs l (m, w) differentiable, sampler_logprobs (m, w), mask (m, w), advantages (m,), Clip)
#   → (the per-token objective o (m, w), 0 on padding; where the clip binds (m, w), 0/1)
Surrogate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "Clip"],
                     tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Clip:
    """The clip range of the losses with a ratio of their own (TRL's `epsilon`, `epsilon_high`). gspo clips its
    sequence ratio to [1 − epsilon, 1 + high]; cispo caps its token ratio at `high` itself. None: the loss's own
    default (gspo: epsilon; cispo: 5.0)."""

    epsilon: float = 0.2
    epsilon_high: float | None = None


@dataclass(frozen=True)
class Loss:
    weights: TokenWeights
    surrogate: Surrogate
    own_ratio: bool  # the surrogate's ratio is π_θ/π_sampler: the sampler correction does not apply


def reinforce(logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
              clip: Clip) -> tuple[torch.Tensor, torch.Tensor]:
    """o_t = A·log π_θ(token_t): the policy gradient of a batch used once (dapo, grpo, dr_grpo)."""
    mask = mask.to(logprobs.dtype)
    return advantages[:, None] * logprobs * mask, torch.zeros_like(mask)


def gspo(logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
         clip: Clip) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO's sequence-level clipped objective, on every token of its sequence (grpo's weights then average it over
    the sequences): s = exp(Σ_t (l_t − l_sampler,t) / length), o = min(s·A, clip(s, 1 − ε, 1 + ε_high)·A). Its gradient
    is s·A·mean_t ∇l_t where the clip does not bind, 0 where it does."""
    mask = mask.to(logprobs.dtype)
    high = clip.epsilon if clip.epsilon_high is None else clip.epsilon_high
    log_ratio = ((logprobs - sampler_logprobs) * mask).sum(1) / mask.sum(1).clamp(min=1)  # (m,)
    ratio = log_ratio.exp()
    unclipped, clipped = ratio * advantages, ratio.clamp(1 - clip.epsilon, 1 + high) * advantages
    objective = torch.minimum(unclipped, clipped)  # (m,)
    binds = (clipped < unclipped).to(mask.dtype)  # the clipped branch is taken and differs: no gradient
    return objective[:, None] * mask, binds[:, None] * mask


def cispo(logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
          clip: Clip) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO: REINFORCE with each token weighted by its ratio to the sampler, capped and not differentiated —
    o_t = sg(min(r_t, cap))·A·l_t, cap = ε_high (5.0 unless set). The cap bounds a token's weight, but unlike PPO's
    clip it never drops a token's gradient."""
    mask = mask.to(logprobs.dtype)
    cap = 5.0 if clip.epsilon_high is None else clip.epsilon_high
    ratio = ((logprobs.detach() - sampler_logprobs) * mask).exp()  # (m, w)
    objective = ratio.clamp(max=cap) * advantages[:, None] * logprobs * mask
    binds = ((ratio > cap) & (advantages[:, None] != 0)).to(mask.dtype) * mask
    return objective, binds


LOSSES: dict[str, Loss] = {}


def loss(name: str, surrogate: Surrogate = reinforce, own_ratio: bool = False
         ) -> Callable[[TokenWeights], TokenWeights]:
    """Registers a loss under `name` (`model.loss.type: <name>`): the decorated per-token weights and a surrogate
    (REINFORCE's unless given)."""

    def register(fn: TokenWeights) -> TokenWeights:
        LOSSES[name] = Loss(fn, surrogate, own_ratio)
        return fn

    return register


@loss("dapo")
@loss("cispo", surrogate=cispo, own_ratio=True)
def _dapo(mask: torch.Tensor, max_new_tokens: int, tokens: float, sequences: int) -> torch.Tensor:
    return mask / max(float(tokens), 1.0)


@loss("grpo")
@loss("gspo", surrogate=gspo, own_ratio=True)
def _grpo(mask: torch.Tensor, max_new_tokens: int, tokens: float, sequences: int) -> torch.Tensor:
    return mask / (mask.sum(1, keepdim=True).clamp(min=1) * sequences)


@loss("dr_grpo")
def _dr_grpo(mask: torch.Tensor, max_new_tokens: int, tokens: float, sequences: int) -> torch.Tensor:
    return mask / (sequences * max_new_tokens)


LossType = Literal[tuple(LOSSES)]  # the registered names, for the config's check of model.loss.type


def get_loss(loss_type: str) -> Loss:
    if loss_type not in LOSSES:
        raise ValueError(f"model.loss.type must be one of {sorted(LOSSES)}, got {loss_type!r}")
    return LOSSES[loss_type]


def token_weights(
    completion_mask: torch.Tensor,
    loss_type: str,
    max_new_tokens: int,
    total_tokens: float | None = None,
    total_sequences: int | None = None,
) -> torch.Tensor:
    """Per-token weights (N, C) of the whole batch under the loss `loss_type` (one of `LOSSES`)."""
    weights = get_loss(loss_type).weights
    mask = completion_mask.float()
    tokens = mask.sum() if total_tokens is None else total_tokens
    sequences = mask.shape[0] if total_sequences is None else total_sequences
    return weights(mask, max_new_tokens, tokens, sequences)


# ---- sampler corrections ------------------------------------------------------------------------------------------

# (log-ratio Δ = log π_θ − log π_sampler (m, w), mask (m, w), cap) → (weight ρ (m, w), past the cap (m, w) 0/1)
Correction = Callable[[torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
CORRECTIONS: dict[str, Correction] = {}


def correction(name: str) -> Callable[[Correction], Correction]:
    """Registers a sampler correction under `name` (`model.rollouts.is_mode: <name>`)."""

    def register(fn: Correction) -> Correction:
        CORRECTIONS[name] = fn
        return fn

    return register


def _sequence_ratio(delta: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TRL's sequence-level ratio, the product of the token ratios exp(Σ_t Δ_t), on every token of the sequence."""
    return (delta * mask).sum(1, keepdim=True).exp().expand_as(delta)


@correction("token_truncate")
def _token_truncate(delta: torch.Tensor, mask: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    ratio = delta.exp()
    return ratio.clamp(max=cap), (ratio > cap).to(mask.dtype)


@correction("token_mask")
def _token_mask(delta: torch.Tensor, mask: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    ratio = delta.exp()
    past = ratio > cap
    return ratio.masked_fill(past, 0.0), past.to(mask.dtype)


@correction("sequence_truncate")
def _sequence_truncate(delta: torch.Tensor, mask: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    ratio = _sequence_ratio(delta, mask)
    return ratio.clamp(max=cap), (ratio > cap).to(mask.dtype)


@correction("sequence_mask")
def _sequence_mask(delta: torch.Tensor, mask: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    ratio = _sequence_ratio(delta, mask)
    past = ratio > cap
    return ratio.masked_fill(past, 0.0), past.to(mask.dtype)


CorrectionMode = Literal[tuple(CORRECTIONS)]  # for the config's check of model.rollouts.is_mode


def check_correction(mode: str) -> None:
    if mode not in CORRECTIONS:
        raise ValueError(f"model.rollouts.is_mode must be one of {sorted(CORRECTIONS)}, got {mode!r}")


@dataclass(frozen=True)
class Mismatch:
    """How far the sampler's log-probs are from the trainer's over a set of tokens, and the weights that corrected
    for it: sums that add over micro-batches and ranks, extremes that take the extreme. Δ = log π_θ − log π_sampler.
    """

    abs_diff: torch.Tensor  # () Σ |Δ|
    k3: torch.Tensor  # () Σ exp Δ − 1 − Δ: the "k3" estimate of KL(π_sampler ‖ π_θ)
    past_cap: torch.Tensor  # () tokens past the cap (truncated or masked)
    tokens: torch.Tensor  # () real tokens
    weight_sum: torch.Tensor  # () Σ ρ
    low: torch.Tensor  # () the least ρ (inf: no token yet)
    high: torch.Tensor  # () the largest ρ (−inf: no token yet)

    @classmethod
    def empty(cls, device: torch.device | str, dtype: torch.dtype = torch.float32) -> Mismatch:
        """The identity of `add`: zero sums, extremes that any token replaces."""
        zero = torch.zeros((), dtype=dtype, device=device)
        return cls(zero, zero, zero, zero, zero, zero + torch.inf, zero - torch.inf)

    def add(self, other: Mismatch) -> Mismatch:
        """The statistics of both sets of tokens."""
        return Mismatch(self.abs_diff + other.abs_diff, self.k3 + other.k3, self.past_cap + other.past_cap,
                        self.tokens + other.tokens, self.weight_sum + other.weight_sum,
                        torch.minimum(self.low, other.low), torch.maximum(self.high, other.high))

    def reduce(self, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor],
               max_over_ranks: Callable[[torch.Tensor], torch.Tensor]) -> Mismatch:
        """Over every rank's tokens: one sum of the five sums, and the extremes by the largest of each rank's (the
        least as the largest negation). NaN travels as inf."""
        sums = sum_over_ranks(torch.stack([self.abs_diff, self.k3, self.past_cap, self.tokens, self.weight_sum]))
        return Mismatch(*sums.unbind(), -max_over_ranks(-self.low), max_over_ranks(self.high))

    def metrics(self) -> dict[str, torch.Tensor]:
        """Per-token figures (TRL's `sampling/importance_sampling_ratio/*`; NaN for a set without tokens)."""
        count = self.tokens.clamp(min=1)
        nothing = self.tokens == 0
        return {"rollout/logprob_abs_diff": self.abs_diff / count, "rollout/sampler_kl": self.k3 / count,
                "rollout/is_clipped_frac": self.past_cap / count,
                "sampling/importance_sampling_ratio/mean": self.weight_sum / count,
                "sampling/importance_sampling_ratio/min": self.low.masked_fill(nothing, torch.nan),
                "sampling/importance_sampling_ratio/max": self.high.masked_fill(nothing, torch.nan)}


def importance_weights(
    logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, cap: float | None,
    mode: str = "token_truncate",
) -> tuple[torch.Tensor, Mismatch]:
    """The weight ρ of each token that corrects for the sampler (the rollout engine) and the trainer's policy
    differing: the completions were drawn from the sampler, and ρ re-weights them towards π_θ.

    With Δ = log π_θ − log π_sampler per token (both at the sampling temperature), `mode` (TRL's
    `vllm_importance_sampling_mode`) says whose ratio and what happens past the cap:

        token_truncate:    ρ_t = min(exp Δ_t, cap)              token_mask:    ρ_t = exp Δ_t, or 0 past the cap
        sequence_truncate: ρ_t = min(exp Σ_s Δ_s, cap)          sequence_mask: ρ_t = exp Σ_s Δ_s, or 0 past the cap

    (a sequence's ratio on each of its tokens, the whole sequence dropped when masked). The cap bounds the variance a
    few tokens with tiny sampler probability would otherwise add. `cap=None` gives ρ = 1 (no correction:
    `model.rollouts.is_cap: null`), the mismatch still measured.

    Args: logprobs, sampler_logprobs, mask: (m, w) — the trainer's (detached), the sampler's, 1 on real tokens.
    Returns: ρ (m, w), 0 on padding; and the `Mismatch` over the real tokens, for logging.
    """
    check_correction(mode)
    mask = mask.to(logprobs.dtype)
    delta = (logprobs - sampler_logprobs) * mask  # (m, w)
    if cap is None:  # the correction off
        weight, past = torch.ones_like(delta), torch.zeros_like(mask)
    else:
        weight, past = CORRECTIONS[mode](delta, mask, cap)
    weight = weight * mask
    padding = ~mask.bool()
    # The extremes over real tokens by masking, not indexing: no device-to-host sync per micro-batch on a GPU (a
    # micro-batch without real tokens gives inf / −inf, which any other replaces)
    mismatch = Mismatch(
        delta.abs().sum(), ((delta.exp() - 1.0 - delta) * mask).sum(), (past * mask).sum(), mask.sum(), weight.sum(),
        weight.masked_fill(padding, torch.inf).min(), weight.masked_fill(padding, -torch.inf).max(),
    )
    return weight, mismatch


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
