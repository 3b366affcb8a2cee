"""Metrics per task: exact means over every rank's rows (sums reduced, not means), NaN for a task with no row, an
evaluation set's per-prompt metrics summed over its batches, and rows of a task the data module does not list
refused."""

import math

import pytest
import torch

from lightning_logra.train.task_metrics import TaskTally, task_index, task_means

NAMES = ["gcd", "lcm", "syllogism"]


def _two_ranks(other: torch.Tensor):
    """sum_over_ranks of this rank and another whose tensor is `other`."""
    return lambda mine: mine + other.to(mine)


def test_task_means_are_exact_over_ranks_and_nan_where_a_task_has_no_row():
    index = task_index(NAMES, ["gcd", "gcd", "lcm", "gcd"])
    values = torch.tensor([1.0, 0.0, 1.0, 1.0])
    alone = task_means(NAMES, index, values, lambda t: t, "reward/<task>/mean")
    assert alone["reward/gcd/mean"].item() == pytest.approx(2 / 3)
    assert alone["reward/lcm/mean"].item() == 1.0 and math.isnan(alone["reward/syllogism/mean"].item())
    # another rank with 1 gcd row (0.0) and 2 syllogism rows (1.0, 0.0): the means of all rows, not of the ranks' means
    other = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 2.0]], dtype=torch.float64)
    both = task_means(NAMES, index, values, _two_ranks(other), "reward/<task>/mean")
    assert [both[f"reward/{name}/mean"].item() for name in NAMES] == pytest.approx([2 / 4, 1.0, 0.5])


def test_an_evaluation_set_is_tallied_over_its_batches_and_starts_over():
    tally = TaskTally(NAMES)
    tally.add(task_index(NAMES, ["gcd", "lcm"]), {"val/pass@8": torch.tensor([1.0, 0.0]),
                                                  "val/pass@1": torch.tensor([0.25, 0.0])})
    tally.add(task_index(NAMES, ["gcd", "gcd"]), {"val/pass@8": torch.tensor([0.0, 0.0]),
                                                  "val/pass@1": torch.tensor([0.0, 0.0])})
    metrics = tally.compute(lambda t: t, torch.device("cpu"))
    assert metrics["val/gcd/pass@8"].item() == pytest.approx(1 / 3)
    assert metrics["val/gcd/pass@1"].item() == pytest.approx(0.25 / 3)
    assert metrics["val/lcm/pass@8"].item() == 0.0 and math.isnan(metrics["val/syllogism/pass@1"].item())
    assert sorted(metrics) == sorted(f"val/{name}/{k}" for name in NAMES for k in ("pass@1", "pass@8"))
    assert tally.compute(lambda t: t, torch.device("cpu")) == {}


def test_rows_of_a_task_not_listed_are_refused():
    with pytest.raises(ValueError, match=r"rows of the tasks \['dice'\] .* lists only \['gcd', 'lcm', 'syllogism'\]"):
        task_index(NAMES, ["gcd", "dice"])
