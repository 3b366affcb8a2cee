"""Metrics per task, for data whose rows each name their task (a `task` column) and whose data module lists the tasks
(`RLVRDataModule.task_names`; the reasoning-gym mix): every training step's `reward/<task>/mean`, and every
evaluation metric of a validation or test set per task (`val/<task>/pass@8`).

Exact over ranks: each rank adds up its rows' values and counts per task, and the sums are reduced, never the ranks'
means. The task list is the data module's, the same on every rank, so every rank reduces tensors of one shape even
when it holds no row of some task. A task with no row (in a step, or a set) is NaN: it does not apply, and a value
from another step must not stand in for it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SumOverRanks = Callable[[torch.Tensor], torch.Tensor]


def task_index(names: list[str], tasks: list[str], device: torch.device | None = None) -> torch.Tensor:
    """(rows,) the position in `names` of each row's task."""
    position = {name: index for index, name in enumerate(names)}
    unknown = sorted(set(tasks) - position.keys())
    if unknown:
        raise ValueError(f"rows of the tasks {unknown} in a batch whose data module lists only {names} "
                         "(task_names() must name every task its rows do)")
    return torch.tensor([position[task] for task in tasks], dtype=torch.long, device=device)


def _sums(index: torch.Tensor, values: torch.Tensor, count: int) -> torch.Tensor:
    """(2, count) float64: the sum of `values` (rows,) and the number of rows of each task."""
    sums = torch.zeros(2, count, dtype=torch.float64, device=values.device)
    sums[0].index_add_(0, index, values.double())
    sums[1].index_add_(0, index, torch.ones_like(values, dtype=torch.float64))
    return sums


def task_means(names: list[str], index: torch.Tensor, values: torch.Tensor, sum_over_ranks: SumOverRanks,
               key: str) -> dict[str, torch.Tensor]:
    """{`key` with `<task>` in place of its task: the mean of the task's `values` (rows,) over every rank}."""
    total, count = sum_over_ranks(_sums(index, values, len(names)))
    means = (total / count).float()  # NaN where a task has no row
    return {key.replace("<task>", name): means[i] for i, name in enumerate(names)}


class TaskTally:
    """Per-prompt metrics of one evaluation set, summed per task over its batches; `compute` at the set's end."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.sums: dict[str, torch.Tensor] = {}  # metric → (2, tasks): the sum of values and the number of prompts

    def add(self, index: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        """`values`: {metric (`val/pass@8`): (prompts,)} of a batch whose prompts' tasks are `index` (prompts,)."""
        for key, per_prompt in values.items():
            sums = _sums(index.to(per_prompt.device), per_prompt, len(self.names)).cpu()
            self.sums[key] = self.sums[key] + sums if key in self.sums else sums

    def compute(self, sum_over_ranks: SumOverRanks, device: torch.device) -> dict[str, torch.Tensor]:
        """{`val/<task>/pass@8`: the task's mean over every rank's prompts}; the tally starts over."""
        metrics = {}
        for key in sorted(self.sums):  # the same order on every rank: each key is one reduction
            total, count = sum_over_ranks(self.sums[key].to(device))
            stage, _, metric = key.partition("/")
            for i, name in enumerate(self.names):
                metrics[f"{stage}/{name}/{metric}"] = (total[i] / count[i]).float()
        self.sums = {}
        return metrics
