"""Against what a user would otherwise run: TRL's GRPOTrainer beside this project's trainer on the same real model,
prompts, reward and recipe.

    python -m bench.frameworks            # every row, 3 seeds, 15 steps (about 2.5 hours alone on 2 cores; --reuse
                                          # keeps the rows already finished after an interruption)
    python -m bench.frameworks --quick    # every row for 2 steps, 1 seed, 2 held-out items per task (checks the
                                          # script; needs the `trl` extra)

The model, tasks and recipe are configs/smollm2_reasoning.yaml's (SmolLM2-135M-Instruct on reasoning-gym's mix, 4
prompts × 8 completions of at most 16 tokens a step at temperature 0.7, `dapo`, gradient clipping at 1.0, fp32).
Rows:
- `trl_full`: TRL's GRPOTrainer on every parameter, AdamW at --dense-lr (bench/lib/trl_grpo.py);
- `trl_lora`: the same with a PEFT LoRA adapter of rank 16 on the seven matrices (q, k, v, o, gate, up, down) at
  --lora-lr;
- `logra`, `dense`, `lora`: this project's trainer (bench/tasks.py's rows): the shipped config (LoGRA sketches at rank
  16 under its total KL budget), dense AdamW (`DenseStrategy`) at --dense-lr, LoRA (`LoRAStrategy`) at --lora-lr, on the
  same seven matrices;
and `start`, the base model. The learning rates are bench/tasks.py's, chosen there so that each row moves about
LoGRA's KL per step. TRL generates with transformers' `generate` (`--generation vllm` tries its vLLM colocate mode),
this project with vLLM's CPU engine in the trainer's process, as the config says.

Every row is evaluated by one code path: this project's validation (`EvaluationSteps`) on the config's held-out items,
8 samples at temperature 0.7, pass@1 and pass@8 per task, and `KLFromStart` on held-out completions: at the end of
fit for this project's rows, by `lightning-logra validate` of the folder TRL saved (its adapter merged) for TRL's, with
the distance measured from the base model (`KLFromStart(start=...)`).

Measured per row the same way: seconds per step (the median over steps) and its parts (generation, scoring, the update
with any KL work, the sync), generated and trained tokens per second, the peak resident memory of the process (sampled
during every step), the training reward's first and last tenth, KL(π‖π₀) at the end, held-out pass@1 and pass@8 per
task. Mean ± standard error over seeds, and paired differences against `trl_full` (the same seed). JSON, markdown and
a plot under bench/out/.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import yaml

from bench import tasks
from bench.lib import grid
from bench.lib.plotting import pyplot, save_figure
from bench.lib.runs import ROOT, run_all

TRL_ROWS = ("trl_full", "trl_lora")
OURS = ("logra", "dense", "lora")
ROWS = (*TRL_ROWS, *OURS)
LABELS = {"start": "base model", "trl_full": "TRL GRPOTrainer, full parameters (AdamW)",
          "trl_lora": "TRL GRPOTrainer, PEFT LoRA rank 16", "logra": "lightning-logra, LoGRA rank 16 (shipped config)",
          "dense": "lightning-logra, dense AdamW", "lora": "lightning-logra, LoRA rank 16"}
METRICS = ("step_s", "generation_s", "score_s", "update_s", "sync_s", "generated_tps", "trained_tps", "peak_gib",
           "completion_length", "reward_first", "reward_last", "kl_from_start")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=15, help="training steps of every row")
    parser.add_argument("--seeds", type=int, default=3, help="paired seeds per row (0, 1, ...)")
    parser.add_argument("--eval-size", type=int, default=32, help="held-out items per task")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from {', '.join(ROWS)}")
    parser.add_argument("--logra-kl", type=float, default=5e-4, help="LoGRA's KL budget per step (bench/tasks.py)")
    parser.add_argument("--dense-lr", type=float, default=1.5e-6, help="trl_full's and dense's AdamW rate")
    parser.add_argument("--lora-lr", type=float, default=4e-5, help="trl_lora's and lora's rate")
    parser.add_argument("--kl-prompts", type=int, default=64, help="held-out prompts of the KL(π‖π₀) measurement")
    parser.add_argument("--generation", choices=("transformers", "vllm"), default="transformers",
                        help="TRL's generation: transformers' generate, or its vLLM colocate mode")
    parser.add_argument("--quick", action="store_true", help="see above")
    grid.add_options(parser, ROOT / "bench" / "out" / "frameworks.json", ROOT / "bench" / "out" / "frameworks_runs")
    args = parser.parse_args(argv)
    args.rows = grid.chosen_rows(args.rows, ROWS)
    if args.quick:
        args.steps, args.seeds, args.eval_size, args.kl_prompts = 2, 1, 2, 2
    grid.positive(args, "steps", "seeds", "eval_size", "kl_prompts")
    return args


def task_names() -> list[str]:
    return [task["name"] for task in yaml.safe_load(tasks.BASE_CONFIG.read_text())["data"]["init_args"]["tasks"]]


# ---- the runs -------------------------------------------------------------------------------------------------------

def our_config(run: dict, args: argparse.Namespace) -> dict:
    """bench/tasks.py's config of the run, with vLLM's engine kept in --quick (the comparison is about it)."""
    quick, args.quick = args.quick, False
    try:
        return tasks.validate_config(run, args) if run["method"] == "start" else tasks.run_config(run, args)
    finally:
        args.quick = quick


def trl_spec(run: dict, args: argparse.Namespace) -> dict:
    """What bench/lib/trl_grpo.py runs: the shipped config's recipe, the row's method and rate, the run's seed."""
    return {"config": our_config({**run, "method": "dense"}, args), "method": run["method"].removeprefix("trl_"),
            "lr": run["lr"], "seed": run["seed"], "steps": args.steps, "generation": args.generation,
            "rank": tasks.RANK, "targets": tasks.TARGETS, "out": str(args.runs_dir / run["name"])}


