"""The one-shot GPU check: the table users compare and everything this project has not yet measured on a GPU, in one
command of at most 8 minutes on one H100/H200-class GPU (no stage or row starts after 7), with nothing but torch,
transformers, lightning, peft and the project's pure-Python dependencies (no hub: random weights of published
shapes, and the embedded tiny model; no vLLM, except for the last stage, which also needs 2 GPUs and says so when it
is skipped; the peers' packages where installed, `pip install -e .[peers]`).

    python -m bench.gpu_check                                  # one CUDA GPU; writes bench/out/gpu_check.json
    python bench/gpu_check.py                                  # the same
    python -m bench.gpu_check --dry-run --out /tmp/check.json  # the same stages on the CPU, tiny shapes (CI)

Run from the repository's root. The checkout must be importable as installed (`pip install --no-deps
--no-build-isolation -e .` needs no network), or through PYTHONPATH with `lightning_logra/callbacks` linked to
`callbacks/`; the check says so if it is not. The stages that read a config (kl_control, tiny_arith) read it through
the command line's own parser, which needs jsonargparse: without it they are skipped, saying so.

Stages, in order, each in a module of its own under bench/gpu_stages/ (this script runs them and writes the report);
each writes the whole report again (atomically) as soon as it has something, so a run cut short still reports what
it measured, and a stage that fails is recorded with its error while the next one still runs:

  environment    torch / CUDA versions, the GPU, which optional packages are importable
  memory_table   bench.memory with `--device cuda` at the Qwen2.5-1.5B and -7B shapes in bf16: LoGRA (sketch
                 Adam, the paper's; sketch SGD), dense AdamW (fp32 master weights with bf16 autocast, and bf16
                 weights with bf16 moments: at 7B only the latter fits), LoRA; average and peak CUDA memory per GPU
                 and step time, each method in its own subprocess; the paper's figures beside them
  full_load      (below)
  profile        one step per method under torch.profiler at the 1.5B shape: the ops that took the most GPU time,
                 and the time inside the sketch's own ranges (projections x·Aᵀ, contractions δᵀz)
  cuda_tests     the tests that skip without CUDA (files that check `cuda.is_available`), through pytest
  kl_control     how often the predicted-KL control acts (α < α_max) at configs/qwen1_5b.yaml's sketch and
                 PredictedKLBudget settings, on the 1.5B shape with random weights and random rollouts
  peer_table     the optimizers users would pick instead (layer-wise GaLore, APOLLO-Mini, Adafactor, 8-bit AdamW,
                 Fira: bench/lib/peers.py) as rows of the memory table at 1.5B; a peer not installed is a row saying so
  tiny_arith     configs/tiny_arith.yaml trained on the GPU for 50 steps through the command line (`cli.main`),
                 reward at the start and at the end
  full_load      the vLLM engine's full load without vLLM: every parameter of the Qwen2.5-7B shape (bf16, random)
                 handed to another process on the same GPU as CUDA IPC handles (lightning_logra/rollout/handles.py,
                 what a colocated engine's worker opens) and as safetensors bytes in the engine's 512 MiB chunks;
                 seconds per load for each (and the sender's serializing seconds of the bytes path), and the
                 receiver's copies checked against the sender's (fingerprints)
  vllm_colocated configs/tiny_arith_fsdp_vllm.yaml through the CLI on 2 GPUs sharded by FSDP2, with one 2-way
                 tensor-parallel vLLM engine in the trainer's ranks (placement trainer_ranks) asleep during each
                 update: the engine compared with the trainer exactly after every sync, the sampler's log-prob
                 mismatch, step and rollout seconds, device memory. Skipped, saying why, without vLLM (the lent GPU
                 image has none) or with fewer than 2 GPUs; on the CPU (--dry-run) the same without sleep mode

At the end the report is printed as markdown tables. `--dry-run` runs every stage on the CPU at the "tiny" shape
with a few steps: what tests/integration/bench/test_gpu_check.py runs, so that the script keeps working while no
GPU is at hand.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # `python bench/gpu_check.py`, the command a lent device's session is given, runs as `python -m bench.gpu_check`.
    import runpy

    sys.path[0] = str(Path(__file__).resolve().parents[1])
    runpy.run_module("bench.gpu_check", run_name="__main__")
    sys.exit()

import torch  # noqa: E402

from bench.gpu_stages.plan import Plan, Progress, StageSkipped  # noqa: E402

# In the order of what a lent GPU's few minutes are for: the table users compare, the full load, where the step's
# time goes; then the checks. A stage that has not started when the check's time is spent is skipped, saying so.
STAGES = ("environment", "memory_table", "full_load", "profile", "cuda_tests", "kl_control", "peer_table",
          "tiny_arith", "vllm_colocated")


def stage_function(name: str) -> Callable[[Plan, Progress], dict]:
    """The stage `name`: bench/gpu_stages/<name>.py's function of that name, imported when the stage runs, so that a
    stage whose imports fail here is recorded with that error while the others still run."""

    def stage(plan: Plan, progress: Progress) -> dict:
        return getattr(importlib.import_module(f"bench.gpu_stages.{name}"), name)(plan, progress)

    return stage


# ---------------------------------------------------------------- running them, one report


def write_report(report: dict, path: Path) -> None:
    """The whole report, replacing the file atomically: a run killed mid-write leaves the previous version."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as tmp:
        json.dump(report, tmp, indent=2, default=str)
        tmp.write("\n")
    os.replace(tmp.name, path)


