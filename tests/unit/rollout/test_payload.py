"""An engine's check of a weight change before any of it is merged (rollout/payload.py): names, whole shapes,
finite numbers, a projection the model's k allows."""

import math
import re

import pytest
import torch

from lightning_logra.algo.update import Update
from lightning_logra.rollout.payload import tensors_problems, update_problems
from lightning_logra.sketch.update import LowRankDelta

SHAPES = {"q.weight": (6, 4), "norm.weight": (4,)}


def _delta(factor=None, seed=7, distribution="rademacher", in_features=4, matrix=None):
    return LowRankDelta(torch.ones(6, 2) if factor is None else factor, seed, distribution, in_features, None, matrix)


def test_a_well_formed_update_has_no_problem_after_its_round_trip():
    update = Update({"q.weight": _delta()}, {"norm.weight": torch.ones(4)})
    assert update_problems(Update.from_bytes(update.to_bytes()), SHAPES.get) == []
    assert update_problems(Update({"q.weight": _delta(matrix=torch.ones(2, 4))}), SHAPES.get) == []


@pytest.mark.parametrize("delta, problem", [
    (_delta(factor=torch.ones(12, 2)), r"factor has shape \(12, 2\), the model's is \(6, 2\)"),  # was cut to 6 rows
    (_delta(factor=torch.full((6, 2), math.nan)), "factor holds NaN or Inf"),
    (_delta(factor=torch.full((6, 2), math.inf)), "factor holds NaN or Inf"),
    (_delta(in_features=2**40), "in_features 1099511627776, the model's k is 4"),  # was allocated
    (_delta(in_features=8), "in_features 8, the model's k is 4"),
    (_delta(factor=torch.ones(6, 0)), r"rank 0 is outside 1..4"),
    (_delta(distribution="uniform"), "a projection needs an integer seed and a distribution"),
    (_delta(seed=None), "a projection needs an integer seed"),
    (_delta(matrix=torch.ones(2, 5)), r"projection has shape \(2, 5\), the model's is \(2, 4\)"),
    (_delta(factor=torch.ones(6, 2, dtype=torch.int64)), "holds torch.int64"),
])
def test_a_misshapen_or_non_finite_low_rank_change_is_named(delta, problem):
    problems = update_problems(Update({"q.weight": delta}), SHAPES.get)
    assert len(problems) == 1 and problems[0].startswith("'q.weight'")
    assert re.search(problem, problems[0]), problems


def test_unknown_names_broadcasts_and_non_finite_tensors_are_named():
    assert update_problems(Update({"nope.weight": _delta()}), SHAPES.get) == ["'nope.weight' is not a parameter of "
                                                                               "the model"]
    assert update_problems(Update({"norm.weight": _delta()}), SHAPES.get) == ["'norm.weight' is not a matrix of "
                                                                               "the model"]
    dense = {"norm.weight": torch.ones(1), "q.weight": torch.ones(1, 4), "x": torch.ones(2)}  # (1,) broadcast before
    assert tensors_problems(dense, SHAPES.get) == [
        "'norm.weight' has shape (1,), the model's is (4,)", "'q.weight' has shape (1, 4), the model's is (6, 4)",
        "'x' is not a parameter of the model"]
    assert tensors_problems({"norm.weight": torch.tensor([1.0, math.nan, 0.0, 0.0])}, SHAPES.get) == [
        "'norm.weight' holds NaN or Inf"]
