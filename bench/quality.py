"""Does LoGRA give up task performance? Methods side by side on the harder embedded task, paired seeds.

    python -m bench.quality            # the full comparison (see --steps, --seeds; 55 runs of 400 steps, ~65 min)
    python -m bench.quality --quick    # every row at 4 steps, 1 seed, 64 held-out items, the reward scored in the
                                       # trainer's process: checks the script (CI)

The task is `configs/add3.yaml`'s (3-digit addition written least significant digit first, the shipped partially
trained model, greedy pass@1 0.2 at the start), where pass@1 is far from its ceiling, so methods can differ. Every run
is `python cli.py fit` of a config built from add3.yaml (written beside the runs), one thread each, `--parallel` at a
time. Paired seeds: seed s sets the sampling, the prompt order, the projections and the adapters' initialization of
every row alike, so row differences are measured on the same batches. `--reward-in-trainer` (on with `--quick`) scores
the reward in the trainer's process (`model.scoring.timeout_s: null`) instead of a reward process of its own, whose
start (an interpreter re-importing the CLI) was a third of a 4-step run.

Rows:
- dense AdamW on all parameters, and on the target matrices only (`trainer.strategy.init_args.dense.target_modules`:
what LoGRA and LoRA train);
- LoRA (peft, `lightning_logra.train.strategies.LoRAStrategy`) on the same targets at the same rank (alpha = 2·rank);
- LoGRA (sketch Adam) at rank `--rank`: fixed Rademacher projection, Rademacher and Gaussian refreshed every quarter
  of the run; fixed Rademacher at `--rank2`, at the grid's learning rates up to rank `--rank`'s best (a higher rank
  sketches the gradient more faithfully, so the same rate moves the policy further: uncontrolled, rank 64 at rank
  16's best rate collapsed to pass@1 0.01); and with `train_rest` (embeddings, norms and biases trained densely at
  dense AdamW's best learning rate).
The learning rates of dense AdamW (both rows), LoRA and LoGRA are swept on a grid, every grid point on every seed;
the rows use each method's best (highest mean final pass@1; the other LoGRA rows take the fixed projection's), and
the grid is reported. These rows have no KL control: each run measures the KL it realizes per step with a
`PredictedKLBudget` whose budget never binds (α = 1 at every step: it only logs `kl/realized`).

The paper's LoRA comparison, as a row pair: LoRA AdamW at a constant 2e-4, against LoGRA with the predicted-KL budget
annealed linearly from δ₀ to δ₀/10 (the paper's 2e-4 → 2e-5 is a factor of 10). Scaled to the task: δ₀ is the KL per
step that the LoRA 2e-4 runs realized over their first tenth of steps (mean over seeds), so both rows start moving
the policy at the same rate; the paper's absolute 2e-4 is a KL per token of a 1.5B model on long math answers.

Reported per row, mean ± std over seeds: greedy pass@1 on the held-out split at the end (the headline; before any
step it is the shipped model's, measured once), its paired difference from dense AdamW on the target matrices, the
sampled reward (temperature 1) over the last tenth of steps, the realized KL per step, and the reward gained (last
tenth − first tenth) per unit of KL travelled (the sum of the per-step KL). JSON and plot under bench/out/.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

from bench.lib import grid
from bench.lib.add3 import PAPER_LORA_LR, start_run, train
from bench.lib.plotting import pyplot, save_figure
from bench.lib.runs import ROOT, add_reward_option

GRIDS = {  # learning rates swept per method (the default run); --quick takes the middle one
    "dense_all": [3e-5, 1e-4, 3e-4],
    "dense_targets": [3e-5, 1e-4, 3e-4],
    "lora": [2e-4, 1e-3, 3e-3],  # 2e-4: the paper's constant LoRA rate, also the pair's row
    "logra": [3e-4, 1e-3, 3e-3],  # add3.yaml's 1e-3 in the middle
}
LABELS = {
    "dense_all": "dense AdamW, all parameters",
    "dense_targets": "dense AdamW, target matrices only",
    "lora": "LoRA",
    "logra": "LoGRA, fixed Rademacher",
    "logra_refresh_rademacher": "LoGRA, refreshed Rademacher",
    "logra_refresh_gaussian": "LoGRA, refreshed Gaussian",
    "logra_rank2": "LoGRA, fixed Rademacher",
    "logra_train_rest": "LoGRA + train_rest",
    "pair_lora": "LoRA, constant 2e-4 (paper)",
    "pair_logra_kl": "LoGRA, KL budget annealed",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400, help="training steps of every run")
    parser.add_argument("--seeds", type=int, default=3, help="paired seeds per row (0, 1, ...)")
    parser.add_argument("--rank", type=int, default=16, help="rank of LoRA and of the LoGRA rows")
    parser.add_argument("--rank2", type=int, default=64, help="LoGRA's second rank (fixed Rademacher)")
    parser.add_argument("--evals", type=int, default=4, help="greedy pass@1 evaluations per run (the last at the end)")
    parser.add_argument("--eval-limit", type=int, default=None, help="held-out items evaluated (default: all 2,054)")
    parser.add_argument("--kl-budget", type=float, default=None,
                        help="δ₀ of the KL-controlled LoGRA row (default: LoRA 2e-4's realized KL per step, see above)")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--quick", action="store_true",
                        help="every row, 4 steps, 1 seed, one learning rate per method, 64 held-out items, "
                             "--reward-in-trainer")
    add_reward_option(parser)
    grid.add_options(parser, ROOT / "bench" / "out" / "quality.json", ROOT / "bench" / "out" / "quality_runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.evals, args.eval_limit = 4, 1, 1, args.eval_limit or 64
        args.reward_in_trainer = True
    grid.positive(args, "steps", "seeds", "evals", "rank", "rank2", "parallel")
    if args.steps % args.evals:
        raise SystemExit(f"--steps ({args.steps}) must be a multiple of --evals ({args.evals})")
    return args


def grids(args: argparse.Namespace) -> dict[str, list[float]]:
    """The learning rates swept per method; --quick: one each (LoRA's is the paper's, which the pair needs)."""
    if not args.quick:
        return GRIDS
    return {method: [PAPER_LORA_LR] if method == "lora" else [lrs[1]] for method, lrs in GRIDS.items()}


# ---- what a run measured -------------------------------------------------------------------------------------------

def measure(run: dict, args: argparse.Namespace) -> dict:
    """The run's curves and summaries from its TensorBoard scalars."""
    values = grid.read(args.runs_dir, run["name"])
    rewards, kl = values["train/reward_mean"], values.get("kl/realized", [])
    tenth = grid.tenth(rewards)
    first, last = statistics.fmean(rewards[:tenth]), statistics.fmean(rewards[-tenth:])
    finite_kl = [k for k in kl if math.isfinite(k)]
    total_kl = sum(finite_kl)
    return {**run, "pass_curve": values["val/pass@1"], "pass_at_1": values["val/pass@1"][-1], "rewards": rewards,
            "kl": kl, "reward_first": first, "reward_last": last,
            "kl_per_step": total_kl / len(finite_kl) if finite_kl else math.nan,
            "reward_per_kl": (last - first) / total_kl if total_kl > 0 else math.nan}


