"""bf16 weights at an RL learning rate: fp32, bf16 rounded to nearest, bf16 rounded stochastically, side by side.

    python -m bench.precision               # 1,200 steps × 3 variants × 2 seeds of configs/tiny_arith_bf16.yaml
    python -m bench.precision --quick       # 6 steps each, one seed, one thread a run, the reward scored in the
                                            # trainer's process: checks that it runs (CI)
    python -m bench.precision --merge-only  # the merge's cost per step at the Qwen2.5-1.5B shape, nothing else

Every run is `configs/tiny_arith_bf16.yaml` through the CLI (sketch Adam at lr 1e-5, predicted-KL control), with
paired seeds: for each seed the three variants see the same prompts and, while their weights agree, the same
samples. Reported per variant: the sampled reward of the first and last tenth of the steps and its gain, the gain
relative to fp32 on the same seed, greedy pass@1 at the end, the mean landed fraction (how much of each intended
update reached the weights), the mean predicted / intended / realized KL per step, and the median step time.
The variants run one at a time by default, so that the step times compare (`--parallel 2` halves the wall time and
spoils the times). `--quick` gives each run one thread: two threads' OpenMP barriers stall when another process
shares the 2 cores, as in CI's tier of two tests at a time (beside one busy process, 1.4–2.2 s a step against
0.4–0.6 s, for the same numbers); and it scores the reward in the trainer's process (`--reward-in-trainer`), not in a
reward process started for each run.

Before the runs, the merge itself is timed at the shape of `--merge-shape` (default Qwen2.5-1.5B: its 196 target
matrices, 1.31 B weights, bf16, rank 256): W −= F·A for every matrix once, rounded to nearest and stochastically.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.lib.plotting import pyplot, save_figure
from bench.lib.runs import ROOT, add_reward_option, cli_command, latest_run, run_all, scalars
from bench.lib.shapes import SHAPES
from lightning_logra.sketch import apply_low_rank_update_, make_projection
from lightning_logra.sketch.rounding import rounding_key

VARIANTS = {
    "fp32": ["--trainer.precision", "32-true", "--model.dtype", "float32"],
    "bf16, nearest": ["--trainer.strategy.init_args.sketch.optimizer.rounding", "nearest"],
    "bf16, stochastic": ["--trainer.strategy.init_args.sketch.optimizer.rounding", "stochastic"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1200, help="the config's own length")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--lr", type=float, help="sketch lr (default: the config's, 1e-5)")
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--threads", type=int, help="intra-op threads per run (default 2; 1 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="6 steps, one seed, one thread a run, --reward-in-trainer: a check that it runs")
    add_reward_option(parser)
    parser.add_argument("--merge-shape", choices=SHAPES, default="1.5b")
    parser.add_argument("--merge-rank", type=int, default=256)
    parser.add_argument("--merge-only", action="store_true", help="time the merge, train nothing")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "precision.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "bench" / "out" / "precision.png")
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "bench" / "out" / "precision_runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.merge_shape, args.merge_rank = 6, args.seeds[:1], "tiny", 16
        args.reward_in_trainer = True
    if args.threads is None:
        args.threads = 1 if args.quick else 2
    return args


def merge_seconds(shape: str, rank: int) -> dict:
    """Seconds for one update of every target matrix of a Qwen2.5 shape in bf16, by rounding mode.

    Each distinct matrix shape is timed once and counted as often as the model has it (the cost is per element).
    """
    config = SHAPES[shape]
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    kv = h // config["num_attention_heads"] * config["num_key_value_heads"]
    # (d, k) → matrices per layer: q and o; k and v; gate and up; down.
    shapes = {(h, h): 2, (kv, h): 2, (i, h): 2, (h, i): 1}
    seconds = {"nearest": 0.0, "stochastic": 0.0}
    elements = 0
    for (d, k), count in shapes.items():
        generator = torch.Generator().manual_seed(d * k)
        weight = (torch.randn(d, k, generator=generator) * 0.02).bfloat16()
        factor = torch.randn(d, rank, generator=generator) * 1e-6
        projection = make_projection(0, rank, k)
        for mode, key in (("nearest", None), ("stochastic", rounding_key(0, 0))):
            apply_low_rank_update_(weight, factor, projection, key)  # warm-up
            start = time.perf_counter()
            apply_low_rank_update_(weight, factor, projection, key)
            seconds[mode] += (time.perf_counter() - start) * count * layers
        elements += d * k * count * layers
    return {"shape": shape, "rank": rank, "elements": elements, "matrices": sum(shapes.values()) * layers,
            "threads": torch.get_num_threads(), **{f"{m}_s": v for m, v in seconds.items()}}


def _log_name(run: dict) -> str:
    return f"{run['variant'].replace(', ', '_')}_seed{run['seed']}"


def command(run: dict, args: argparse.Namespace) -> list[str]:
    seed = str(run["seed"])
    lr = [] if args.lr is None else ["--trainer.strategy.init_args.sketch.optimizer.lr", str(args.lr)]
    reward = ["--model.scoring.timeout_s", "null"] if args.reward_in_trainer else []
    return cli_command("tiny_arith_bf16.yaml", args.steps, args.runs_dir, _log_name(run), *VARIANTS[run["variant"]],
                       "--seed_everything", seed, "--model.sampling.seed", seed, "--data.init_args.seed", seed, *lr,
                       *reward)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize(run: dict, args: argparse.Namespace) -> dict:
    log_dir = latest_run(args.runs_dir, _log_name(run))
    values = scalars(log_dir)
    rewards = values["train/reward_mean"]
    tenth = max(1, len(rewards) // 10)
    first, last = _mean(rewards[:tenth]), _mean(rewards[-tenth:])
    return {**run, "log_dir": str(log_dir), "reward_first": first, "reward_last": last, "gain": last - first,
            "pass_at_1": values["val/pass@1"][-1], "rewards": rewards,
            "landed": values.get("update/landed_fraction", []),
            "landed_mean": _mean(values.get("update/landed_fraction", [])),
            **{f"kl_{k}": _mean(values.get(f"kl/{k}", [])) for k in ("predicted", "intended", "realized")},
            "step_s": statistics.median(values["train/step_s"])}


def table(rows: list[dict]) -> str:
    fp32_gain = {r["seed"]: r["gain"] for r in rows if r["variant"] == "fp32" and "error" not in r}
    lines = ["| variant | seeds | reward, first → last tenth | gain | gain / fp32's (paired) | greedy pass@1 "
             "| landed fraction | KL predicted / intended / realized | median step s |",
             "|---|---:|---|---:|---:|---:|---:|---|---:|"]
    for variant in VARIANTS:
        ok = [r for r in rows if r["variant"] == variant and "error" not in r]
        failed = [r for r in rows if r["variant"] == variant and "error" in r]
        if failed:
            lines.append(f"| {variant} | error: {failed[0]['error']} | | | | | | | |")
        if not ok:
            continue
        ratio = [r["gain"] / fp32_gain[r["seed"]] for r in ok if fp32_gain.get(r["seed"])]
        kl = " / ".join("–" if r != r else f"{r:.2e}" for r in
                        (_mean([x[f"kl_{k}"] for x in ok]) for k in ("predicted", "intended", "realized")))
        lines.append(
            f"| {variant} | {len(ok)} | {_mean([r['reward_first'] for r in ok]):.3f} → "
            f"{_mean([r['reward_last'] for r in ok]):.3f} | {_mean([r['gain'] for r in ok]):+.3f} "
            f"| {_mean(ratio):.2f} | {_mean([r['pass_at_1'] for r in ok]):.3f} "
            f"| {_mean([r['landed_mean'] for r in ok]):.3f} | {kl} | {_mean([r['step_s'] for r in ok]):.3f} |")
    return "\n".join(lines)


def plot(rows: list[dict], title: str, path: Path) -> None:
    plt = pyplot()
    fig, (reward_axis, landed_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    window = 30
    for variant, color in zip(VARIANTS, ("C0", "C3", "C2")):
        ok = [r for r in rows if r["variant"] == variant and "error" not in r]
        for index, run in enumerate(ok):
            rewards = run["rewards"]
            smooth = [_mean(rewards[max(0, i - window + 1): i + 1]) for i in range(len(rewards))]
            reward_axis.plot(smooth, color=color, alpha=0.9, label=variant if index == 0 else None)
            landed_axis.plot(run["landed"], color=color, alpha=0.6, label=variant if index == 0 else None)
    reward_axis.set_xlabel("step")
    reward_axis.set_ylabel(f"sampled reward ({window}-step mean)")
    reward_axis.legend()
    landed_axis.set_xlabel("step")
    landed_axis.set_ylabel("landed fraction of the intended update")
    landed_axis.set_yscale("symlog", linthresh=0.01)
    landed_axis.legend()
    save_figure(fig, title, path)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    merge = merge_seconds(args.merge_shape, args.merge_rank)
    print(f"merge of {merge['matrices']} matrices ({merge['elements'] / 1e9:.2f} B bf16 weights, Qwen2.5-"
          f"{merge['shape']} shape, rank {merge['rank']}, {merge['threads']} threads): rounded to nearest "
          f"{merge['nearest_s']:.2f} s, stochastically {merge['stochastic_s']:.2f} s per update")
    if args.merge_only:
        return
    runs = [dict(name=f"{variant}, seed {seed}", variant=variant, seed=seed) for seed in args.seeds
            for variant in VARIANTS]
    rows = [row if "error" in row else summarize(row, args)
            for row in run_all(runs, lambda run: command(run, args), args.parallel, args.threads)]
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.write_text(json.dumps({"merge": merge, "runs": rows, "settings": settings}, indent=2) + "\n")
    plot(rows, f"configs/tiny_arith_bf16.yaml, {args.steps} steps, seeds {args.seeds}", args.plot)
    print(f"wrote {args.out} and {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
