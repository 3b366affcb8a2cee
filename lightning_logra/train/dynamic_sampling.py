"""DAPO's dynamic sampling (`model.rollouts.dynamic_sampling`, verl's `filter_groups`): a group whose rewards are all
equal has advantages of zero and teaches nothing, so it is left out, and more prompts are generated until the step has
its `data.batch_size` learnable groups, up to `model.rollouts.max_generation_rounds` rounds; then the step trains on
what there is, and `rollout/missing_groups` says how many it lacked.

Which groups a step keeps does not depend on how many processes share it: the learnable groups are ordered as one
process would hold them (round by round, in each round rank by rank, each rank's in batch order) and the first
`data.batch_size` are kept, each by the rank that drew it. So the ranks may keep different numbers of groups; a rank
that keeps none trains one group whose tokens all count zero, so that every rank still runs the step's passes (the
micro-batch loop evens the number of passes out: `PolicyGradient.accumulate`). A step none of whose groups is
learnable on any rank trains on its first round as drawn (advantages of zero: `model.scoring.max_unlearnable_steps`
counts it). Each kept row carries its place in one process's order (`Drawn.positions`): the KL controller draws its
subset by it, so that one and several processes measure q on the same responses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_logra.base.batch import Rollout, concat

Batch = dict[str, list[Any]]

log = logging.getLogger(__name__)


@dataclass
class Drawn:
    """One round of a step on this rank: its prompts (and their columns), n completions of each, their rewards."""

    batch: Batch
    rollout: Rollout
    rewards: torch.Tensor  # (N,) the total rewards
    per_reward: torch.Tensor  # (N, F) each reward's, NaN where it returned None
    staleness: torch.Tensor  # (N,) how many updates older than the step's the weights that drew each row were
    # (N,) each row's place in the step's global batch as one process holds it; None: rank-major (every rank's rows
    # in rank order, as a step without dynamic sampling holds them); empty on a rank whose rows all count zero
    positions: torch.Tensor | None = None

    def groups(self, keep: torch.Tensor, group_size: int) -> Drawn:
        """The groups at indices `keep` (ascending), their rows in order."""
        rows = (keep[:, None] * group_size + torch.arange(group_size)).reshape(-1)
        device_rows = rows.to(self.rewards.device)
        return Drawn({key: [values[int(g)] for g in keep] for key, values in self.batch.items()},
                     self.rollout.select(device_rows), self.rewards[device_rows], self.per_reward[device_rows],
                     self.staleness[device_rows])


def learnable(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(groups,) bool: whether a group's rewards differ (its advantages are not all zero)."""
    groups = rewards.view(-1, group_size)
    return groups.amax(1) > groups.amin(1)


def kept_per_round(counts: torch.Tensor, rank: int, target: int) -> torch.Tensor:
    """How many of this rank's learnable groups each round keeps (R,), from every rank's counts (R, world): the first
    `target` in the order one process holds them (round-major, then rank)."""
    flat = counts.reshape(-1)
    before = flat.cumsum(0) - flat  # learnable groups ahead of each (round, rank) cell
    mine = counts[:, rank]
    return (target - before.view_as(counts)[:, rank]).clamp(min=0).minimum(mine)


def kept_positions(counts: torch.Tensor, rank: int, keep: torch.Tensor, group_size: int) -> torch.Tensor:
    """(rows,) where this rank's kept rows stand in one process's order: round by round, in each round rank by rank.
    A (round, rank) cell that keeps any group comes after cells that keep all theirs (`kept_per_round`), so its
    groups start at the number of learnable groups ahead of it."""
    flat = counts.reshape(-1)
    ahead = (flat.cumsum(0) - flat).view_as(counts)[:, rank]  # (R,) groups ahead of this rank's cell in each round
    groups = torch.cat([start + torch.arange(k) for start, k in zip(ahead.tolist(), keep.tolist())])
    return (groups[:, None] * group_size + torch.arange(group_size)).reshape(-1)


