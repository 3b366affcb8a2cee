"""The loss mask of multi-turn episodes: every token sum counts the sampled tokens alone.

The check: an episode whose environment tokens come last (after its final sampled token) must train exactly as the
same rows without them, since no earlier token attends to a later one. Were any sum to count the environment's
tokens (the loss's normalizer, the importance ratios, the surrogate, the entropy bonus, the KL penalty, the KL
estimates, the staleness), the two would differ: their sampler log-probs are set far from the policy's on purpose."""

import copy

import pytest
import torch

from lightning_logra.algo.kl import mean_token_kl, next_tokens
from lightning_logra.base.batch import Rollout
from lightning_logra.train.module import RLVRModule

MODEL = "lightning_logra/data/tiny_arith"
ENV = 3  # environment tokens after each row's last sampled token


def rollouts(seed: int = 0) -> tuple[Rollout, Rollout]:
    """(with the environment's tokens, masked out of every sum; without them)."""
    g = torch.Generator().manual_seed(seed)
    n, prompt, sampled = 4, 3, 5
    lengths = torch.tensor([5, 3, 4, 2])
    width = sampled + ENV
    ids = torch.randint(3, 15, (n, width), generator=g)
    columns = torch.arange(width)
    sampled_mask = (columns < lengths[:, None]).long()  # (n, width)
    present = (columns < lengths[:, None] + ENV).long()
    logprobs = -torch.rand(n, width, generator=g) * sampled_mask - 7.0 * (present - sampled_mask)  # far off on env
    prompt_ids = torch.randint(3, 15, (n, prompt), generator=g)
    ones = torch.ones_like(prompt_ids)
    with_env = Rollout(prompt_ids, ones, ids, present, logprobs, sampled_mask=sampled_mask)
    without = Rollout(prompt_ids, ones, ids, sampled_mask, logprobs * sampled_mask)
    return with_env, without


def module_for(**settings) -> RLVRModule:
    module = RLVRModule(MODEL, **settings, training={"micro_batch_size": 2})
    module.configure_model()
    module.sum_over_ranks = lambda value: value  # one process, no Trainer
    module.max_over_ranks = lambda value: value
    module.manual_backward = lambda loss: loss.backward()
    # the frozen reference a fit loads: the starting weights, before a perturbation
    if settings.get("loss", {}).get("beta", 0) > 0:
        object.__setattr__(module, "reference", copy.deepcopy(module.policy).requires_grad_(False))
        with torch.no_grad():
            for p in module.policy.parameters():
                p.add_(0.01 * torch.randn_like(p))
    return module


@pytest.mark.parametrize("settings", [
    {"loss": {"type": "dapo"}}, {"loss": {"type": "grpo"}}, {"loss": {"type": "dr_grpo"}}, {"loss": {"type": "gspo"}},
    {"loss": {"type": "cispo"}}, {"rollouts": {"is_mode": "sequence_mask"}}, {"loss": {"entropy_coef": 0.01}},
    {"loss": {"beta": 0.05}},
], ids=lambda s: "-".join(f"{g}.{k}={v}" for g, d in s.items() for k, v in d.items()))
def test_the_environments_tokens_count_in_no_sum_of_the_loss(settings):
    with_env, without = rollouts()
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0])
    results = []
    for rollout in (with_env, without):
        module = module_for(**settings)
        torch.manual_seed(0)
        loss, mismatch, metrics = module.accumulate_gradients(rollout, advantages)
        grads = [p.grad.clone() for p in module.policy.parameters() if p.grad is not None]
        results.append((loss, mismatch, metrics, grads))
    (loss_a, mismatch_a, metrics_a, grads_a), (loss_b, mismatch_b, metrics_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b)
    assert mismatch_a.keys() == mismatch_b.keys() and metrics_a.keys() == metrics_b.keys()
    for key in mismatch_a:
        torch.testing.assert_close(torch.as_tensor(mismatch_a[key]), torch.as_tensor(mismatch_b[key]), msg=key)
    for key in metrics_a:
        torch.testing.assert_close(torch.as_tensor(metrics_a[key]), torch.as_tensor(metrics_b[key]), msg=key)
    assert len(grads_a) == len(grads_b) > 0
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b)


def test_the_kl_estimates_count_the_sampled_tokens_alone():
    """The predicted, intended and realized KL, and KLFromStart's, are `mean_token_kl` over `loss_mask`."""
    module = module_for(loss={"beta": 0.05})
    with_env, without = rollouts(1)
    kl = [mean_token_kl(next_tokens(module.policy, r), next_tokens(module.reference, r), r.loss_mask)
          for r in (with_env, without)]
    torch.testing.assert_close(kl[0], kl[1])
    assert kl[0] > 0


def test_staleness_is_measured_over_the_sampled_tokens():
    module = module_for(rollouts={"max_staleness": 1})
    with_env, without = rollouts(2)
    staleness = torch.tensor([1.0, 0.0, 1.0, 1.0])
    a, b = (module.samples.staleness_metrics(staleness, r) for r in (with_env, without))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], msg=key)