def evaluation_config(run: dict, args: argparse.Namespace) -> dict:
    """`validate` of the folder TRL saved, as the base model's `start` is validated, its distance measured from the
    base model."""
    config = our_config({**run, "name": f"{run['name']}_eval", "method": "start"}, args)
    base = config["model"]["model"]
    config["model"]["model"] = str(args.runs_dir / run["name"] / "model")
    config["trainer"]["callbacks"].append({"class_path": "lightning_logra.callbacks.KLFromStart",
                                           "init_args": {"prompts": args.kl_prompts, "samples": 4, "start": base}})
    return config


def trl_trained(run: dict, args: argparse.Namespace) -> bool:
    folder = args.runs_dir / run["name"]
    spec = folder / "spec.json"
    return (args.reuse and spec.exists() and json.loads(spec.read_text()) == trl_spec(run, args)
            and (folder / "steps.json").exists() and (folder / "model" / "config.json").exists())


def trl_command(run: dict, args: argparse.Namespace) -> list[str]:
    folder = args.runs_dir / run["name"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spec.json").write_text(json.dumps(trl_spec(run, args)))
    return [sys.executable, "-m", "bench.lib.trl_grpo", str(folder / "spec.json")]


def runs_of(args: argparse.Namespace) -> list[dict]:
    lrs = {"trl_full": args.dense_lr, "trl_lora": args.lora_lr, "logra": None, "dense": args.dense_lr,
           "lora": args.lora_lr}
    runs = [{"name": "start", "row": "start", "method": "start", "seed": 0}]
    for seed in range(args.seeds):  # seed by seed: an interrupted grid has whole seeds to pair
        runs += [{"name": f"{row}_seed{seed}", "row": row, "method": row, "lr": lrs[row], "seed": seed}
                 for row in args.rows]
    return runs


def run(runs: list[dict], args: argparse.Namespace) -> None:
    """Every run not kept, one at a time with both cores: TRL's training, then every validation."""
    ours = [r for r in runs if r["row"] not in TRL_ROWS]
    theirs = [r for r in runs if r["row"] in TRL_ROWS]
    steps = [
        ([r for r in theirs if not trl_trained(r, args)], lambda r: trl_command(r, args)),
        ([r for r in ours if not (args.reuse and grid.finished(args.runs_dir, r["name"], our_config(r, args), 1))],
         lambda r: grid.cli(our_config(r, args), args.runs_dir, r["name"],
                            "validate" if r["method"] == "start" else "fit")),
        ([r for r in theirs if not (args.reuse and grid.finished(args.runs_dir, f"{r['name']}_eval",
                                                                 evaluation_config(r, args), 1))],
         lambda r: grid.cli(evaluation_config(r, args), args.runs_dir, f"{r['name']}_eval", "validate")),
    ]
    for todo, command in steps:
        failed = [r for r in run_all(todo, command, parallel=1, threads=2) if "error" in r]
        if failed:
            raise SystemExit("runs failed: " + "; ".join(f"{r['name']}: {r['error']}" for r in failed))


# ---- what a run measured --------------------------------------------------------------------------------------------

def median(values: list[float]) -> float:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def measure(run: dict, args: argparse.Namespace, names: list[str]) -> dict:
    if run["row"] in TRL_ROWS:
        values = grid.read(args.runs_dir, f"{run['name']}_eval")
        steps = json.loads((args.runs_dir / run["name"] / "steps.json").read_text())
        rewards = [s["reward"] for s in steps]
        config = our_config({**run, "method": "dense"}, args)
        completions = config["data"]["init_args"]["batch_size"] * config["model"]["sampling"]["num_generations"]
        tokens = [b["num_tokens"] - a["num_tokens"] for a, b in zip([{"num_tokens": 0}, *steps], steps)]
        measured = {"step_s": median([s["step_s"] for s in steps]),
                    "generation_s": median([s["generation_s"] for s in steps]),
                    "score_s": median([s["score_s"] for s in steps]),
                    "update_s": median([s["update_s"] for s in steps]),
                    "sync_s": 0.0,  # generation reads the trained weights themselves
                    "generated_tps": median([s["completion_length"] * completions / s["step_s"] for s in steps]),
                    "trained_tps": median([t / s["step_s"] for t, s in zip(tokens, steps)]),
                    "peak_gib": max(s["peak_gib"] for s in steps),
                    "completion_length": median([s["completion_length"] for s in steps])}
    else:
        values = grid.read(args.runs_dir, run["name"])
        if run["method"] == "start":
            return {**run, "validation": tasks.per_task(values, names)}
        rewards = values["train/reward_mean"]
        measured = {"step_s": median(values["train/step_s"]), "generation_s": median(values["train/wait_s"]),
                    "score_s": median(values["train/score_s"]), "update_s": median(values["train/update_s"]),
                    "sync_s": median(values.get("train/sync_s", [])),
                    "generated_tps": median(values["perf/generated_tokens_per_s"]),
                    "trained_tps": median(values["perf/trained_tokens_per_s"]),
                    "peak_gib": max(values["memory/peak_gib"]),
                    "completion_length": median(values["completions/mean_length"])}
    tenth = grid.tenth(rewards)
    return {**run, **measured, "validation": tasks.per_task(values, names), "rewards": rewards,
            "reward_first": statistics.fmean(rewards[:tenth]), "reward_last": statistics.fmean(rewards[-tenth:]),
            "kl_from_start": tasks.last(values, "val/kl_from_start")}


def summarize(results: list[dict], names: list[str]) -> dict[str, dict]:
    """Per row: mean ± standard error over seeds, and (for rows other than TRL's full one) the paired difference
    against trl_full on the same seeds."""
    reference = [r for r in results if r["row"] == "trl_full"]
    summary = {}
    for row in ["start", *ROWS]:
        rows = [r for r in results if r["row"] == row]
        if not rows:
            continue
        keys = [f"{task}/{k}" for task in ["all", *names] for k in ("pass@1", "pass@8")]
        for r in rows:
            r.update({key: r["validation"][key.split("/")[0]][key.split("/")[1]] for key in keys})
        entry = {"label": LABELS[row], "seeds": len(rows), "lr": rows[0].get("lr")}
        entry |= grid.over_seeds(rows, tuple(keys if row == "start" else [*keys, *METRICS]), grid.mean_se)
        if row not in ("start", "trl_full") and reference:
            entry["vs_trl_full"] = {key: grid.mean_se(grid.differences(rows, reference, key))
                                    for key in ("all/pass@1", "all/pass@8", "reward_last", "kl_from_start")}
            entry["vs_trl_full"] |= {f"{key}_ratio": grid.mean_se([r[key] / s[key] for r, s in grid.paired(
                rows, reference)]) for key in ("step_s", "peak_gib")}
        summary[row] = entry
    return summary


def tables(summary: dict[str, dict], names: list[str]) -> dict[str, dict]:
    """The three tables (cost, held-out quality, paired against trl_full) as docs/results/data holds tables: columns,
    alignment and rows of cells as printed (scripts/results_tables.py writes them into docs/results/frameworks.md)."""
    trained = [row for row in summary if row != "start"]
    cost = [[summary[row]["label"], grid.pm(summary[row]["step_s"], 1), grid.pm(summary[row]["generation_s"], 1),
             grid.pm(summary[row]["update_s"], 1), grid.pm(summary[row]["generated_tps"], 1),
             grid.pm(summary[row]["trained_tps"], 0), grid.pm(summary[row]["peak_gib"], 2),
             grid.pm(summary[row]["completion_length"], 1)] for row in trained]
    quality = [[summary[row]["label"], *(grid.pm(summary[row][f"{task}/{k}"]) for task in ["all", *names]
                                         for k in ("pass@1", "pass@8"))]
               + ([grid.pm(summary[row]["reward_first"]), grid.pm(summary[row]["reward_last"]),
                   grid.pm(summary[row]["kl_from_start"], scientific=True)] if row != "start" else ["", "", ""])
               for row in summary]
    paired = [[summary[row]["label"], grid.pm(e["step_s_ratio"], 2), grid.pm(e["peak_gib_ratio"], 2),
               grid.pm(e["all/pass@1"]), grid.pm(e["all/pass@8"]), grid.pm(e["reward_last"])]
              for row in trained if (e := summary[row].get("vs_trl_full"))]
    headers = {
        "frameworks_cost": ["row", "s / step", "generation s", "update s", "generated tok/s", "trained tok/s",
                            "peak GiB", "completion tokens"],
        "frameworks_quality": ["row", *(f"{task} {k}" for task in ["all", *names] for k in ("pass@1", "pass@8")),
                               "reward, first tenth", "reward, last tenth", "KL(π‖π₀)"],
        "frameworks_paired": ["row", "step time ×", "peak memory ×", "Δ pass@1", "Δ pass@8", "Δ reward, last tenth"],
    }
    return {name: {"columns": header, "align": "l" + "r" * (len(header) - 1), "rows": rows}
            for (name, header), rows in zip(headers.items(), (cost, quality, paired))}


def report_text(measured: dict[str, dict], names: list[str], args: argparse.Namespace) -> str:
    evaluation = yaml.safe_load(tasks.BASE_CONFIG.read_text())["model"]["evaluation"]
    cost, quality, paired = (grid.markdown(t["columns"], t["rows"]) for t in measured.values())
    return "\n".join([
        f"SmolLM2-135M-Instruct on {', '.join(names)}: {args.steps} steps, {args.seeds} seed(s) (mean ± standard "
        f"error); held-out: {args.eval_size} items per task, {evaluation['num_samples']} samples at temperature "
        f"{evaluation['temperature']}", "", *cost, "", *quality, "",
        "Against TRL's full-parameter row, paired by seed (ratios of step time and peak memory; differences of the "
        "rest):", "", *paired])


def plot(summary: dict[str, dict], args: argparse.Namespace) -> None:
    plt = pyplot()
    trained = [row for row in summary if row != "start"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    for axis, key, label in zip(axes, ("step_s", "peak_gib", "all/pass@1"),
                                ("seconds per step (median)", "peak resident GiB", "held-out pass@1, all tasks")):
        means = [summary[row][key][0] for row in trained]
        errors = [summary[row][key][1] for row in trained]
        axis.bar(range(len(trained)), means, yerr=errors, color=[f"C{i}" for i in range(len(trained))])
        axis.set_xticks(range(len(trained)), [row for row in trained], rotation=30, ha="right")
        axis.set(ylabel=label)
    if "start" in summary:
        axes[2].axhline(summary["start"]["all/pass@1"][0], color="0.5", linestyle="--", label="base model")
        axes[2].legend()
    save_figure(fig, f"TRL's GRPOTrainer and lightning-logra on SmolLM2-135M: {args.steps} steps, {args.seeds} "
                     "seed(s)", args.plot)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    names = task_names()
    runs = runs_of(args)
    run(runs, args)
    results = [measure(r, args, names) for r in runs]
    summary = summarize(results, names)
    measured = tables(summary, names)
    report = report_text(measured, names, args)
    print(report)
    grid.write_report(args.out, {"summary": summary, "runs": results, "settings": grid.arguments(args)})
    args.out.with_suffix(".md").write_text(report + "\n")
    # the tables as docs/results/data/frameworks.json holds them
    args.out.with_suffix(".tables.json").write_text(json.dumps(measured, indent=1, ensure_ascii=False) + "\n")
    plot(summary, args)
    print(f"wrote {args.out} and {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
