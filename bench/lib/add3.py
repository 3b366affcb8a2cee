"""The add3 runs of each method, built from configs/add3.yaml (3-digit addition written least significant digit first,
the shipped partially trained model): the configs, the start's validation, and their training as a grid of paired-seed
runs (`bench.lib.grid`). bench.quality compares the methods on it, bench.frontier places them on the reward–KL frontier,
bench.recipe adds dynamic sampling and pass@k.

Methods: dense AdamW on every parameter (`dense_all`) or on the target matrices (`dense_targets`), both through
`DenseStrategy`; LoRA adapters on the targets (`LoRAStrategy`, alpha = 2·rank); LoGRA (add3.yaml's own
`SketchStrategy`, sketch Adam) on the targets. Each run's KL per step is logged by a `PredictedKLBudget` that binds
only where the run says so (`kl_budget`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import yaml

from bench.lib import grid
from bench.lib.configs import dense_strategy, lora_strategy, set_model
from bench.lib.runs import ROOT

BASE_CONFIG = ROOT / "configs" / "add3.yaml"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PAPER_LORA_LR = 2e-4  # the paper's constant LoRA rate
START = {"method": "dense_all", "lr": 1e-4}  # the config the start's validation takes (it takes no step)


def kl_callback(budget: float | None, steps: int) -> dict:
    """PredictedKLBudget: a budget that binds (δ₀ → δ₀/10, linear), or None: one that never does (α = 1 at every step,
    since α = min(α_max = 1, √(δ/q)) with δ = 1e6), so that the run is uncontrolled and still logs `kl/realized`."""
    if budget is None:
        return {"class_path": "lightning_logra.callbacks.PredictedKLBudget",
                "init_args": {"budget": 1e6, "alpha_max": 1.0, "subset": 16}}
    return {"class_path": "lightning_logra.callbacks.PredictedKLBudget",
            "init_args": {"budget": budget, "final_budget": budget / 10, "schedule": "linear",
                          "anneal_steps": steps, "alpha_max": 4.0, "subset": 16}}


def run_config(run: dict, args: argparse.Namespace) -> dict:
    """The whole config of one run: add3.yaml with the run's method, learning rate and seed (`run`: "method"
    dense_all / dense_targets / lora / logra, "lr", "rank", "seed"; LoGRA's "distribution", "refresh_every" and
    optionally "rest_lr"; optionally "kl_budget"). `args`: steps, evals, runs_dir, eval_limit (`grid.as_run`) and,
    if it has it, reward_in_trainer."""
    config = grid.as_run(yaml.safe_load(BASE_CONFIG.read_text()), run, args, args.evals)
    seed, trainer = run["seed"], config["trainer"]
    trainer["callbacks"] = [kl_callback(run.get("kl_budget"), args.steps)]
    if getattr(args, "reward_in_trainer", False):  # runs.add_reward_option's; recipe's arguments lack it
        set_model(config, "scoring.timeout_s", None)
    method = run["method"]
    if method.startswith("dense"):
        trainer["strategy"] = dense_strategy(run["lr"], TARGETS if method == "dense_targets" else None)
    elif method == "lora":
        trainer["strategy"] = lora_strategy(TARGETS, run["rank"], run["lr"], seed)
    else:
        sketch = trainer["strategy"]["init_args"]["sketch"]
        sketch.update(target_modules=TARGETS, rank=run["rank"], seed=seed, distribution=run["distribution"])
        sketch["optimizer"]["init_args"] = {"lr": run["lr"], "refresh_every": run["refresh_every"]}
        if run.get("rest_lr") is not None:
            sketch.update(train_rest=True, train_bias=True, rest_lr=run["rest_lr"])
    return config


def start_run(args: argparse.Namespace) -> dict:
    """The run that measures the shipped model's greedy pass@1 before any step (`start_config`), once per grid."""
    return dict(name="start", row="start", method="start", lr=0.0, seed=0, rank=args.rank, distribution="rademacher",
                refresh_every=None)


def start_config(run: dict, args: argparse.Namespace) -> dict:
    """The shipped model's greedy pass@1, measured once by `validate` (which runs no training step) of a dense run's
    config, `run`'s method and learning rate, without its callbacks."""
    config = run_config(run, args)
    config["trainer"]["callbacks"] = []
    return config


def command(run: dict, args: argparse.Namespace, build: Callable = run_config, start: dict = START) -> list[str]:
    """`fit` of the run's config from `build`, or the start's `validate` of its config at `start` (method, lr)."""
    if run["method"] == "start":
        return grid.cli(start_config({**run, **start}, args), args.runs_dir, run["name"], "validate")
    return grid.cli(build(run, args), args.runs_dir, run["name"])


def finished(run: dict, args: argparse.Namespace, build: Callable = run_config) -> bool:
    """With --reuse: the run's config in --runs-dir is the one `build` gives it now (the start's: any), and its log
    holds every evaluation (`start` only validates: one)."""
    if run["method"] == "start":
        return args.reuse and grid.finished(args.runs_dir, run["name"], None, 1)
    return args.reuse and grid.finished(args.runs_dir, run["name"], build(run, args), args.evals)


def train(runs: list[dict], args: argparse.Namespace, build: Callable = run_config, start: dict = START) -> list[dict]:
    """Every run (those `finished` only measured), in order; stops naming the runs that failed. `build` and `start`:
    another tool's configs on the same grid (bench.frontier's)."""
    return grid.train(runs, lambda run: command(run, args, build, start), args.parallel,
                      keep=lambda run: finished(run, args, build))
