"""DAPO's dynamic sampling on add3, and what RL does to pass@k: dense AdamW and LoGRA under its total budget, each with
and without `model.rollouts.dynamic_sampling`, paired seeds, evaluated by pass@k at the end.

    python -m bench.recipe                       # 4 rows × 5 seeds × 400 steps, pass@k of 16 samples on 512 items
    python -m bench.recipe --steps 100 --seeds 2 # a shorter look
    python -m bench.recipe --quick               # 4 steps, 1 seed, 32 items, 4 samples: checks the script

Every run is `python cli.py fit` of a config from bench/lib/add3.py's `run_config` (configs/add3.yaml) with
`model.evaluation.num_samples` completions per held-out prompt at temperature 1.0 (`--eval-samples`; so pass@1 here is
the sampled one, not greedy); the shipped model's pass@k is measured once by `validate`. Rows: dense AdamW on the target
matrices at 1e-4, and LoGRA rank 16 at 1e-3 under `PredictedKLBudget(total_budget=2.2 × steps/400)`
(docs/results/frontier.md's total-budget row), each with dynamic sampling off and on (`max_generation_rounds` 10).
Reported per row (mean ± std over seeds): pass@k for k = 1, 2, 4, … at the end, mean@k and maj@k, the completions
generated (dynamic sampling generates more per step), and dynamic sampling's paired difference in pass@1 and pass@8;
and a plot of pass@1 against completions generated (the fair x-axis once a step can generate more than one round),
with the pass@k curves of every row beside the shipped model's. JSON and plot under bench/out/.
"""

from __future__ import annotations

import argparse
import statistics

from bench.lib import add3, grid
from bench.lib.configs import set_model
from bench.lib.plotting import pyplot, save_figure
from bench.lib.runs import ROOT

ROWS = {"dense": ("dense_targets", 1e-4, False), "dense_ds": ("dense_targets", 1e-4, True),
        "logra_total": ("logra", 1e-3, False), "logra_total_ds": ("logra", 1e-3, True)}