def run_stage(name: str, stage: Callable[[Plan, Progress], dict], plan: Plan, report: dict, out: Path) -> None:
    """Run one stage into `report["stages"][name]` and write the report: status ok with its result, or error with
    the exception and its traceback (a stage's failure never stops the next). Partial results of a stage are
    written as it hands them over, with status running."""
    entry = report["stages"][name] = dict(status="running")
    start = time.perf_counter()

    def progress(partial_result: dict) -> None:
        entry.update(result=partial_result, seconds=time.perf_counter() - start)
        write_report(report, out)

    write_report(report, out)
    print(f"[gpu_check] {name} ...", file=sys.stderr, flush=True)
    try:
        if time.monotonic() > plan.ends_at:
            raise StageSkipped(f"not started: the check's {plan.time_s:.0f} s were spent")
        if plan.fail_stage == name:
            raise RuntimeError(f"failure injected into {name} (--fail-stage)")
        entry.update(status="ok", result=stage(plan, progress))
    except StageSkipped as reason:
        entry.update(status="skipped", reason=str(reason))
    except Exception as error:  # noqa: BLE001 — any failure is recorded and the next stage runs
        entry.update(status="error", error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc()[-4000:])
    finally:
        entry["seconds"] = time.perf_counter() - start
        gc.collect()  # what an in-process stage left (a model, its optimizer) is not the next stage's memory
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        write_report(report, out)
    print(f"[gpu_check] {name}: {entry['status']} ({entry['seconds']:.0f} s)", file=sys.stderr, flush=True)


def summary(name: str, entry: dict) -> str:
    """One line per stage for the table."""
    if entry["status"] == "skipped":
        return entry["reason"]
    if entry["status"] != "ok":
        return entry.get("error", entry["status"]).splitlines()[0][:160]
    result = entry["result"]
    if name == "environment":
        gpu = f"{result['gpu']}, {result['gpu_memory_gib']:.0f} GiB" if result.get("gpu") else "no GPU"
        return f"torch {result['torch']}, CUDA {result['cuda']}, {gpu}"
    if name == "cuda_tests":
        return ", ".join(f"{result[key]} {key}" for key in ("passed", "failed", "error", "skipped")) + \
            f" (exit code {result['exit_code']})"
    if name in ("memory_table", "peer_table", "profile"):
        return f"{sum('error' not in row for row in result['rows'])}/{len(result['rows'])} rows measured"
    if name == "kl_control":
        share = result.get("kl_share", {}).get("share", float("nan"))
        return (f"α < α_max on {result.get('acting_rate', float('nan')):.0%} of {len(result['steps'])} steps; "
                f"the check's share of a step at the config's batch {share:.1%}")
    if name == "full_load":
        rows = {row["path"]: row for row in result["rows"]}
        return (f"{result['shape']}, {result['tensor_bytes'] / 1e9:.2f} GB: bytes {rows['bytes']['seconds']:.2f} s, "
                f"handles {rows['shared']['seconds']:.2f} s (×{result['shared_vs_bytes_seconds']:.2f}); max "
                f"fingerprint diff {max(row['max_abs_diff'] for row in rows.values()):.3g}")
    if name == "vllm_colocated":
        return (f"{result['steps']} steps in {result['seconds']:.0f} s (step {result['step_s']:.2f} s, rollout "
                f"{result['rollout_s']:.2f} s, sync {result['sync_s']:.3f} s); engine vs trainer "
                f"{result['max_abs_diff']:.3g}, log-prob mismatch {result['logprob_abs_diff']:.2g}")
    if name == "tiny_arith":
        return (f"{result['steps']} steps in {result['seconds']:.0f} s, reward {result['reward_first']:.3f} → "
                f"{result['reward_last']:.3f}")
    return ""


