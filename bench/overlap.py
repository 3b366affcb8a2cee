"""Overlapped rollouts on add3: generation beside the update (`model.rollouts.max_staleness` 1 and 2) against the serial
loop.

    python -m bench.overlap --seeds 3 --more-seeds 5   # 400 steps; serial and overlap1 at 5 paired seeds, the
                                                       # others at 3: 16 runs, one at a time
    python -m bench.overlap --quick    # every row at 6 steps, 1 seed, 64 held-out items, the reward scored in the
                                       # trainer's process: checks the script (CI)

The vLLM engine (CPU backend) runs in its own processes, every thread of theirs bound to core 1 (its compute threads
by VLLM_CPU_OMP_THREADS_BIND, the rest by `PinEngine`); the trainer, its reward process with it, is bound to core 0
(taskset, one thread). Rows, each `python cli.py fit` of configs/add3.yaml (LoGRA rank 16,
its total KL budget) with the engine added:

- `serial`: the vLLM engine, max_staleness 0: generate, score, train, sync, generate again;
- `overlap1`, `overlap2`: the same with max_staleness 1 and 2: the engine generates the next batches while the
  trainer computes the update;
- `inprocess`: the shipped config as it is, generating with the policy itself on both cores (two threads): what the
  split into a trainer core and an engine core costs or saves;
- `server_overlap1`, `server_in_flight1` (not run by default): max_staleness 1 with a vLLM server the run launches
  (`RemoteEngine`, `lightning-logra serve`) instead of the engine in the trainer's processes, its updates drained
  (each after the generation before it) or in flight (merged between decoding steps of the generation under way).

Paired seeds: seed s gives every row the same prompts, sampling seeds and projections. Reported per row: seconds per
step (the median of `train/step_s` after the first 10 steps; its ratio to serial's, paired per seed), the training's
wall time, CPU seconds of the trainer's process and of the engine's processes (`ProcessTimes`, over the training: the
split held if the trainer's CPU time stays near its wall time and the engine's is its own core's), where a step's time
went (`train/wait_s`, `train/score_s`, `train/update_s`), greedy pass@1 on the held-out set after the last step and
the sampled reward over the last tenth of the steps, each with its paired difference from serial (mean ± standard
error over seeds). What counts as a gain: overlap1 at least 1.3× faster per step, with a pass@1 difference of at
least −0.03 at one standard error.
JSON, table and plot under bench/out/overlap/.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import yaml

from bench.lib import grid
from bench.lib.configs import set_model
from bench.lib.plotting import pyplot, save_figure
from bench.lib.runs import ROOT, add_reward_option

BASE_CONFIG = ROOT / "configs" / "add3.yaml"
# max_staleness (None: the in-process engine); the rows named server_* generate on a launched engine server
ROWS = {"serial": 0, "overlap1": 1, "overlap2": 2, "inprocess": None, "server_overlap1": 1, "server_in_flight1": 1}
DEFAULT_ROWS = ["serial", "overlap1", "overlap2", "inprocess"]
TRAINER_CORE, ENGINE_CORE = 0, 1
WARMUP = 10  # steps left out of the median step time (the engine's and the reward process's first calls)
# ProcessTimes and PinEngine, which the runs' CLI loads (`python cli.py` puts the repository on its sys.path)
CALLBACKS = "bench.lib.engine_callbacks"
ENGINE = {"class_path": "lightning_logra.rollout.VLLMEngine",
          "init_args": {"dtype": "float32", "gpu_memory_utilization": 0.1, "separate_process": True}}
SERVER = {"class_path": "lightning_logra.rollout.RemoteEngine",
          "init_args": {"launch": 1, "serve_args": ["--dtype", "float32", "--gpu-memory-utilization", "0.1"]}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--eval-limit", type=int, default=None, help="held-out items (default: all 2,054)")
    parser.add_argument("--rows", nargs="+", default=DEFAULT_ROWS, choices=list(ROWS))
    parser.add_argument("--more-seeds", type=int, default=None,
                        help="seeds of serial and overlap1, the pair the targets are about (default: --seeds)")
    parser.add_argument("--quick", action="store_true",
                        help="6 steps, 1 seed, 64 held-out items, --reward-in-trainer")
    add_reward_option(parser)
    folder = ROOT / "bench" / "out" / "overlap"
    grid.add_options(parser, folder / "overlap.json", folder / "runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.eval_limit, args.reward_in_trainer = 6, 1, 64, True
    return args


def run_config(run: dict, args: argparse.Namespace) -> dict:
    """add3.yaml for `args.steps` steps at the run's seed, with the vLLM engine and its weight sync (but for
    `inprocess`), and ProcessTimes."""
    config = yaml.safe_load(BASE_CONFIG.read_text())
    trainer = config["trainer"]
    budget = [c for c in trainer["callbacks"] if c["class_path"].endswith("PredictedKLBudget")]
    for callback in budget:  # the config's total over its own steps: the same per step over these
        callback["init_args"]["total_budget"] *= args.steps / trainer["max_steps"]
    trainer["callbacks"] = budget + [{"class_path": f"{CALLBACKS}.ProcessTimes",
                                      "init_args": {"path": str(times_path(run, args))}}]
    grid.as_run(config, run, args)
    if args.reward_in_trainer:
        set_model(config, "scoring.timeout_s", None)
    trainer["strategy"]["init_args"]["sketch"]["seed"] = run["seed"]
    if run["max_staleness"] is not None:
        engine = ENGINE
        if run["row"].startswith("server"):
            engine = {**SERVER, "init_args": {**SERVER["init_args"], "in_flight": "in_flight" in run["row"]}}
        set_model(config, "rollouts.engine", engine)
        set_model(config, "rollouts.max_staleness", run["max_staleness"])
        trainer["callbacks"] += [{"class_path": "lightning_logra.callbacks.RolloutWeightSync"},
                                 {"class_path": f"{CALLBACKS}.PinEngine", "init_args": {"core": ENGINE_CORE}}]
    return config


def times_path(run: dict, args: argparse.Namespace) -> Path:
    return args.runs_dir / "times" / f"{run['name']}.json"


def command(run: dict, args: argparse.Namespace) -> list[str]:
    cli = grid.cli(run_config(run, args), args.runs_dir, run["name"])
    if run["max_staleness"] is None:  # the in-process engine: both cores, two threads
        return ["env", "OMP_NUM_THREADS=2", *cli]
    return ["env", f"VLLM_CPU_OMP_THREADS_BIND={ENGINE_CORE}", "OMP_NUM_THREADS=1", "taskset", "-c",
            str(TRAINER_CORE), *cli]


def finished(run: dict, args: argparse.Namespace) -> bool:
    """With --reuse: the run's config is unchanged and it wrote its times (at its last step)."""
    if not args.reuse or not times_path(run, args).exists():
        return False
    return grid.finished(args.runs_dir, run["name"], run_config(run, args))


