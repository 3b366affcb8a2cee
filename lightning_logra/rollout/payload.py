"""What a weight change sent to an engine must be before any of it is merged (the servers' second line of defence:
the trainer skips a non-finite update itself).

Every name must be one of the model's, every shape the whole tensor's (a factor with more rows was cut to the rows a
worker holds; a (1,) tensor broadcast over a whole weight), every number finite and of a dtype the merge takes (fp16,
bf16, fp32, fp64), every whole tensor's numbers within what the weight it is copied into can hold (1e5 in an fp16
weight, 3.4e38 in a bf16 one, would land as Inf), a seeded projection one that `make_projection` draws at the model's
own k (a k of 2⁴⁰ was allocated), and a rounding key one the merge can draw bits from. Checked whole, on every worker,
before the weights' label is touched: a payload with a problem changes nothing. (Whether a merge's result stays finite
depends on the weights: the worker checks that too, `sketch.update.merge_stays_finite`.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_logra.algo.update import Update
from lightning_logra.sketch.projection import DISTRIBUTIONS
from lightning_logra.sketch.rounding import is_rounding_key

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what a merge or a load takes

WholeShape = Callable[[str], "tuple[int, ...] | None"]  # a trainer parameter's whole shape; None: no such parameter
WeightDtype = Callable[[str], "torch.dtype | None"]  # the dtype a parameter is held in here; None: not known


def _tensor_problems(what: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> list[str]:
    if tuple(tensor.shape) != tuple(shape):
        return [f"{what} has shape {tuple(tensor.shape)}, the model's is {tuple(shape)}"]
    if not tensor.is_floating_point():
        return [f"{what} holds {tensor.dtype}, not floating-point numbers"]
    if tensor.dtype not in FLOATS:  # fp8: torch cannot even tell whether it is finite
        return [f"{what} holds {tensor.dtype}: a change is float16, bfloat16, float32 or float64"]
    if not bool(torch.isfinite(tensor).all()):
        return [f"{what} holds NaN or Inf"]
    return []


def _range_problems(what: str, tensor: torch.Tensor, dtype: torch.dtype | None) -> list[str]:
    """Whether the finite `tensor` fits a weight of `dtype` when copied into it: a number past the dtype's largest
    becomes Inf there (one only just past it would round down to the largest; it is refused all the same)."""
    if dtype is None or not dtype.is_floating_point or tensor.numel() == 0:
        return []
    largest = torch.finfo(dtype).max
    if torch.finfo(tensor.dtype).max <= largest:
        return []  # every finite number of the tensor's dtype fits
    flat = tensor.flatten()
    peak = float(flat[flat.abs().argmax()])  # the number of largest magnitude, with its sign
    if abs(peak) > largest:
        return [f"{what} holds {peak:.4g}, past the largest number of the model's {dtype} weight (±{largest:.4g}): it "
                "would land as Inf"]
    return []


def update_problems(update: Update, whole_shape: WholeShape, weight_dtype: WeightDtype | None = None) -> list[str]:
    """What is wrong with `update` for a model whose parameters have `whole_shape`s and are held in `weight_dtype`s
    (None: not checked; a low-rank factor's merge is checked against the weight by the worker) ([] when nothing is)."""
    problems = []
    for name, delta in update.low_rank.items():
        shape = whole_shape(name)
        if shape is None or len(shape) != 2:
            problems.append(f"{name!r} is not a matrix of the model" if shape is not None else
                            f"{name!r} is not a parameter of the model")
            continue
        d, k = shape
        rank = delta.factor.shape[1] if delta.factor.dim() == 2 else 0
        if delta.in_features != k:
            problems.append(f"{name!r}: in_features {delta.in_features}, the model's k is {k}")
        elif not 1 <= rank <= k:
            problems.append(f"{name!r}: rank {rank} is outside 1..{k}")
        elif delta.matrix is None and (delta.distribution not in DISTRIBUTIONS or not isinstance(delta.seed, int)
                                       or isinstance(delta.seed, bool)):
            problems.append(f"{name!r}: a projection needs an integer seed and a distribution of {DISTRIBUTIONS} "
                            f"(got {delta.seed!r}, {delta.distribution!r})")
        elif delta.matrix is not None:
            problems += _tensor_problems(f"{name!r}'s projection", delta.matrix, (rank, k))
        if not (delta.rounding_key is None or is_rounding_key(delta.rounding_key)):
            problems.append(f"{name!r}: rounding key {delta.rounding_key!r} is neither null nor a whole number in "
                            "-2**63..2**63 - 1")
        problems += _tensor_problems(f"{name!r}'s factor", delta.factor, (d, rank))
    return problems + tensors_problems(update.dense, whole_shape, weight_dtype)


def tensors_problems(tensors: dict[str, torch.Tensor], whole_shape: WholeShape,
                     weight_dtype: WeightDtype | None = None) -> list[str]:
    """What is wrong with whole tensors (a dense part of an update, or a full load) for the model, each copied into
    a weight held in `weight_dtype(name)` (None: its range is not checked)."""
    problems = []
    for name, tensor in tensors.items():
        shape = whole_shape(name)
        if shape is None:
            problems.append(f"{name!r} is not a parameter of the model")
            continue
        problems += (_tensor_problems(repr(name), tensor, shape)
                     or _range_problems(repr(name), tensor, None if weight_dtype is None else weight_dtype(name)))
    return problems
