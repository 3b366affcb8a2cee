"""From completions to the batch's rewards: every reward called with TRL's signature, its outputs checked and
combined with their weights as TRL's GRPOTrainer combines them, each reward's mean and std for the logs, and the
count of steps in a row with nothing to learn."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from lightning_logra.base.settings import real_number
from lightning_logra.rewards.resolve import Reward

log = logging.getLogger(__name__)


def score(rewards: list[Reward], batch: dict[str, list[Any]], completions: list[Any], completion_ids: list[list[int]],
          n: int, step: int, per_sample: dict[str, list[Any]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every reward of `rewards` on the batch's completions (n per prompt, in order). Returns the total rewards
    (N,) and each reward's (N, F), NaN where it returned None.

    TRL's reward signature: the prompts (whatever the batch's prompt column holds: text, or messages), the
    completions, their token ids without padding (a stop token included), and every other column, each repeated per
    sample so that the reward sees lists aligned with the completions; and `per_sample`'s columns, one value per
    completion already (an episode's environment reward)."""
    count = len(batch["prompt"])
    columns = {key: [v for v in values for _ in range(n)] for key, values in batch.items()} | (per_sample or {})
    prompts = columns.pop("prompt")
    outputs = [r.fn(prompts, completions, completion_ids=completion_ids, **columns) for r in rewards]
    total, per_reward, missing, dropped = reward_tensor(outputs, [r.name for r in rewards], [r.weight for r in rewards],
                                                        count, n)
    name = " + ".join(reward.name for reward in rewards)
    if missing.all():
        log.warning("model.reward %r gave no usable reward (all None or NaN) for any of the %d completions at step %d: "
                    "nothing is learned from this batch. Check the reward function", name, len(total), step)
    elif dropped.any():
        log.warning("model.reward %r gave NaN or infinite rewards in %d of %d groups at step %d: those groups are left "
                    "out of the update", name, int(dropped.sum()), count, step)
    return total, per_reward


def reward_tensor(outputs: list[Any], names: list[str], weights: list[float], prompts: int,
                  n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reward functions' outputs checked and combined, as TRL's GRPOTrainer combines them: the total reward of a
    completion is Σ_i w_i·r_i over the functions that did not return None for it (a sum that skips NaNs).

    Returns (total rewards (prompts·n,), each function's rewards (prompts·n, functions) with NaN for None, which
    completions have no usable total (prompts·n,), which groups were dropped (prompts,)).

    A completion for which every function returned None has no reward (TRL's NaN): it earns 0.0, as a single
    function's None always has here. A NaN or infinite reward drops its whole group: the group's rewards are all set
    to 0.0, so that its advantages are 0 and it adds nothing to the gradient, while the other groups still train."""
    count = prompts * n
    columns, nones = [], []
    for output, name in zip(outputs, names, strict=True):
        try:
            output = list(output)
        except TypeError:
            raise ValueError(f"model.reward {name!r} must return a list of {count} numbers (or None), one per "
                             f"completion; got {type(output).__name__}") from None
        if len(output) != count:
            raise ValueError(f"model.reward {name!r} returned {len(output)} rewards for {count} completions "
                             f"({prompts} prompts × {n} samples): it must return one per completion, in order")
        column = []
        for index, r in enumerate(output):
            value = float("nan") if r is None else real_number(r)  # the rule an environment's reward() is held to
            if value is None:
                raise ValueError(f"model.reward {name!r} returned a {type(r).__name__} ({r!r:.40}) for completion "
                                 f"{index}: a reward must be a number (int, float, bool, a numpy or 0-d torch scalar) "
                                 "or None")
            column.append(value)
        columns.append(column)
        nones.append([r is None for r in output])
    values = torch.tensor(columns, dtype=torch.float32).T  # (N, F)
    none = torch.tensor(nones).T  # (N, F)
    total = (values * torch.tensor(weights, dtype=torch.float32)).nansum(1)  # (N,)
    broken = (~values.isfinite() & ~none).any(1) | ~total.isfinite()  # a NaN or inf, not a None
    missing = none.all(1) | broken
    dropped = broken.view(prompts, n).any(1)
    total[missing] = 0.0
    total.view(prompts, n)[dropped] = 0.0
    return total, values, missing, dropped


def reward_metrics(values: torch.Tensor, keys: list[str], strategy: Any) -> dict[str, torch.Tensor]:
    """reward/<key>/mean and reward/<key>/std of each function's rewards over the global batch (`values` (N, F), NaN
    where a function returned None), leaving out the Nones as TRL does: NaN where a function rated nothing (or,
    for the std, one completion). Exact over ranks: counts and sums are reduced, not each rank's mean."""
    rated = values.isfinite()
    rewards = torch.where(rated, values, 0.0).double()
    sums = torch.stack([rated.sum(0).double(), rewards.sum(0), (rewards * rewards).sum(0)])  # (3, F)
    count, total, squares = strategy.reduce(sums, reduce_op="sum")
    mean = total / count
    std = ((squares - count * mean * mean) / (count - 1)).clamp(min=0).sqrt()  # Bessel's correction, as torch.std
    metrics = {}
    for i, key in enumerate(keys):
        metrics[f"reward/{key}/mean"], metrics[f"reward/{key}/std"] = mean[i].float(), std[i].float()
    return metrics


class UnlearnableSteps:
    """Training steps in a row where no group's rewards differ (every advantage is 0: nothing to learn); the run is
    stopped after `limit` of them (`model.scoring.max_unlearnable_steps`; None: never)."""

    def __init__(self, limit: int | None, rewards: list[Reward]) -> None:
        self.limit, self.rewards = limit, rewards
        self.count = 0

    def add(self, groups: torch.Tensor, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """One training step's rewards, (groups, G) on this rank: the ranks count (and stop) together."""
        learnable = sum_over_ranks((groups.max(1).values > groups.min(1).values).any().float())
        self.count = 0 if learnable > 0 else self.count + 1
        if self.limit is not None and self.count >= self.limit:
            names = " + ".join(reward.name for reward in self.rewards)
            raise RuntimeError(
                f"model.scoring.max_unlearnable_steps={self.limit}: {self.count} training steps in a row had nothing "
                f"to learn (in every group the rewards were equal, None or NaN). Check model.reward {names!r} and the "
                "data, or set model.scoring.max_unlearnable_steps higher or to null")