def measure(run: dict, args: argparse.Namespace) -> dict:
    values = grid.read(args.runs_dir, run["name"])
    steps = values["train/step_s"][WARMUP:] or values["train/step_s"]
    tenth = grid.tenth(values["train/reward_mean"])
    times = json.loads(times_path(run, args).read_text())

    def mean(key: str) -> float:
        return statistics.fmean(values[key][WARMUP:] or values[key])

    return {**run, "step_s": statistics.median(steps), "wall_s": times["wall"], "trainer_cpu_s": times["trainer"],
            "engine_cpu_s": times["engine"], "wait_s": mean("train/wait_s"), "score_s": mean("train/score_s"),
            "update_s": mean("train/update_s"), "pass_at_1": values["val/pass@1"][-1],
            "reward_last": statistics.fmean(values["train/reward_mean"][-tenth:]),
            "rewards": values["train/reward_mean"]}


def summarize(measured: dict[str, list[dict]]) -> dict[str, dict]:
    """Per row: means ± s.e. over seeds, and the paired ratios and differences to serial's run of the same seed."""
    serial = measured.get("serial", [])
    summary = {}
    for row, results in measured.items():
        entry = {"seeds": len(results)}
        entry |= grid.over_seeds(results, ("step_s", "wall_s", "trainer_cpu_s", "engine_cpu_s", "wait_s", "score_s",
                                           "update_s", "pass_at_1", "reward_last"), spread=grid.mean_se)
        paired = grid.paired(results, serial)
        if paired:
            ratios = [s["step_s"] / r["step_s"] for r, s in paired]
            entry["speedup_median"] = statistics.median(ratios)
            entry["speedup"] = grid.mean_se(ratios)
            entry["pass_vs_serial"] = grid.mean_se(grid.differences(results, serial, "pass_at_1"))
            entry["reward_vs_serial"] = grid.mean_se(grid.differences(results, serial, "reward_last"))
        summary[row] = entry
    return summary


