"""The sampler corrections (`model.rollouts.is_mode`) and the ratio losses (`model.loss.type` gspo, cispo) in a real
training
step: a Trainer fit's gradient (the module's `accumulate_gradients`) against the objective written out here by hand,
exact in float64. Their ratios only matter on a stale batch, so each test shifts the sampler's log-probs column by
column (`test_kl_penalty.SHIFT`: the ratios e^-0.7, e^0.5, e^1, e^0.2) and checks that the clip binds on at least 10%
of the tokens. The weights and losses alone: tests/unit/algo/test_offpolicy_losses.py."""

import copy

import pytest
import torch
from test_kl_penalty import (
    TEMPERATURE,
    advantages_of,
    assert_same_gradients,
    half_learnable,
    make_module,
    one_step,
    token_logprobs_at,
)


def by_hand(step, loss_type, clip):
    """The step's objective and gradient in float64, written out over all 16 samples from the full logits: gspo
    −Σ_i min(s_i·A_i, clip(s_i)·A_i) / 16 with s_i = exp(mean_t (l − l_sampler)); cispo
    −Σ_t sg(min(r_t, cap))·A·l_t / tokens. Returns (objective, gradients, the fraction of tokens the clip bound)."""
    rollout, policy = step["rollout"], copy.deepcopy(step["start"])
    mask = rollout.completion_mask.double()  # (16, C)
    logp = token_logprobs_at(policy, rollout)
    delta = (logp - rollout.sampler_logprobs.double()) * mask
    advantages = advantages_of(half_learnable)
    if loss_type == "gspo":
        s = (delta.sum(1) / mask.sum(1)).exp()  # (16,)
        unclipped, clipped = s * advantages, s.clamp(1 - clip[0], 1 + clip[1]) * advantages
        # grpo's per-token weights are float32 (1/(16·length) rounded once), summed over the sequence's tokens
        w = (mask.float() / (mask.float().sum(1, keepdim=True) * 16)).double()
        objective = -(w * torch.minimum(unclipped, clipped)[:, None]).sum()
        bound = ((clipped < unclipped)[:, None] * mask).sum() / mask.sum()
    else:
        ratio = delta.detach().exp()
        w = (mask.float() / float(mask.sum())).double()
        objective = -(w * ratio.clamp(max=clip[1]) * advantages[:, None] * logp).sum()
        bound = (((ratio > clip[1]) & (advantages[:, None] != 0)) * mask).sum() / mask.sum()
    objective.backward()
    return objective.item(), {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}, float(bound)


@pytest.mark.parametrize("loss_type, clip", [("gspo", (0.2, 0.2)), ("cispo", (None, 1.5))])
def test_a_step_on_a_stale_batch_follows_the_hand_written_objective(tiny_arith_model, loss_type, clip):
    module = make_module(tiny_arith_model, half_learnable, loss_type=loss_type, epsilon=clip[0] or 0.2,
                         epsilon_high=clip[1])
    step = one_step(module, precision="64-true", moved=True)
    objective, grads, bound = by_hand(step, loss_type, clip)
    assert bound >= 0.1  # the clip binds: the step differs from grpo's / dapo's
    assert step["metrics"]["clip_ratio/region_mean"] == pytest.approx(bound, rel=1e-6)  # logged in float32
    assert_same_gradients(step["grads"], grads)
    assert step["metrics"]["train/loss"] == pytest.approx(objective, rel=1e-6)
    # The loss's ratio is the correction: no importance weight on top (every applied weight is 1).
    assert step["metrics"]["sampling/importance_sampling_ratio/min"] == 1.0
    assert step["metrics"]["sampling/importance_sampling_ratio/max"] == 1.0
    assert TEMPERATURE != 1.0  # log-probs at the sampling temperature (token_logprobs_at divides by it)
