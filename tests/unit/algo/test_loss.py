import pytest
import torch

from lightning_logra.algo.advantages import ADVANTAGES, group_advantages
from lightning_logra.algo.losses import LOSSES, loss, token_weights


def test_group_advantages_center_and_scale_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])  # two groups of 4
    # group 1: mean 0.25, std (unbiased) = √(0.75/3·... ) = 0.5; group 2: all equal → advantage 0
    centered = group_advantages(rewards, 4, scale=False)
    torch.testing.assert_close(centered, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0]))
    scaled = group_advantages(rewards, 4, scale=True)
    torch.testing.assert_close(scaled[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-4))
    assert torch.equal(scaled[4:], torch.zeros(4))


def test_batch_scaling_divides_by_the_std_of_every_reward_over_all_ranks():
    # TRL's scale_rewards="batch": centered within each group, divided by the standard deviation of the whole global
    # batch's rewards (float64 by hand). Two ranks each hold two groups of 4; the std is the global batch's.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0],
                           dtype=torch.float64)
    std = float(rewards.std())  # over all 16 (Bessel's correction, as torch.std)
    centered = torch.cat([g - g.mean() for g in rewards.view(-1, 4)])
    expected = centered / (std + 1e-4)
    torch.testing.assert_close(group_advantages(rewards, 4, "batch"), expected, rtol=1e-12, atol=0)
    halves = rewards[:8], rewards[8:]

    def other_rank_too(mine):  # what summing over 2 ranks gives on each (counts, sums, sums of squares)
        def sums(part):
            return torch.stack([part.new_tensor(float(len(part))), part.sum(), (part * part).sum()])
        return sums(halves[0]) + sums(halves[1])

    per_rank = torch.cat([group_advantages(half, 4, "batch", other_rank_too) for half in halves])
    torch.testing.assert_close(per_rank, expected, rtol=1e-12, atol=0)
    # the three estimators, and TRL's booleans: true is group, false is none
    assert sorted(ADVANTAGES) == ["batch", "group", "none"]
    assert torch.equal(group_advantages(rewards, 4, True), group_advantages(rewards, 4, "group"))
    assert torch.equal(group_advantages(rewards, 4, False), centered)
    with pytest.raises(ValueError, match=r"model.loss.scale_rewards must be one of \['batch', 'group', 'none'\]"):
        group_advantages(rewards, 4, "rank")


def test_a_loss_registered_by_name_is_one_the_config_can_choose():
    # A new loss is one function and a decorator; an unknown name's error lists the registered ones.
    @loss("sum")
    def _sum(mask, max_new_tokens, tokens, sequences):
        return mask

    try:
        assert torch.equal(token_weights(MASK, "sum", 5), MASK.float())
        names = r"\['cispo', 'dapo', 'dr_grpo', 'grpo', 'gspo', 'sum'\]"
        with pytest.raises(ValueError, match=r"model.loss.type must be one of " + names):
            token_weights(MASK, "ppo", 5)
    finally:
        del LOSSES["sum"]


# Three completions of lengths 3, 1 and 2 (6 tokens), padded to 4 columns; max_new_tokens 5 (not the padded width).
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]])


def _on_mask(row_weights):
    """Per-row weights spread over each row's real tokens (0 on padding), as float32 like token_weights."""
    return MASK * torch.tensor(row_weights, dtype=torch.float32)[:, None]


@pytest.mark.parametrize("counts, expected", [
    # This batch alone: 6 tokens, 3 sequences.
    #   dapo: every token 1/6 · grpo: 1/(3 · length) = 1/9, 1/3, 1/6 · dr_grpo: 1/(3 · 5) = 1/15
    ({}, {"dapo": [1 / 6] * 3, "grpo": [1 / 9, 1 / 3, 1 / 6], "dr_grpo": [1 / 15] * 3}),
    # The same rows as one process's share of a global batch of 8 sequences and 20 tokens: the normalizers are the
    # global counts. dapo: 1/20 · grpo: 1/(8 · length) = 1/24, 1/8, 1/16 · dr_grpo: 1/(8 · 5) = 1/40
    ({"total_tokens": 20.0, "total_sequences": 8},
     {"dapo": [1 / 20] * 3, "grpo": [1 / 24, 1 / 8, 1 / 16], "dr_grpo": [1 / 40] * 3}),
], ids=["one process", "a shard of a global batch"])
def test_token_weights_by_loss_type(counts, expected):
    for loss_type, row_weights in expected.items():
        # Exact: each weight is 1 divided by an integer, computed once in float32 both here and there.
        assert torch.equal(token_weights(MASK, loss_type, 5, **counts), _on_mask(row_weights)), loss_type
    with pytest.raises(ValueError, match="model.loss.type"):
        token_weights(MASK, "ppo", 5)


def test_each_loss_type_is_its_published_average():
    # What the weights are for, checked on the loss itself: with per-token terms t = A · log π,
    #   dapo (DAPO's token-level loss): −(Σ over all tokens t) / (tokens in the batch)
    #   grpo: −mean over sequences of (Σ over the sequence's tokens t) / length
    #   dr_grpo (Dr. GRPO): −(Σ over all tokens t) / (sequences · max_new_tokens)
    torch.manual_seed(0)
    logprobs, advantages = -torch.rand(3, 4), torch.randn(3)
    terms = advantages[:, None] * logprobs * MASK  # (3, 4), 0 on padding
    published = {
        "dapo": -terms.sum() / 6,
        "grpo": -(terms.sum(1) / torch.tensor([3.0, 1.0, 2.0])).mean(),
        "dr_grpo": -terms.sum() / (3 * 5),
    }
    for loss_type, expected in published.items():
        loss = -(token_weights(MASK, loss_type, 5) * advantages[:, None] * logprobs).sum()
        torch.testing.assert_close(loss, expected, msg=loss_type)