def table(summary: dict[str, dict], args: argparse.Namespace) -> str:
    rows = []
    for row, e in summary.items():
        speed = f"{e['speedup_median']:.2f}×" if "speedup_median" in e else "—"
        versus = [grid.pm(e[k]) if k in e else "—" for k in ("pass_vs_serial", "reward_vs_serial")]
        seconds = [grid.pm(e[k], 0) for k in ("wall_s", "trainer_cpu_s", "engine_cpu_s")]
        parts = [grid.pm(e[k]) for k in ("wait_s", "score_s", "update_s")]
        rows.append([row, str(e["seeds"]), grid.pm(e["step_s"]), speed, *seconds, *parts, grid.pm(e["pass_at_1"]),
                     versus[0], grid.pm(e["reward_last"]), versus[1]])
    header = ["row", "seeds", "s/step (median)", "speed-up vs serial (median of paired)", "wall s", "trainer CPU s",
              "engine CPU s", "wait s", "score s", "update s", "greedy pass@1", "vs serial", "reward, last tenth",
              "vs serial"]
    return "\n".join([f"add3, {args.steps} steps, mean ± s.e. over paired seeds; trainer on core 0, vLLM engine on "
                      "core 1 (inprocess: both cores)", "", *grid.markdown(header, rows)])


def plot(measured: dict[str, list[dict]], summary: dict[str, dict], args: argparse.Namespace) -> None:
    plt = pyplot()
    fig, (time_axis, reward_axis) = plt.subplots(1, 2, figsize=(14, 5.5))
    rows = list(summary)
    parts = ("wait_s", "score_s", "update_s")
    bottom = [0.0] * len(rows)
    for part in parts:
        heights = [summary[row][part][0] for row in rows]
        time_axis.bar(rows, heights, bottom=bottom, label=part.removesuffix("_s"))
        bottom = [b + h for b, h in zip(bottom, heights)]
    time_axis.plot(rows, [summary[row]["step_s"][0] for row in rows], "ko", label="step (median)")
    time_axis.set(ylabel="seconds per step (mean after warm-up)", title="where a step goes")
    time_axis.legend()
    window = max(1, args.steps // 20)
    for row, results in measured.items():
        smooth = grid.moving_mean(grid.mean_curve([r["rewards"] for r in results]), window)
        reward_axis.plot(range(1, len(smooth) + 1), smooth,
                         label=f"{row} (pass@1 {summary[row]['pass_at_1'][0]:.3f})")
    reward_axis.set(xlabel="step", ylabel=f"sampled reward ({window}-step moving mean)", title="learning")
    reward_axis.legend()
    save_figure(fig, "overlapped rollouts on add3, mean over paired seeds", args.plot)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    (args.runs_dir / "times").mkdir(exist_ok=True)
    seeds = {row: args.more_seeds if row in ("serial", "overlap1") and args.more_seeds else args.seeds
             for row in args.rows}
    runs = [{"row": row, "max_staleness": ROWS[row], "seed": seed, "name": f"{row}_seed{seed}"}
            for seed in range(max(seeds.values())) for row in args.rows if seed < seeds[row]]
    # One at a time: the runs are timed, and each takes both cores
    grid.train(runs, lambda run: command(run, args), parallel=1, keep=lambda run: finished(run, args))
    measured: dict[str, list[dict]] = {}
    for run in runs:
        measured.setdefault(run["row"], []).append(measure(run, args))
    summary = summarize(measured)
    text = table(summary, args)
    print(text)
    grid.write_report(args.out, {"steps": args.steps, "summary": summary, "table": text,
                                 "runs": {row: [{k: v for k, v in r.items() if k != "rewards"} for r in results]
                                          for row, results in measured.items()}})
    plot(measured, summary, args)


if __name__ == "__main__":
    main()