def markdown(report: dict) -> str:
    lines = ["| stage | status | seconds | result |", "|---|---|---:|---|"]
    for name, entry in report["stages"].items():
        lines.append(f"| {name} | {entry['status']} | {entry.get('seconds', 0):.0f} | {summary(name, entry)} |")
    rows = [row for stage in ("memory_table", "peer_table")
            for row in report["stages"].get(stage, {}).get("result", {}).get("rows", [])]
    if rows:
        lines += ["", "| shape | method | weights | avg GiB | peak GiB | median step s | paper avg / peak GiB |",
                  "|---|---|---|---:|---:|---:|---:|"]
        for row in rows:
            paper = f"{row['paper_avg_gib']} / {row['paper_peak_gib']}" if "paper_avg_gib" in row else ""
            if "error" in row:
                lines.append(f"| {row['shape']} | {row['method']} | error: {row['error']} | | | | {paper} |")
            else:
                lines.append(f"| {row['shape']} | {row['method']} | {row['weights']} | {row['avg_gib']:.2f} "
                             f"| {row['peak_gib']:.2f} | {row['step_s']:.2f} | {paper} |")
    profiled = [row for row in report["stages"].get("profile", {}).get("result", {}).get("rows", [])
                if "profile" in row]
    if profiled:
        lines += ["", "| method | profiled step s | in the sketch's ranges s | the three ops that took longest (s) |",
                  "|---|---:|---:|---|"]
        for row in profiled:
            found = row["profile"]
            sketch = sum(entry["s"] for entry in found["sketch"])
            top = ", ".join(f"{op['op']} {op['self_s']:.3f}" for op in found["top_ops"][:3])
            lines.append(f"| {row['method']} | {found['step_s']:.2f} | {sketch:.3f} | {top} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_check.json"))
    parser.add_argument("--dry-run", action="store_true", help="every stage on the CPU at the tiny shape (CI)")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated, from " + ", ".join(STAGES))
    # For tests/integration/bench/test_gpu_check.py: the named stage raises instead of running; the others must still
    # run.
    parser.add_argument("--fail-stage", choices=STAGES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.stages = args.stages.split(",")
    unknown = sorted(set(args.stages) - set(STAGES))
    if unknown:
        parser.error(f"unknown stages {unknown}; choose from {', '.join(STAGES)}")
    try:
        importable = importlib.util.find_spec("lightning_logra.callbacks") is not None
    except ModuleNotFoundError:  # lightning_logra itself is not
        importable = False
    if not importable:
        parser.error("lightning_logra.callbacks is not importable: install this checkout (pip install --no-deps "
                     "--no-build-isolation -e .), or run with PYTHONPATH=<this checkout> and its callbacks/ folder "
                     "linked into the package (ln -s ../callbacks lightning_logra/callbacks)")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("torch sees no CUDA device (torch.cuda.is_available() is False): run on a GPU machine, or "
                     "pass --dry-run for the CPU version of every stage")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    plan = Plan.dry() if args.dry_run else Plan.gpu()
    plan.fail_stage = args.fail_stage
    plan.ends_at = time.monotonic() + plan.time_s
    report = dict(dry_run=args.dry_run, plan=asdict(plan), stages={})
    for name in args.stages:
        run_stage(name, stage_function(name), plan, report, args.out)
    print(markdown(report))
    print(f"wrote {args.out}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
