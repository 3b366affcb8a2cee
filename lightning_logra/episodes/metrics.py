"""What a step's episodes did, as metrics, and the environment's own rewards as the column rewards read."""

from __future__ import annotations

import math

import torch

from lightning_logra.base.batch import EPISODE_COLUMNS, Rollout


def environment_rewards(rollout: Rollout) -> list[float | None]:
    """Each episode's environment reward (`reward()` of its environment; None where it has none): the
    `environment_reward` column of the rewards."""
    values = rollout.episodes[:, EPISODE_COLUMNS.index("environment_reward")].tolist()
    return [None if math.isnan(value) else value for value in values]


def episode_metrics(rollout: Rollout) -> dict[str, torch.Tensor]:
    """Per episode, the means: `episodes/turns`, `tool_calls`, `tool_errors`, `invalid_calls`, the sampled and the
    environment's tokens; and `episodes/environment_s`, the step's seconds in the environments. {} for one turn."""
    if rollout.episodes is None:
        return {}
    real = rollout.completion_mask.sum(-1) > 0  # not a row dynamic sampling left this rank without tokens
    stats = rollout.episodes[real.cpu()].float()  # (n, columns)
    column = {name: stats[:, k] for k, name in enumerate(EPISODE_COLUMNS)}
    sampled = rollout.loss_mask[real].sum(-1).float()
    environment = rollout.completion_mask[real].sum(-1).float() - sampled
    metrics = {f"episodes/{name}": column[name].mean() for name in ("turns", "tool_calls", "tool_errors",
                                                                     "invalid_calls")}
    metrics["episodes/environment_s"] = column["environment_s"].sum()
    metrics["episodes/sampled_tokens"] = sampled.mean().cpu()
    metrics["episodes/environment_tokens"] = environment.mean().cpu()
    return metrics
