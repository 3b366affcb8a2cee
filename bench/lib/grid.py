"""A grid of paired-seed training runs, each `python cli.py` of a config file the benchmark writes: run it a few at a
time, resume it, read it back, and summarize its rows over seeds (bench.quality, bench.frontier, bench.overlap and
bench.recipe).

A benchmark names its runs (dicts with at least "name", "row" and "seed") and builds each one's config; the rest is
here. The config is written beside the runs, so that a rerun with --reuse can compare it with the one it would write
now and train only what an interruption, or a change to some rows, left undone. Seed s of every row shares its
prompts, sampling noise and projections: a row's difference from another taken seed by seed is free of them, which
is why the paired differences below pair by seed.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from bench.lib.configs import set_model
from bench.lib.runs import ROOT, latest_run, run_all, scalars

# ---- the command line and the report --------------------------------------------------------------------------------

def add_options(parser: argparse.ArgumentParser, out: Path, runs_dir: Path) -> None:
    """--reuse, and where the JSON report (`out`), its plot (`out` as .png) and the runs (`runs_dir`) go."""
    parser.add_argument("--reuse", action="store_true",
                        help="measure, not rerun, every run whose config is unchanged in --runs-dir and that finished "
                             "(a rerun after an interruption or a change to some rows)")
    parser.add_argument("--out", type=Path, default=out)
    parser.add_argument("--plot", type=Path, default=out.with_suffix(".png"))
    parser.add_argument("--runs-dir", type=Path, default=runs_dir)


def chosen_rows(value: str, rows: tuple[str, ...]) -> list[str]:
    """--rows as a list: comma-separated names, each one of `rows` (an unknown one stops the tool, naming it)."""
    chosen = [row for row in value.split(",") if row]
    unknown = sorted(set(chosen) - set(rows))
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; choose from {', '.join(rows)}")
    return chosen


def positive(args: argparse.Namespace, *keys: str) -> None:
    """Stops with the option's name if any of `keys` (argparse's names) is below 1."""
    for key in keys:
        if getattr(args, key) < 1:
            raise SystemExit(f"--{key.replace('_', '-')} must be positive, got {getattr(args, key)}")


def arguments(args: argparse.Namespace) -> dict:
    """The command line's settings as the JSON report keeps them (paths as strings)."""
    return {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}


