"""A rollout's completions scored by the run's rewards, each called as TRL calls it: text (or conversational form)
with the prompts' other columns as keyword arguments (`rewards.scoring.score`)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_logra.base.batch import Rollout
from lightning_logra.episodes import EpisodeRunner
from lightning_logra.episodes.metrics import environment_rewards
from lightning_logra.rewards import Reward
from lightning_logra.rewards.scoring import score
from lightning_logra.train.policy import PromptCodec


def completion_token_lists(rollout: Rollout) -> list[list[int]]:
    """Each completion's token ids without padding (its stop token included)."""
    mask = rollout.completion_mask.bool().cpu()
    return [row[keep].tolist() for row, keep in zip(rollout.completion_ids.cpu(), mask)]


def score_rollout(rewards: list[Reward], codec: PromptCodec, episodes: EpisodeRunner | None,
                  batch: dict[str, list[Any]], rollout: Rollout, n: int, step: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rewards of the rollout's completions (n per prompt of `batch`): (N,) total, (N, rewards) each, on the
    rollout's device. Episodes are scored as conversations, their last message the final answer."""
    completion_ids = completion_token_lists(rollout)
    columns = {key: values for key, values in batch.items() if key != "prompt_ids"}
    per_sample = None
    if rollout.sampled_mask is not None:  # episodes
        completions = episodes.conversations(rollout)
        per_sample = {"environment_reward": environment_rewards(rollout)}
    else:
        completions = codec.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        if codec.chat_template or not all(isinstance(prompt, str) for prompt in batch["prompt"]):
            # TRL's conversational form
            completions = [[{"role": "assistant", "content": text}] for text in completions]
    total, per_reward = score(rewards, columns, completions, completion_ids, n, step, per_sample)
    device = rollout.completion_ids.device
    return total.to(device), per_reward.to(device)
