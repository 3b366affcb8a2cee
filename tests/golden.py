"""Recorded numbers of short runs: each step's loss, gradient norm, reward and step size, and checksums of what the
run did to the weights, read back from a run's TensorBoard log and its export and compared with the numbers
recorded when the run was last known right. They are data: a file per path in tests/recorded/ (`<path>.json`, and
`<path>.<kernels>.json` for a path whose numbers depend on the kind of CPU kernels), each naming the test that
records it, when and from which commit.

Any numerical change to a path's step (sampling, the engine's weights, the reward, advantages, the loss,
micro-batching, the reduction over ranks, the sketch, the optimizer, the KL control, the merge, the sync) moves at
least one of them, in seconds rather than after a learning run. When a change of numerics is the intended result,
record the path anew (`python tests/record.py <path>`, which runs its test with `--record <path>`), check that the
new values make sense, and say why in the commit message: never to make a failing test pass (docs/testing.md).
"""

import datetime
import glob
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

RECORDED = ("train/loss", "train/grad_norm", "train/reward_mean", "kl/q", "kl/alpha")
RECORDINGS = Path(__file__).parent / "recorded"
ABOUT = ("test", "recorded", "about")  # a data file's description of itself, beside the numbers
recording: set[str] = set()  # the paths to record anew instead of comparing (conftest: pytest's --record)
record_into: Path | None = None  # where to write them (--record-into; by default over their files in RECORDINGS)


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


class Recorded(dict):
    """A path's recorded numbers as its data file holds them (`steps`, `delta_weighted_sum`, `delta_norm`, `lr` and a
    bf16 path's `sum_tolerance`), with the path's `name`, its `file`, and the file's `test`, `recorded` and `about`
    as attributes."""

    def __init__(self, name: str, file: Path, data: dict) -> None:
        super().__init__({key: value for key, value in data.items() if key not in ABOUT})
        self.name, self.file = name, file
        self.test, self.recorded, self.about = (data.get(key, "") for key in ABOUT)


def recorded(name: str, per_kernels: bool = False) -> Recorded:
    """The numbers recorded for the path `name` (tests/recorded/<name>.json); with `per_kernels` (a bf16 path's:
    its products round by the CPU's kernels), those recorded on machines with this one's kernels
    (<name>.<kernels>.json). None recorded for these kernels: a failure that says how to record them, unless
    `--record` names the path (then the settings of another kind's file, for the recording to fill in)."""
    if not per_kernels:
        file = RECORDINGS / f"{name}.json"
        return Recorded(name, file, json.loads(file.read_text()))
    kernels = cpu_kernels()
    file = RECORDINGS / f"{name}.{kernels}.json"
    if file.exists():
        return Recorded(name, file, json.loads(file.read_text()))
    others = sorted(RECORDINGS.glob(f"{name}.*.json"))
    known = sorted(other.name[len(name) + 1:-len(".json")] for other in others)
    if name not in recording or not others:
        pytest.fail(f"no numbers recorded for {kernels} kernels (only for {', '.join(known)}): record them with "
                    f"`python tests/record.py {name}` from a commit whose step reproduces the recorded ones on those "
                    "machines")
    settings = json.loads(others[0].read_text())
    return Recorded(name, file, {key: settings[key] for key in (*ABOUT, "lr", "sum_tolerance") if key in settings})


def dumps(data: dict) -> str:
    """A data file's text: JSON (floats as Python's repr, so they read back exactly), a step per line."""
    lines = []
    for key, value in data.items():
        if key == "steps":
            steps = ",\n".join(f"    {json.dumps(step)}" for step in value)
            lines.append(f'  "steps": [\n{steps}\n  ]')
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _provenance() -> str:
    """When and from what the numbers are recorded: the date, the commit (and whether the tree differed from it) and
    the CPU kernels."""
    root = Path(__file__).parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        changed = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=root).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        commit, changed = "an unknown commit", False
    return (f"{datetime.date.today()} from {commit}{' with uncommitted changes' if changed else ''}, "
            f"{cpu_kernels()} kernels")


def write(observed: dict, expected: Recorded) -> Path:
    """Writes `observed` (as `observe` gives it) as the numbers of `expected`'s path, keeping the file's settings
    (`lr`, `sum_tolerance`, `about`), into `record_into` or over the path's file."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0] or expected.test
    data = {"test": test, "recorded": _provenance(), "about": expected.about, "lr": expected["lr"],
            **({"sum_tolerance": expected["sum_tolerance"]} if "sum_tolerance" in expected else {}),
            "steps": [{key: step[key] for key in sorted(step, key=_recorded_order)} for step in observed["steps"]],
            "delta_weighted_sum": observed["delta_weighted_sum"], "delta_norm": observed["delta_norm"]}
    file = Path(record_into) / expected.file.name if record_into else expected.file
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(dumps(data))
    return file


def _recorded_order(key: str) -> tuple[int, str]:
    return (RECORDED.index(key) if key in RECORDED else len(RECORDED), key)


def assert_matches(name: str, observed: dict, expected: Recorded) -> None:
    """`observed` (as `observe` gives it) equals the numbers recorded for `name` (`expected`, as `recorded` reads
    them; a run compared with another path's numbers names itself). With `--record` naming `expected`'s path and
    `name` that path (the test that records it), `observed` is written as its numbers instead.

    Tolerances: other thread counts, kernels and library versions sum in other orders (1e-7 to 1e-6 relative in the
    losses and norms); a change to the step itself moves these numbers by 1e-3 or more. The weighted sum adds every
    entry's change with its own sign, so it cancels, and Adam's updates (dense and sketch alike) normalize each
    entry's step to about lr whatever its gradient's size: an entry whose gradient is all cancellation moves by a
    different fraction of lr when its sums run in another order. So its bound is a tenth of one full step of one
    entry per update, 0.1·lr·steps (`expected["lr"]`: the run's learning rate); where a change to the step went
    moves it by far more. A bf16 run records its own bound (`expected["sum_tolerance"]`): a sum that lands one
    stochastic-rounding decision the other way moves one entry by a whole bf16 ulp of its weight."""
    if name == expected.name and name in recording:
        print(f"\nrecorded {name} into {write(observed, expected)}")
        return
    assert len(observed["steps"]) == len(expected["steps"]), name
    for step, (got, want) in enumerate(zip(observed["steps"], expected["steps"])):
        assert got.keys() == want.keys(), (name, step)
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-9), (name, step, key)
    assert observed["delta_norm"] == pytest.approx(expected["delta_norm"], rel=1e-4), name
    tolerance = expected.get("sum_tolerance", 0.1 * expected["lr"] * len(expected["steps"]))
    assert observed["delta_weighted_sum"] == pytest.approx(expected["delta_weighted_sum"], abs=tolerance), name