# ---- the comparison -----------------------------------------------------------------------------------------------

def _name(row: str, lr: float, seed: int) -> str:
    return f"{row}_lr{lr:g}_seed{seed}"


def grid_runs(args: argparse.Namespace) -> list[dict]:
    runs = []
    for method, lrs in grids(args).items():
        for lr in lrs:
            for seed in range(args.seeds):
                runs.append(dict(name=_name(method, lr, seed), row=method, method=method, lr=lr, seed=seed,
                                 rank=args.rank, distribution="rademacher", refresh_every=None))
    return runs


def best_lr(results: list[dict], row: str) -> float:
    by_lr: dict[float, list[dict]] = {}
    for result in results:
        if result["row"] == row:
            by_lr.setdefault(result["lr"], []).append(result)
    # highest mean final pass@1; the sampled reward breaks a tie
    return max(by_lr, key=lambda lr: (statistics.fmean(r["pass_at_1"] for r in by_lr[lr]),
                                      statistics.fmean(r["reward_last"] for r in by_lr[lr])))


def second_runs(args: argparse.Namespace, results: list[dict], budget: float) -> list[dict]:
    """The LoGRA variants at LoGRA's best learning rate, and the KL-controlled LoGRA row of the paper's pair."""
    lr, dense_lr = best_lr(results, "logra"), best_lr(results, "dense_all")
    refresh = max(1, args.steps // 4)
    variants = [("logra_refresh_rademacher", dict(distribution="rademacher", refresh_every=refresh)),
                ("logra_refresh_gaussian", dict(distribution="gaussian", refresh_every=refresh))]
    variants += [("logra_rank2", dict(rank=args.rank2, lr=rank2_lr)) for rank2_lr in grids(args)["logra"]
                 if rank2_lr <= lr]
    variants += [("logra_train_rest", dict(rest_lr=dense_lr)), ("pair_logra_kl", dict(kl_budget=budget))]
    runs = []
    for row, settings in variants:
        for seed in range(args.seeds):
            run = dict(row=row, method="logra", lr=lr, seed=seed, rank=args.rank, distribution="rademacher",
                       refresh_every=None) | settings
            runs.append(run | {"name": _name(row, run["lr"], seed)})
    return runs


def kl_budget(args: argparse.Namespace, results: list[dict]) -> float:
    """δ₀ of the pair's LoGRA row: LoRA 2e-4's realized KL per step over its first tenth of steps, mean over seeds."""
    if args.kl_budget is not None:
        return args.kl_budget
    firsts = []
    for result in results:
        if result["row"] == "lora" and result["lr"] == PAPER_LORA_LR:
            tenth = [k for k in result["kl"][: grid.tenth(result["kl"])] if math.isfinite(k)]
            firsts.append(statistics.fmean(tenth))
    return statistics.fmean(firsts)


def summarize(rows: dict[str, list[dict]], start: float) -> dict[str, dict]:
    """Per row: mean and std over seeds of each measure, and pass@1's paired difference from dense on the targets."""
    summary = {}
    for row, results in rows.items():
        entry = {"label": label(row, results[0]), "lr": results[0]["lr"], "seeds": len(results)}
        entry |= grid.over_seeds(results, ("pass_at_1", "reward_last", "kl_per_step", "reward_per_kl"))
        entry["pass_gain"] = grid.mean_std([r["pass_at_1"] - start for r in results])
        entry["pass_vs_dense_targets"] = grid.mean_std(grid.differences(results, rows["dense_targets"], "pass_at_1"))
        if results[0].get("kl_budget") is not None:
            entry["kl_budget"] = results[0]["kl_budget"]
        summary[row] = entry
    return summary


def label(row: str, run: dict) -> str:
    name = LABELS[row]
    if row in ("lora", "logra", "logra_rank2", "logra_refresh_rademacher", "logra_refresh_gaussian",
               "logra_train_rest", "pair_logra_kl"):
        name += f", rank {run['rank']}"
    return name


def tables(summary: dict[str, dict], grid_summary: list[dict], start: float, args: argparse.Namespace) -> str:
    rows = []
    for row, e in summary.items():
        if row == "pair_lora":
            rows.append(["*the paper's LoRA comparison*"] + [""] * 7)
        lr = f"{e['lr']:g}" + (f", δ₀ {e['kl_budget']:.2e}" if "kl_budget" in e else "")
        rows.append([e["label"], lr, grid.pm(e["pass_at_1"]), grid.pm(e["pass_gain"]),
                     grid.pm(e["pass_vs_dense_targets"]), grid.pm(e["reward_last"]),
                     grid.pm(e["kl_per_step"], scientific=True), grid.pm(e["reward_per_kl"], 1)])
    lr_rows = [[e["label"], f"{e['lr']:g}" + (" *" if e["chosen"] else ""), grid.pm(e["pass_at_1"]),
                grid.pm(e["reward_last"])] for e in grid_summary]
    return "\n".join([
        f"greedy pass@1 of the shipped model on the held-out split, before any step: {start:.3f}", "",
        *grid.markdown(["row", "lr", f"greedy pass@1 at {args.steps}", "gain", "vs dense (targets), paired",
                        "sampled reward, last tenth", "KL per step", "reward gain per unit KL"], rows),
        "", "learning-rate grid (mean ± std over seeds; * the row's choice):", "",
        *grid.markdown(["method", "lr", "greedy pass@1", "sampled reward, last tenth"], lr_rows)])


def grid_table(results: list[dict], chosen: dict[str, float]) -> list[dict]:
    entries = []
    for method in [*GRIDS, "logra_rank2"]:
        lrs = sorted({r["lr"] for r in results if r["row"] == method})
        for lr in lrs:
            runs = [r for r in results if r["row"] == method and r["lr"] == lr]
            entries.append(dict(method=method, label=label(method, runs[0]), lr=lr, chosen=chosen[method] == lr,
                                **grid.over_seeds(runs, ("pass_at_1", "reward_last"))))
    return entries


def plot(rows: dict[str, list[dict]], summary: dict[str, dict], start: float, args: argparse.Namespace) -> None:
    plt = pyplot()
    fig, (pass_axis, reward_axis, kl_axis) = plt.subplots(1, 3, figsize=(18, 5.5))
    every = args.steps // args.evals
    window = max(1, args.steps // 20)
    for row, results in rows.items():
        style = "--" if row.startswith("pair") else "-"
        label_text = summary[row]["label"]
        passes = grid.mean_curve([[start] + r["pass_curve"] for r in results])
        pass_axis.plot([i * every for i in range(len(passes))], passes, style, marker="o", label=label_text)
        rewards = grid.mean_curve([grid.moving_mean(r["rewards"], window) for r in results])
        reward_axis.plot(range(1, len(rewards) + 1), rewards, style)
        kls = grid.mean_curve([grid.moving_mean([k if math.isfinite(k) else 0.0 for k in r["kl"]], window)
                               for r in results])
        kl_axis.plot(range(1, len(kls) + 1), kls, style)
    pass_axis.set(xlabel="step", ylabel="greedy pass@1, held-out split (mean over seeds)")
    reward_axis.set(xlabel="step", ylabel=f"sampled reward (moving mean of {window} steps)")
    kl_axis.set(xlabel="step", ylabel="realized KL per step", yscale="log")
    pass_axis.legend(fontsize=7)
    save_figure(fig, f"reversed 3-digit addition: {args.steps} steps, {args.seeds} paired seeds", args.plot)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    first = train([start_run(args), *grid_runs(args)], args)
    start = grid.read(args.runs_dir, "start")["val/pass@1"][-1]
    results = [measure(row, args) for row in first if row["method"] != "start"]
    chosen = {method: best_lr(results, method) for method in GRIDS}
    budget = kl_budget(args, results)
    results += [measure(row, args) for row in train(second_runs(args, results, budget), args)]
    chosen["logra_rank2"] = best_lr(results, "logra_rank2")

    rows: dict[str, list[dict]] = {}
    for method in GRIDS:  # the grid's best, then the variants and the pair
        rows[method] = [r for r in results if r["row"] == method and r["lr"] == chosen[method]]
    for row in ("logra_refresh_rademacher", "logra_refresh_gaussian", "logra_rank2", "logra_train_rest"):
        rows[row] = [r for r in results if r["row"] == row and r["lr"] == chosen.get(row, r["lr"])]
    rows["pair_lora"] = [r for r in results if r["row"] == "lora" and r["lr"] == PAPER_LORA_LR]
    rows["pair_logra_kl"] = [r for r in results if r["row"] == "pair_logra_kl"]
    summary = summarize(rows, start)
    grid_summary = grid_table(results, chosen)
    print(tables(summary, grid_summary, start, args))
    grid.write_report(args.out, {"start_pass_at_1": start, "kl_budget": budget, "summary": summary,
                                 "grid": grid_summary, "runs": results, "settings": grid.arguments(args)})
    plot(rows, summary, start, args)
    print(f"wrote {args.out} and {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
