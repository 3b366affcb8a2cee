"""What a training step logs of its samples (TRL's names where TRL has them): rewards, lengths, tokens, and each task's
mean reward for data whose rows name their task (`train.task_metrics`)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_logra.base.batch import Rollout
from lightning_logra.episodes.metrics import episode_metrics
from lightning_logra.train.backward_stats import Reduce
from lightning_logra.train.task_metrics import task_index, task_means


def rollout_metrics(rollout: Rollout, rewards: torch.Tensor, num_generations: int, stop_token_ids: list[int],
                   step_s: float) -> dict[str, Any]:
    """This rank's metrics of the step's samples (the logger averages them over the ranks)."""
    lengths = rollout.completion_lengths.float()
    terminated = rollout.terminated(stop_token_ids).float()
    groups = rewards.view(-1, num_generations)
    return {
        "train/reward_std": rewards.std(),
        "train/frac_reward_zero_std": (groups.std(1) == 0).float().mean(),
        "completions/mean_length": lengths.mean(),
        "completions/min_length": lengths.min(),
        "completions/max_length": lengths.max(),
        "completions/terminated_ratio": terminated.mean(),  # ended with a stop token
        "completions/clipped_ratio": 1.0 - terminated.mean(),  # cut at model.sampling.max_new_tokens
        "train/step_s": step_s,
        **episode_metrics(rollout),
    }


def reward_mean(rollout: Rollout, rewards: torch.Tensor, sum_over_ranks: Reduce) -> torch.Tensor:
    """The mean reward over every rank's samples, exactly: with dynamic sampling the ranks may hold different numbers
    of them, and a rank's group whose tokens count zero (it kept none) is not one."""
    real = rollout.completion_mask.sum(-1) > 0
    total, count = sum_over_ranks(torch.stack([rewards[real].sum(), real.sum().float()])).unbind()
    return total / count


def task_rewards(names: list[str], tasks: list[str], rollout: Rollout, rewards: torch.Tensor, num_generations: int,
                 sum_over_ranks: Reduce) -> dict[str, torch.Tensor]:
    """`reward/<task>/mean` over every rank's samples of each task, for data whose rows name their task (`names`,
    and each prompt's in `tasks`); NaN for a task the step drew no prompt of."""
    if not names:
        return {}
    index = task_index(names, tasks, rewards.device).repeat_interleave(num_generations)
    real = rollout.completion_mask.sum(-1) > 0  # not a row dynamic sampling left this rank without tokens
    return task_means(names, index[real], rewards[real], sum_over_ranks, "reward/<task>/mean")