def write_report(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


# ---- running the grid -----------------------------------------------------------------------------------------------

def as_run(config: dict, run: dict, args: argparse.Namespace, evals: int = 1) -> dict:
    """A shipped config (parsed) made into one run of the grid, in place: the run's seed for Lightning, the prompts
    and the sampling alike (paired seeds), `args.steps` steps with `evals` validations (the last at the end), logged
    to args.runs_dir/<the run's name>, no checkpoints or progress bar, and `args.eval_limit` held-out items (None:
    the config's)."""
    trainer, data = config["trainer"], config["data"]["init_args"]
    config["seed_everything"] = data["seed"] = run["seed"]
    set_model(config, "sampling.seed", run["seed"])
    trainer.update(max_steps=args.steps, val_check_interval=args.steps // evals, enable_checkpointing=False,
                   enable_progress_bar=False)
    trainer["logger"]["init_args"].update(save_dir=str(args.runs_dir), name=run["name"])
    if args.eval_limit is not None:
        data["eval_limit"] = args.eval_limit
    return config


def _config_path(runs_dir: Path, name: str) -> Path:
    return runs_dir / "configs" / f"{name}.yaml"


def cli(config: dict, runs_dir: Path, name: str, verb: str = "fit") -> list[str]:
    """`python cli.py <verb>` of `config`, written first to runs_dir/configs/<name>.yaml: the file the run reads, kept
    for `finished` to compare a rerun's config with."""
    path = _config_path(runs_dir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    return [sys.executable, str(ROOT / "cli.py"), verb, "--config", str(path)]


def finished(runs_dir: Path, name: str, config: dict | None, evaluations: int | None = None) -> bool:
    """Whether a rerun may keep run `name` rather than train it again: its config file is `config`, the one it would
    be written now (None: whatever it is), and, unless `evaluations` is None, its latest log holds that many
    `val/pass@1` (a run cut off part-way holds fewer)."""
    path = _config_path(runs_dir, name)
    if not path.exists():
        return False
    if config is not None and yaml.safe_load(path.read_text()) != config:
        return False
    if evaluations is None:
        return True
    if not glob.glob(str(runs_dir / name / "version_*")):
        return False
    return len(read(runs_dir, name).get("val/pass@1", [])) == evaluations


def train(runs: list[dict], command: Callable[[dict], list[str]], parallel: int,
          keep: Callable[[dict], bool] | None = None) -> list[dict]:
    """Runs `command(run)` for every run that `keep` does not keep (a finished one, with --reuse), `parallel` at a
    time (runs.run_all); stops, naming them, if any failed, since a grid with holes has no paired summary. Returns
    every run in order, those trained now with their "minutes"."""
    todo = [run for run in runs if keep is None or not keep(run)]
    done = {row["name"]: row for row in run_all(todo, command, parallel)}
    failed = [row for row in done.values() if "error" in row]
    if failed:
        raise SystemExit("runs failed: " + "; ".join(f"{row['name']}: {row['error']}" for row in failed))
    return [done.get(run["name"], run) for run in runs]


def read(runs_dir: Path, name: str) -> dict[str, list[float]]:
    """The TensorBoard scalars of run `name`'s latest log: {tag: one value per logged step or evaluation}."""
    return scalars(latest_run(runs_dir, name))


def tenth(values: list[float]) -> int:
    """How many of a run's per-step values its first (or last) tenth holds, at least one: a run's start and end are
    read as the mean over a tenth of its steps, since one step's sampled reward is noise."""
    return max(1, len(values) // 10)


# ---- summarizing it over seeds --------------------------------------------------------------------------------------

def _finite(values: list[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]  # a run that measured no KL, say, has none to average


def mean_std(values: list[float]) -> list[float]:
    """[mean, standard deviation] of the finite values ([nan, nan] if none; one value: spread 0): how far the seeds
    of a row scatter."""
    finite = _finite(values)
    if not finite:
        return [math.nan, math.nan]
    return [statistics.fmean(finite), statistics.stdev(finite) if len(finite) > 1 else 0.0]


def mean_se(values: list[float]) -> list[float]:
    """[mean, standard error of the mean] of the finite values ([nan, nan] if none; one value: 0): for a paired
    difference or ratio, where the question is whether the mean is away from 0 (or 1), not how far seeds scatter."""
    finite = _finite(values)
    if not finite:
        return [math.nan, math.nan]
    return [statistics.fmean(finite), statistics.stdev(finite) / math.sqrt(len(finite)) if len(finite) > 1 else 0.0]


def over_seeds(results: list[dict], keys: tuple[str, ...], spread: Callable = mean_std) -> dict[str, list[float]]:
    """{key: spread of the row's runs' values}, in the order of `keys`."""
    return {key: spread([r[key] for r in results]) for key in keys}


def paired(results: list[dict], reference: list[dict]) -> list[tuple[dict, dict]]:
    """Each run with the reference row's run of the same seed (a seed the reference lacks is left out)."""
    by_seed = {r["seed"]: r for r in reference}
    return [(r, by_seed[r["seed"]]) for r in results if r["seed"] in by_seed]


def differences(results: list[dict], reference: list[dict], key: str) -> list[float]:
    """`key` of each run minus the reference row's on the same seed."""
    return [r[key] - s[key] for r, s in paired(results, reference)]


def pm(pair: list[float], digits: int = 3, scientific: bool = False) -> str:
    """A [mean, spread] pair as a table shows it: `digits` decimals, or 3 significant digits ± 2 (`scientific`, for
    KLs per step, which span decades)."""
    mean, spread = pair
    return f"{mean:.2e} ± {spread:.1e}" if scientific else f"{mean:.{digits}f} ± {spread:.{digits}f}"


def markdown(header: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    """A markdown table's lines: the first `left` columns (names, settings) aligned left, the numbers right. An empty
    cell is one space between its bars (a row that only names a section)."""
    def line(cells: list[str]) -> str:
        return "|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|"

    return [line(header), "|" + "---|" * left + "---:|" * (len(header) - left), *map(line, rows)]


def mean_curve(curves: list[list[float]]) -> list[float]:
    """A row's curve over its seeds: its runs' curves (runs × points, equal lengths) averaged point by point."""
    return [statistics.fmean(points) for points in zip(*curves, strict=True)]


def moving_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value and the `window` − 1 before it (fewer at the start): a per-step curve, smoothed."""
    return [statistics.fmean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]
