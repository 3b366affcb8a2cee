"""Advantages: each completion's reward made the weight of its tokens, relative to the other samples of its prompt.

Every estimator subtracts the mean reward of the completion's group (the samples of one prompt) and differs in what
it divides by, registered by name (`ADVANTAGES`, `@advantage("group")`); `model.loss.scale_rewards` chooses one, as
TRL's `scale_rewards` does:

    group: the group's standard deviation (GRPO)
    batch: the standard deviation of every reward of the global batch (robust to groups whose rewards barely differ)
    none:  nothing (Dr. GRPO, which argues that dividing by a group's std up-weights prompts that are almost always
           right or wrong)

`true` and `false` stand for group and none. Groups stay on one process; the batch's standard deviation is taken over
every process's rewards (`sum_over_ranks`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

# (rewards (N,) of groups of `group_size` adjacent samples, group_size, sum_over_ranks) → advantages (N,)
AdvantageFn = Callable[[torch.Tensor, int, Callable[[torch.Tensor], torch.Tensor]], torch.Tensor]
ADVANTAGES: dict[str, AdvantageFn] = {}
EPS = 1e-4  # added to a standard deviation before dividing by it


def advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Registers an advantage estimator under `name` (`model.loss.scale_rewards: <name>`)."""

    def register(fn: AdvantageFn) -> AdvantageFn:
        ADVANTAGES[name] = fn
        return fn

    return register


def _centered(rewards: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    grouped = rewards.view(-1, group_size)  # (groups, G)
    return grouped, grouped - grouped.mean(1, keepdim=True)


@advantage("group")
def _by_group_std(rewards: torch.Tensor, group_size: int, sum_over_ranks=None) -> torch.Tensor:
    grouped, centered = _centered(rewards, group_size)
    return (centered / (grouped.std(1, keepdim=True) + EPS)).reshape(-1)


@advantage("batch")
def _by_batch_std(rewards: torch.Tensor, group_size: int, sum_over_ranks=None) -> torch.Tensor:
    _, centered = _centered(rewards, group_size)
    values = rewards.double()
    sums = torch.stack([values.new_tensor(float(len(values))), values.sum(), (values * values).sum()])  # (3,)
    count, total, squares = sum_over_ranks(sums) if sum_over_ranks is not None else sums
    std = ((squares - total * total / count) / (count - 1)).clamp(min=0).sqrt()  # Bessel's correction, as torch.std
    return (centered / (std.to(centered.dtype) + EPS)).reshape(-1)


@advantage("none")
def _centered_only(rewards: torch.Tensor, group_size: int, sum_over_ranks=None) -> torch.Tensor:
    return _centered(rewards, group_size)[1].reshape(-1)


ScaleRewards = Literal[tuple(ADVANTAGES)] | bool  # the registered names, for the config's check


def estimator(scale_rewards: str | bool) -> AdvantageFn:
    """The estimator `model.loss.scale_rewards` names (true: group, false: none)."""
    name = ("group" if scale_rewards else "none") if isinstance(scale_rewards, bool) else scale_rewards
    if name not in ADVANTAGES:
        raise ValueError(f"model.loss.scale_rewards must be one of {sorted(ADVANTAGES)} (or true: group, false: none), "
                         f"got {scale_rewards!r}")
    return ADVANTAGES[name]


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool | str = True,
                     sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """rewards (N,) with N = groups·group_size, samples of one prompt adjacent → advantages (N,), by the estimator
    `scale` names (`estimator`)."""
    return estimator(scale)(rewards, group_size, sum_over_ranks)
