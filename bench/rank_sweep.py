"""Rank and projection design study: how well a rank-r sketch reconstructs the gradient, and what it does to reward.

    python -m bench.rank_sweep                       # cosines on the Qwen2.5-0.5B shape + reward runs on the tiny task
    python -m bench.rank_sweep --skip-training       # the cosines only (seconds)

Part 1, gradient reconstruction. On a random-weight Qwen2 of the chosen Qwen2.5 shape (`--cos-layers` decoder
layers: the cosine depends on each matrix's shape, not on the depth), one policy-gradient micro-batch gives the
dense gradient G of every target matrix; the same micro-batch through sketched layers gives S = G·Aᵀ, and the
cosine between G and the reconstruction S·A is averaged over the matrices. Theory for a random projection with
E[AᵀA] = I: cos ≈ √(r/(r+k)) (k the matrix's input width), printed beside it. Both projections (Rademacher and
Gaussian) over `--seeds` seeds; with `--share-projection` also Rademacher with one A per input
(`sketch.share_projection`: q/k/v and gate/up of a layer share their A), which changes no matrix's expected cosine,
only which matrices' sketches are correlated. A matrix with k ≤ r (in_features) cannot be sketched at rank r and is
left out of that rank's average (the table says how many matrices were measured).

Part 2, reward. The embedded task (`configs/tiny_arith.yaml`, 600 steps by default) is trained through the CLI at
each rank that fits its 128-wide matrices, with the paper's design choices at `--design-rank`: a fixed Rademacher
projection, a Rademacher projection refreshed every `--refresh-every` updates, and a refreshed Gaussian one (with
`--share-projection`, also the fixed Rademacher one shared per input). The reward is the mean sampled reward over
the last tenth of the steps; pass@1 is the final greedy evaluation. Each run is a subprocess with one thread,
`--parallel` at a time. `--reward-ranks` picks the fixed-projection runs' ranks apart from the cosines' (a quick check
needs fewer runs than ranks), `--reward-in-trainer` scores the reward without a reward process of its own.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from bench.lib.cosines import dense_gradients, reconstruction_cosines
from bench.lib.plotting import pyplot, save_figure
from bench.lib.policy_step import fixed_batch
from bench.lib.runs import ROOT, add_reward_option, cli_command, latest_run, run_all, scalars
from bench.lib.shapes import SHAPES, qwen2_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 16, 64, 256])
    parser.add_argument("--cos-shape", choices=SHAPES, default="0.5b")
    parser.add_argument("--cos-layers", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=3, help="projection seeds per (rank, distribution)")
    parser.add_argument("--steps", type=int, default=600, help="training steps of each reward run")
    parser.add_argument("--design-rank", type=int, default=16)
    parser.add_argument("--refresh-every", type=int, default=100)
    parser.add_argument("--reward-ranks", type=int, nargs="+",
                        help="ranks of the fixed-projection reward runs (default: --ranks; those that fit)")
    parser.add_argument("--parallel", type=int, default=2)
    add_reward_option(parser)
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--share-projection", action="store_true",
                        help="also measure one Rademacher A per input (sketch.share_projection) beside one per matrix")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "rank_sweep.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "bench" / "out" / "rank_sweep.png")
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "bench" / "out" / "rank_sweep_runs")
    return parser.parse_args(argv)


# ---- part 1: reconstruction cosine ----------------------------------------------------------------------------

def cosine_model(shape: str, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return qwen2_model(shape, torch.float32, 128, num_hidden_layers=layers)


def cosine_rows(args: argparse.Namespace) -> list[dict]:
    model = cosine_model(args.cos_shape, args.cos_layers)
    batch_args = argparse.Namespace(seed=0, batch=8, group=4, prompt_len=32, completion_len=32)
    batch = fixed_batch(batch_args, model.config.vocab_size)
    gradients = dense_gradients(model, batch)
    rows = []
    projections = [("rademacher", False), ("gaussian", False)] + [("rademacher", True)] * args.share_projection
    for rank in args.ranks:
        for distribution, shared in projections:
            per_seed = [reconstruction_cosines(model, batch, gradients, rank, distribution, seed, shared)
                        for seed in range(args.seeds)]
            if not per_seed[0]:
                rows.append(dict(rank=rank, distribution=distribution, shared=shared, matrices=0))
                continue
            names = list(per_seed[0])
            measured = [sum(c.values()) / len(c) for c in per_seed]
            theory = sum(math.sqrt(rank / (rank + gradients[n].shape[1])) for n in names) / len(names)
            rows.append(dict(rank=rank, distribution=distribution, shared=shared, matrices=len(names),
                             cosine=sum(measured) / len(measured), cosine_min_seed=min(measured),
                             cosine_max_seed=max(measured), theory=theory))
            print(f"rank {rank:4d} {_label(rows[-1]):30s} cos {rows[-1]['cosine']:.4f} vs √(r/(r+k)) {theory:.4f} "
                  f"over {len(names)} matrices", file=sys.stderr, flush=True)
    return rows


def _label(row: dict) -> str:
    return row["distribution"] + (", one A per input" if row.get("shared") else "")


# ---- part 2: reward on the embedded task ----------------------------------------------------------------------

def reward_runs(args: argparse.Namespace) -> list[dict]:
    width = 128  # the embedded model's hidden size: every sketch there needs rank < 128
    ranks = args.reward_ranks or args.ranks
    runs = [dict(name=f"rank {r}, fixed rademacher", rank=r, distribution="rademacher", refresh=None)
            for r in ranks if r < width]
    runs += [dict(name=f"rank {args.design_rank}, refreshed {d}", rank=args.design_rank, distribution=d,
                  refresh=args.refresh_every) for d in ("rademacher", "gaussian")]
    if args.share_projection:
        runs.append(dict(name=f"rank {args.design_rank}, fixed rademacher, one A per input", rank=args.design_rank,
                         distribution="rademacher", refresh=None, shared=True))
    skipped = [r for r in ranks if r >= width]
    if skipped:
        print(f"reward runs: ranks {skipped} do not fit the embedded model's {width}-wide matrices",
              file=sys.stderr)
    return runs


def run_command(run: dict, args: argparse.Namespace) -> list[str]:
    sketch = "--trainer.strategy.init_args.sketch."
    # A fixed projection is the config's own setting (refresh_every: null), which the command line cannot restate.
    refresh = [] if run["refresh"] is None else [f"{sketch}optimizer.refresh_every", str(run["refresh"])]
    shared = [f"{sketch}share_projection", "true"] if run.get("shared") else []
    reward = ["--model.scoring.timeout_s", "null"] if args.reward_in_trainer else []
    return cli_command("tiny_arith.yaml", args.steps, args.runs_dir, _log_name(run), f"{sketch}rank", str(run["rank"]),
                       f"{sketch}distribution", run["distribution"], *refresh, *shared, *reward)


def _log_name(run: dict) -> str:
    return run["name"].replace(" ", "_").replace(",", "")


def train_all(runs: list[dict], args: argparse.Namespace) -> list[dict]:
    rows = []
    for row in run_all(runs, lambda run: run_command(run, args), args.parallel):
        if "error" not in row:
            log_dir = latest_run(args.runs_dir, _log_name(row))
            values = scalars(log_dir)
            rewards = values["train/reward_mean"]
            tenth = max(1, len(rewards) // 10)
            row.update(reward_first=sum(rewards[:tenth]) / tenth, reward_last=sum(rewards[-tenth:]) / tenth,
                       pass_at_1=values["val/pass@1"][-1], log_dir=str(log_dir))
        rows.append(row)
    return rows


# ---- report -------------------------------------------------------------------------------------------------------

def tables(cosines: list[dict], rewards: list[dict]) -> str:
    lines = ["| rank | projection | matrices | mean cos(G, S·A) | √(r/(r+k)) | measured / theory |",
             "|---:|---|---:|---:|---:|---:|"]
    for row in cosines:
        if not row["matrices"]:
            lines.append(f"| {row['rank']} | {_label(row)} | 0 | – | – | – |")
            continue
        lines.append(f"| {row['rank']} | {_label(row)} | {row['matrices']} | {row['cosine']:.4f} "
                     f"| {row['theory']:.4f} | {row['cosine'] / row['theory']:.3f} |")
    if rewards:
        lines += ["", "| run | reward, first tenth | reward, last tenth | greedy pass@1 | minutes |",
                  "|---|---:|---:|---:|---:|"]
        for row in rewards:
            if "error" in row:
                lines.append(f"| {row['name']} | error: {row['error']} | | | |")
                continue
            lines.append(f"| {row['name']} | {row['reward_first']:.3f} | {row['reward_last']:.3f} "
                         f"| {row['pass_at_1']:.3f} | {row['minutes']:.1f} |")
    return "\n".join(lines)


def plot(cosines: list[dict], rewards: list[dict], title: str, path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2 if rewards else 1, figsize=(12 if rewards else 6, 4.5), squeeze=False)
    cos_axis = axes[0][0]
    for distribution, marker in (("rademacher", "o"), ("gaussian", "s")):
        rows = [r for r in cosines if r["distribution"] == distribution and not r["shared"] and r["matrices"]]
        cos_axis.plot([r["rank"] for r in rows], [r["cosine"] for r in rows], marker=marker, label=distribution)
    shared = [r for r in cosines if r["shared"] and r["matrices"]]
    if shared:
        cos_axis.plot([r["rank"] for r in shared], [r["cosine"] for r in shared], marker="x", linestyle=":",
                      label="rademacher, one A per input")
    rows = [r for r in cosines if r["distribution"] == "rademacher" and not r["shared"] and r["matrices"]]
    cos_axis.plot([r["rank"] for r in rows], [r["theory"] for r in rows], "k--", label="√(r/(r+k))")
    cos_axis.set_xscale("log", base=2)
    cos_axis.set_xlabel("rank r")
    cos_axis.set_ylabel("mean cos(G, S·A)")
    cos_axis.legend()
    if rewards:
        ok = [r for r in rewards if "error" not in r]
        axis = axes[0][1]
        axis.barh([r["name"] for r in ok], [r["reward_last"] for r in ok], label="reward, last tenth")
        axis.barh([r["name"] for r in ok], [r["reward_first"] for r in ok], height=0.3, label="first tenth")
        axis.set_xlabel("mean sampled reward (embedded task)")
        axis.legend(loc="lower right")
    save_figure(fig, title, path)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cosines = cosine_rows(args)
    rewards = [] if args.skip_training else train_all(reward_runs(args), args)
    print(tables(cosines, rewards))
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cosines": cosines, "rewards": rewards, "settings": settings}, indent=2) + "\n")
    title = f"cosines: Qwen2.5-{args.cos_shape} shape, {args.cos_layers} layers; reward: tiny task, {args.steps} steps"
    plot(cosines, rewards, title, args.plot)
    print(f"wrote {args.out} and {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