def concat_drawn(parts: list[Drawn]) -> Drawn:
    batch = {key: [value for part in parts for value in part.batch[key]] for key in parts[0].batch}
    return Drawn(batch, concat([p.rollout for p in parts]), torch.cat([p.rewards for p in parts]),
                 torch.cat([p.per_reward for p in parts]), torch.cat([p.staleness for p in parts]))


class DynamicSampling:
    """
    Args:
        max_rounds: the most rounds of generation a step makes (the first included).
        group_size: completions per prompt (G).
        rank, world_size: this process's place among the ranks.
        sum_over_ranks: a collective every rank calls at the same point, on tensors on `device`.
    """

    def __init__(self, max_rounds: int, group_size: int, rank: int, world_size: int,
                 sum_over_ranks: Callable[[torch.Tensor], torch.Tensor], device: torch.device | str = "cpu") -> None:
        self.max_rounds, self.group_size = max_rounds, group_size
        self.rank, self.world_size, self.sum_over_ranks, self.device = rank, world_size, sum_over_ranks, device

    def fill(self, first: Drawn, more: Callable[[int], Drawn]) -> tuple[Drawn, dict[str, float]]:
        """The step's groups: the learnable ones of `first` and of as many more rounds as it takes (`more(round)`
        draws round `round` ≥ 1) to reach the global batch's number of groups, at most `max_rounds` rounds in all.
        Every rank makes the same number of rounds. Returns them with the step's metrics."""
        prompts = len(first.batch["prompt"])  # this rank's; every rank draws as many per round
        target = prompts * self.world_size
        rounds, masks = [first], [learnable(first.rewards, self.group_size).cpu()]
        found = self._count(masks[0])
        while found < target and len(rounds) < self.max_rounds:
            rounds.append(more(len(rounds)))
            masks.append(learnable(rounds[-1].rewards, self.group_size).cpu())
            found += self._count(masks[-1])
        metrics = {"rollout/generation_rounds": float(len(rounds)),
                   "rollout/prompts_drawn": float(target * len(rounds)),
                   "rollout/filtered_groups": float(target * len(rounds) - found),
                   "rollout/missing_groups": float(max(0, target - found))}
        # nothing to learn anywhere: the first round as drawn (model.scoring.max_unlearnable_steps counts it)
        if found == 0:
            log.warning("model.rollouts.dynamic_sampling: none of the %d groups drawn in %d rounds "
                        "(model.rollouts.max_generation_rounds) has rewards that differ: this step learns nothing; "
                        "check the reward and the data, and set model.scoring.max_unlearnable_steps to stop a run that "
                        "goes on like this", target * len(rounds), len(rounds))
            return first, metrics
        counts = torch.zeros(len(rounds), self.world_size, dtype=torch.float64)
        counts[:, self.rank] = torch.tensor([float(mask.sum()) for mask in masks], dtype=torch.float64)
        counts = self.sum_over_ranks(counts.to(self.device)).cpu().long()  # (R, world)
        keep = kept_per_round(counts, self.rank, target)
        parts = [drawn.groups(mask.nonzero().squeeze(-1)[:k], self.group_size)
                 for drawn, mask, k in zip(rounds, masks, keep.tolist()) if k > 0]
        if parts:
            kept = concat_drawn(parts)
            kept.positions = kept_positions(counts, self.rank, keep, self.group_size)
            return kept, metrics
        # Others keep groups, this rank none: one group whose tokens count zero keeps its passes in step with theirs
        idle = first.groups(torch.zeros(1, dtype=torch.long), self.group_size)
        idle.rollout = idle.rollout.emptied()
        idle.per_reward = torch.full_like(idle.per_reward, float("nan"))  # no reward of it reaches the metrics
        idle.positions = torch.zeros(0, dtype=torch.long)  # none of its rows is in one process's batch
        return idle, metrics

    def _count(self, mask: torch.Tensor) -> int:
        """Learnable groups in a round, over every rank."""
        return int(self.sum_over_ranks(mask.sum().double().view(1).to(self.device))[0])
