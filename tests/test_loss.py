import pytest
import torch

from lightning_logra.loss import group_advantages, token_weights


def test_group_advantages_center_and_scale_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])  # two groups of 4
    # group 1: mean 0.25, std (unbiased) = √(0.75/3·... ) = 0.5; group 2: all equal → advantage 0
    centered = group_advantages(rewards, 4, scale=False)
    torch.testing.assert_close(centered, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0]))
    scaled = group_advantages(rewards, 4, scale=True)
    torch.testing.assert_close(scaled[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-4))
    assert torch.equal(scaled[4:], torch.zeros(4))


def test_token_weights_by_loss_type():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])  # lengths 3 and 1, 4 tokens in all
    torch.testing.assert_close(token_weights(mask, "dapo", 4), mask / 4)
    torch.testing.assert_close(token_weights(mask, "grpo", 4), torch.tensor([[1 / 6] * 3 + [0], [1 / 2, 0, 0, 0]]))
    torch.testing.assert_close(token_weights(mask, "dr_grpo", 4), mask / 8)
    with pytest.raises(ValueError, match="loss_type"):
        token_weights(mask, "ppo", 4)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_micro_batches_sum_to_the_full_batch_loss(loss_type):
    torch.manual_seed(0)
    mask = (torch.rand(6, 5) < 0.7).long()
    mask[:, 0] = 1
    logprobs, advantages = -torch.rand(6, 5), torch.randn(6)
    weights = token_weights(mask, loss_type, 5)
    full = -(weights * advantages[:, None] * logprobs).sum()
    parts = sum(-(weights[r] * advantages[r, None] * logprobs[r]).sum() for r in torch.arange(6).split(4))
    torch.testing.assert_close(parts, full)
    if loss_type == "grpo":  # mean over sequences of the per-sequence token mean
        per_seq = (advantages[:, None] * logprobs * mask).sum(1) / mask.sum(1)
        torch.testing.assert_close(full, -per_seq.mean())
