"""The sampler corrections (`model.rollouts.is_mode`) and the losses with a ratio to the sampler (`model.loss.type`
gspo, cispo), on their own: weights, clips and losses computed by lightning_logra.algo.losses and compared, exact in
float64, with the same quantities written out here. tests/integration/cli/test_offpolicy_runs.py compares a real
training step's gradient with them."""

import math
from dataclasses import astuple

import pytest
import torch

from lightning_logra.algo.losses import (
    CORRECTIONS,
    Clip,
    Mismatch,
    cispo,
    gspo,
    importance_weights,
)

# Two sequences of 3 and 2 tokens; log-ratios Δ = log π_θ − log π_sampler chosen so that each mode acts differently.
DELTA = torch.tensor([[0.2, 1.0, -0.5], [0.3, 0.3, 0.0]], dtype=torch.float64)


MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_each_correction_weighs_tokens_as_trl_defines_it():
    sampler = torch.zeros_like(DELTA)
    e = math.exp
    expected = {  # cap 2: e^1 = 2.72 and the first sequence's e^0.7 = 2.01 are past it; e^0.6 of the second is not
        "token_truncate": [[e(0.2), 2.0, e(-0.5)], [e(0.3), e(0.3), 0.0]],
        "token_mask": [[e(0.2), 0.0, e(-0.5)], [e(0.3), e(0.3), 0.0]],
        "sequence_truncate": [[2.0, 2.0, 2.0], [e(0.6), e(0.6), 0.0]],
        "sequence_mask": [[0.0, 0.0, 0.0], [e(0.6), e(0.6), 0.0]],
    }
    past = {"token_truncate": 1, "token_mask": 1, "sequence_truncate": 3, "sequence_mask": 3}
    assert set(CORRECTIONS) == set(expected)
    for mode, weights in expected.items():
        weight, stats = importance_weights(DELTA, sampler, MASK, cap=2.0, mode=mode)
        torch.testing.assert_close(weight, torch.tensor(weights, dtype=torch.float64), rtol=1e-15, atol=0, msg=mode)
        metrics = stats.metrics()
        assert float(metrics["rollout/is_clipped_frac"]) == past[mode] / 5, mode
        real = torch.tensor(weights)[MASK.bool()]
        assert float(metrics["sampling/importance_sampling_ratio/mean"]) == pytest.approx(float(real.mean()))
        assert float(metrics["sampling/importance_sampling_ratio/min"]) == pytest.approx(float(real.min()))
        assert float(metrics["sampling/importance_sampling_ratio/max"]) == pytest.approx(float(real.max()))
    # No cap: the correction is off in every mode (weights 1), the mismatch still measured.
    for mode in expected:
        weight, stats = importance_weights(DELTA, sampler, MASK, cap=None, mode=mode)
        assert torch.equal(weight, MASK.double()) and float(stats.abs_diff) == pytest.approx(2.3)
    with pytest.raises(ValueError, match=r"model.rollouts.is_mode must be one of \['sequence_mask', "
                                         r"'sequence_truncate', 'token_mask', 'token_truncate'\], got 'sequence'"):
        importance_weights(DELTA, sampler, MASK, cap=2.0, mode="sequence")


def test_statistics_of_micro_batches_combine_to_those_of_the_whole_batch():
    sampler = torch.zeros_like(DELTA)
    _, whole = importance_weights(DELTA, sampler, MASK, 2.0, "token_mask")
    total = Mismatch.empty("cpu", torch.float64)
    for row in range(2):
        total = total.add(importance_weights(DELTA[row:row + 1], sampler[:1], MASK[row:row + 1], 2.0, "token_mask")[1])
    torch.testing.assert_close(torch.stack(astuple(total)), torch.stack(astuple(whole)))
    assert math.isnan(float(Mismatch.empty("cpu").metrics()["sampling/importance_sampling_ratio/max"]))


def test_gspo_and_cispo_gradients_match_their_hand_derived_forms():
    """∂(Σ o)/∂l_t, derived by hand. gspo puts o_i on each of sequence i's tokens, and ∂o_i/∂l_t = s_i·A_i/length_i
    where the clip does not bind (0 where it does): s·A per token. cispo: min(r_t, cap)·A. The batch is stale enough
    that both clips bind."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.2, 0.0], [-0.3, -0.9, -1.1]], dtype=torch.float64)
    sampler = logprobs - torch.tensor([[0.3, 0.4, 0.2], [0.05, -0.02, 0.0], [-0.6, -0.4, -0.5]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    advantages = torch.tensor([1.0, -0.5, -1.0], dtype=torch.float64)
    lengths = mask.sum(1).double()
    delta = (logprobs - sampler) * mask
    s = (delta.sum(1) / lengths).exp()  # e^0.3, e^0.015, e^-0.5
    clip = Clip(epsilon=0.2, epsilon_high=0.25)
    # Sequence 0: s = 1.35 > 1.25 with A > 0: clipped. 1: inside. 2: s = 0.61 < 0.8 with A < 0: clipped.
    unclipped = torch.tensor([False, True, False])
    trained = logprobs.clone().requires_grad_(True)
    objective, binds = gspo(trained, sampler, mask, advantages, clip)
    objective.sum().backward()
    expected = torch.where(unclipped[:, None], s[:, None] * advantages[:, None], 0.0)
    torch.testing.assert_close(trained.grad, expected * mask, rtol=1e-14, atol=0)
    assert binds.sum() / mask.sum() >= 0.1 and torch.equal(binds.bool().any(1), ~unclipped)
    bounded = torch.tensor([1.25 if a > 0 else 0.8 for a in advantages.tolist()], dtype=torch.float64) * advantages
    torch.testing.assert_close(objective[:, 0], torch.where(unclipped, s * advantages, bounded), rtol=1e-15, atol=0)

    cap = Clip(epsilon_high=1.3)  # token ratios e^0.3, e^0.4, e^0.2 of the first sequence: two past the cap
    trained = logprobs.clone().requires_grad_(True)
    objective, binds = cispo(trained, sampler, mask, advantages, cap)
    objective.sum().backward()
    expected = delta.exp().clamp(max=1.3) * advantages[:, None] * mask
    torch.testing.assert_close(trained.grad, expected, rtol=1e-15, atol=0)
    assert binds.sum() / mask.sum() >= 0.1 and int(binds.sum()) == 2


@pytest.mark.parametrize("settings, message", [
    ({"rollouts": {"is_mode": "sequence"}}, r"model.rollouts.is_mode must be one of \['sequence_mask', "
                                            r"'sequence_truncate', "
                              r"'token_mask', 'token_truncate'\]"),
    ({"loss": {"type": "ppo"}}, r"model.loss.type must be one of \['cispo', 'dapo', 'dr_grpo', 'grpo', 'gspo'\]"),
    ({"loss": {"epsilon": 0.0}}, "model.loss.epsilon must be a positive number"),
    ({"loss": {"epsilon_high": float("nan")}}, "model.loss.epsilon_high must be a positive number"),
    ({"rollouts": {"max_staleness": -1}}, "model.rollouts.max_staleness must be a whole number of steps ≥ 0"),
    ({"rollouts": {"max_staleness": 1.5}}, "model.rollouts.max_staleness must be a whole number of steps ≥ 0"),
])
def test_bad_settings_are_refused_naming_the_key(tiny_arith_model, settings, message):
    from lightning_logra.train.module import RLVRModule

    with pytest.raises(ValueError, match=message):
        RLVRModule(tiny_arith_model, **settings)
