"""Recorded numbers of short runs: each step's loss, gradient norm, reward and step size, and checksums of what the
run did to the weights, read back from a run's TensorBoard log and its export and compared with the numbers
recorded when the run was last known right.

Any numerical change to a path's step (sampling, the engine's weights, the reward, advantages, the loss,
micro-batching, the reduction over ranks, the sketch, the optimizer, the KL control, the merge, the sync) moves at
least one of them, in seconds rather than after a learning run. When a change is intended, rerun the test with
GOLDEN_PRINT=1, check that the new values make sense, and paste them in with the reason in the commit message: never
to make a test pass.
"""

import glob
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

RECORDED = ("train/loss", "train/grad_norm", "train/reward_mean", "kl/q", "kl/alpha")


def scalars(root: Path) -> dict[str, list[float]]:
    """Every scalar of the run logged under `root` (rank 0 writes the log), in step order."""
    events = EventAccumulator(glob.glob(str(Path(root) / "**" / "events.out.tfevents.*"), recursive=True)[0],
                              size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def checksums(start: dict[str, torch.Tensor], end: dict[str, torch.Tensor]) -> dict[str, float]:
    """What a run did to the weights: a weighted sum of every entry's change (sensitive to where the change went)
    and the norm of the whole change, in float64, over the tensors of the model's files (`start`; a state dict's
    second name for a tied head is left out). `start` is taken in `end`'s dtypes (a bf16 run trains the model files'
    fp32 weights rounded to bf16)."""
    delta_sum = delta_sq = 0.0
    for name in sorted(set(start) & set(end)):
        delta = end[name].double() - start[name].to(end[name].dtype).double()
        weights = torch.arange(1, delta.numel() + 1, dtype=torch.float64).view_as(delta) / delta.numel()
        delta_sum += float((delta * weights).sum())
        delta_sq += float((delta**2).sum())
    return {"delta_weighted_sum": delta_sum, "delta_norm": delta_sq**0.5}


def logged_steps(root: Path, keys: tuple[str, ...] = RECORDED) -> list[dict[str, float]]:
    """Each step's recorded metrics (those of `keys` the run logs) from the TensorBoard log under `root`."""
    logged = scalars(root)
    return [{key: logged[key][step] for key in keys if key in logged} for step in range(len(logged["train/loss"]))]


def observe(root: Path, model: str | Path, export: Path, keys: tuple[str, ...] = RECORDED) -> dict:
    """The recorded numbers of a run logged under `root` that started from the model folder `model` and exported
    its weights to the folder `export`."""
    start = load_file(Path(model) / "model.safetensors")
    return {"steps": logged_steps(root, keys), **checksums(start, load_file(Path(export) / "model.safetensors"))}


def cpu_kernels() -> str:
    """The kind of CPU kernels torch runs here, as far as they round bf16 products differently: torch's capability
    ("AVX2", "AVX512"), with "+bf16" where the CPU has AVX-512's bf16 instructions (oneDNN computes with them) and
    "+AMX" where it also has AMX's bf16 tiles (oneDNN takes those instead, and rounds differently again)."""
    capability = torch.backends.cpu.get_cpu_capability()
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    if not capability.startswith("AVX512") or "avx512_bf16" not in flags:
        return capability
    return capability + "+bf16" + ("+AMX" if "amx_bf16" in flags else "")


def for_these_kernels(recorded: dict[str, dict]) -> dict:
    """The numbers recorded on machines with this one's kernels (a bf16 path's); none recorded for them: a failure
    that says how to record them."""
    kernels = cpu_kernels()
    if kernels not in recorded:
        pytest.fail(f"no numbers recorded for {kernels} kernels (only for {', '.join(recorded)}): record them with "
                    "GOLDEN_PRINT=1 from a commit whose step reproduces the recorded ones on those machines")
    return recorded[kernels]


def assert_matches(name: str, observed: dict, expected: dict) -> None:
    """`observed` (as `observe` gives it) equals the numbers recorded for `name`; with GOLDEN_PRINT set, printed
    first for recording.

    Tolerances: other thread counts, kernels and library versions sum in other orders (1e-7 to 1e-6 relative in the
    losses and norms); a change to the step itself moves these numbers by 1e-3 or more. The weighted sum adds every
    entry's change with its own sign, so it cancels, and Adam's updates (dense and sketch alike) normalize each
    entry's step to about lr whatever its gradient's size: an entry whose gradient is all cancellation moves by a
    different fraction of lr when its sums run in another order. So its bound is a tenth of one full step of one
    entry per update, 0.1·lr·steps (`expected["lr"]`: the run's learning rate); where a change to the step went
    moves it by far more. A bf16 run records its own bound (`expected["sum_tolerance"]`): a sum that lands one
    stochastic-rounding decision the other way moves one entry by a whole bf16 ulp of its weight."""
    if os.environ.get("GOLDEN_PRINT"):
        print(f"\n{name!r}: {observed!r},")
    assert len(observed["steps"]) == len(expected["steps"]), name
    for step, (got, want) in enumerate(zip(observed["steps"], expected["steps"])):
        assert got.keys() == want.keys(), (name, step)
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-9), (name, step, key)
    assert observed["delta_norm"] == pytest.approx(expected["delta_norm"], rel=1e-4), name
    tolerance = expected.get("sum_tolerance", 0.1 * expected["lr"] * len(expected["steps"]))
    assert observed["delta_weighted_sum"] == pytest.approx(expected["delta_weighted_sum"], abs=tolerance), name