TOTAL_PER_400 = 2.2  # the frontier's total-budget row over 400 steps
GENERATIONS = 8  # add3.yaml's num_generations
BATCH = 32  # add3.yaml's data.batch_size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--evals", type=int, default=4, help="evaluations over the run (the last at the end)")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--eval-samples", type=int, default=16, help="completions per held-out prompt (k's largest)")
    parser.add_argument("--eval-limit", type=int, default=512, help="held-out items evaluated")
    parser.add_argument("--rounds", type=int, default=10, help="model.rollouts.max_generation_rounds of the dynamic "
                                                               "rows")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="4 steps, 1 seed, 32 items, 4 samples")
    grid.add_options(parser, ROOT / "bench" / "out" / "recipe.json", ROOT / "bench" / "out" / "recipe_runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.evals, args.seeds, args.eval_samples, args.eval_limit = 4, 2, 1, 4, 32
    grid.positive(args, "steps", "evals", "seeds", "eval_samples", "eval_limit", "rounds", "parallel")
    if args.steps % args.evals:
        raise SystemExit(f"--steps ({args.steps}) must be a multiple of --evals ({args.evals})")
    args.rank = 16
    return args


def runs(args: argparse.Namespace) -> list[dict]:
    # the shipped model's pass@k: `validate` of the dense row's config (no step taken)
    every = [dict(name="start", row="start", method="dense_targets", lr=1e-4, seed=0, rank=16,
                  distribution="rademacher", refresh_every=None)]
    for seed in range(args.seeds):  # seed by seed: an interrupted grid still holds every row of its first seeds
        for row, (method, lr, dynamic) in ROWS.items():
            every.append(dict(name=f"{row}_seed{seed}", row=row, method=method, lr=lr, seed=seed, rank=args.rank,
                              distribution="rademacher", refresh_every=None, dynamic=dynamic))
    return every


def run_config(run: dict, args: argparse.Namespace) -> dict:
    config = add3.run_config(run, args)
    set_model(config, "evaluation.num_samples", args.eval_samples)
    set_model(config, "evaluation.temperature", 1.0)
    if run.get("dynamic"):
        set_model(config, "rollouts.dynamic_sampling", True)
        set_model(config, "rollouts.max_generation_rounds", args.rounds)
    if run["method"] == "logra":
        config["trainer"]["callbacks"] = [{"class_path": "lightning_logra.callbacks.PredictedKLBudget", "init_args": {
            "total_budget": TOTAL_PER_400 * args.steps / 400, "alpha_max": 4.0, "subset": 16}}]
    return config


def command(run: dict, args: argparse.Namespace) -> list[str]:
    config = run_config(run, args)
    if run["row"] == "start":
        config["trainer"]["callbacks"] = []
        return grid.cli(config, args.runs_dir, run["name"], "validate")
    return grid.cli(config, args.runs_dir, run["name"])


def finished(run: dict, args: argparse.Namespace) -> bool:
    """With --reuse: the run's config is unchanged and its log holds every evaluation (the start's: one)."""
    config = run_config(run, args)
    if run["row"] == "start":
        config["trainer"]["callbacks"] = []
    return args.reuse and grid.finished(args.runs_dir, run["name"], config, 1 if run["row"] == "start" else args.evals)


def measure(run: dict, args: argparse.Namespace) -> dict:
    values = grid.read(args.runs_dir, run["name"])
    n = args.eval_samples
    ks = sorted(int(tag.split("@")[1]) for tag in values if tag.startswith("val/pass@"))
    result = {**run, **{f"pass@{k}": values[f"val/pass@{k}"][-1] for k in ks},
              "mean@n": values[f"val/mean@{n}"][-1], "maj@n": values[f"val/maj@{n}"][-1]}
    if run["row"] == "start":
        return result
    drawn = values.get("rollout/prompts_drawn") or [float(BATCH)] * args.steps
    generated = [sum(drawn[:s]) * GENERATIONS for s in range(1, len(drawn) + 1)]
    every = args.steps // args.evals
    result.update(pass_curve=values["val/pass@1"], generated_at=[generated[s - 1] for s in range(every, args.steps + 1,
                                                                                                  every)],
                  generated=generated[-1], rounds=statistics.fmean(values.get("rollout/generation_rounds", [1.0])),
                  missing=sum(values.get("rollout/missing_groups", [0.0])))
    return result


def summarize(rows: dict[str, list[dict]], ks: list[int]) -> dict[str, dict]:
    keys = (*[f"pass@{k}" for k in ks], "mean@n", "maj@n", "generated", "rounds", "missing")
    summary = {row: {"seeds": len(results), **grid.over_seeds(results, keys)} for row, results in rows.items()
               if row != "start"}
    for base in ("dense", "logra_total"):
        for k in (1, max(k for k in ks if k <= 8)):
            summary[f"{base}_ds"][f"pass@{k}_vs_off"] = grid.mean_se(
                grid.differences(rows[f"{base}_ds"], rows[base], f"pass@{k}"))
    return summary


def table(summary: dict[str, dict], start: dict, ks: list[int]) -> str:
    header = ["row", "seeds", *[f"pass@{k}" for k in ks], "maj@n", "completions generated", "rounds/step",
              "Δ pass@1 vs off (± s.e.)"]
    rows = [["shipped model", "—", *[f"{start[f'pass@{k}']:.3f}" for k in ks], f"{start['maj@n']:.3f}", "0", "—", "—"]]
    for row, e in summary.items():
        vs = grid.pm(e["pass@1_vs_off"]) if "pass@1_vs_off" in e else "—"
        rows.append([row, str(e["seeds"]), *[grid.pm(e[f"pass@{k}"]) for k in ks], grid.pm(e["maj@n"]),
                     f"{e['generated'][0]:,.0f}", f"{e['rounds'][0]:.2f}", vs])
    return "\n".join(grid.markdown(header, rows))


def plot(rows: dict[str, list[dict]], start: dict, ks: list[int], args: argparse.Namespace) -> None:
    plt = pyplot()
    fig, (curve, passk) = plt.subplots(1, 2, figsize=(14, 5.5))
    for row, results in rows.items():
        if row == "start":
            passk.plot(ks, [start[f"pass@{k}"] for k in ks], "k--", marker="o", label="shipped model")
            continue
        xs = [statistics.fmean(r["generated_at"][i] for r in results) for i in range(args.evals)]
        ys = [statistics.fmean(r["pass_curve"][i] for r in results) for i in range(args.evals)]
        curve.plot([0, *xs], [start["pass@1"], *ys], marker="o", label=row)
        passk.plot(ks, [statistics.fmean(r[f"pass@{k}"] for r in results) for k in ks], marker="o", label=row)
    curve.set(xlabel="completions generated", ylabel=f"pass@1 ({args.eval_samples} samples, T=1)")
    passk.set(xscale="log", xlabel="k", ylabel="pass@k at the end")
    for axis in (curve, passk):
        axis.grid(alpha=0.3)
        axis.legend()
    save_figure(fig, f"add3: dynamic sampling and pass@k, {args.steps} steps, {args.seeds} paired seeds", args.plot)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    todo = runs(args)
    done = grid.train(todo, lambda run: command(run, args), args.parallel, keep=lambda run: finished(run, args))
    rows: dict[str, list[dict]] = {}
    for run in done:
        rows.setdefault(run["row"], []).append(measure(run, args))
    start = rows["start"][0]
    ks = sorted(int(key.split("@")[1]) for key in start if key.startswith("pass@"))
    summary = summarize(rows, ks)
    print(table(summary, start, ks))
    grid.write_report(args.out, {"arguments": grid.arguments(args), "start": start, "summary": summary,
                                 "runs": {row: results for row, results in rows.items() if row != "start"}})
    plot(rows, start, ks, args)
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
