"""Training runs through the CLI for the benchmarks: subprocesses a few at a time, and their TensorBoard scalars."""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository


def cli_command(config: str, steps: int, runs_dir: Path, name: str, *overrides: str) -> list[str]:
    """`python cli.py fit` of a shipped config for `steps` steps, logging to runs_dir/name."""
    return [
        sys.executable, str(ROOT / "cli.py"), "fit", "--config", str(ROOT / "configs" / config),
        "--trainer.max_steps", str(steps),
        "--trainer.val_check_interval", str(steps),
        "--trainer.enable_progress_bar", "false",
        "--trainer.logger.init_args.save_dir", str(runs_dir),
        "--trainer.logger.init_args.name", name,
        *overrides,
    ]


def add_reward_option(parser: argparse.ArgumentParser) -> None:
    """--reward-in-trainer, for a benchmark whose runs take it (their --quick turns it on)."""
    parser.add_argument("--reward-in-trainer", action="store_true",
                        help="score the reward in the trainer's process (model.scoring.timeout_s: null), not in a "
                             "reward process of its own, whose start (an interpreter re-importing the CLI) is about 5 "
                             "s of a run")


def scalars(log_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def latest_run(runs_dir: Path, name: str) -> Path:
    return Path(sorted(glob.glob(str(runs_dir / name / "version_*")))[-1])


def run_all(runs: list[dict], command: Callable[[dict], list[str]], parallel: int, threads: int = 1) -> list[dict]:
    """Run `command(run)` for every run, `parallel` at a time with `threads` intra-op threads each.

    Returns, in the runs' order, each run with "minutes" (wall time) and, if it failed, "error" (its last line of
    stderr). Runs sharing the 2 cores slow each other: time them with `parallel=1`.
    """
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    pending, active, done = list(runs), [], []
    while pending or active:
        while pending and len(active) < parallel:
            run = pending.pop(0)
            print(f"training {run['name']} ...", file=sys.stderr, flush=True)
            # stderr into a file, read at the end: a pipe read only then fills (64 KiB) during a long run's logging
            # and stops the run at its next write
            log = tempfile.TemporaryFile("w+")
            process = subprocess.Popen(command(run), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log,
                                       text=True)
            active.append((run, process, log, time.perf_counter()))
        time.sleep(1.0)
        for item in list(active):
            run, process, log, start = item
            if process.poll() is None:
                continue
            active.remove(item)
            log.seek(0)
            stderr = log.read().strip()
            log.close()
            result = {**run, "minutes": (time.perf_counter() - start) / 60}
            if process.returncode != 0:
                result["error"] = stderr.splitlines()[-1] if stderr else "failed"
            done.append(result)
    order = [r["name"] for r in runs]
    return sorted(done, key=lambda row: order.index(row["name"]))
