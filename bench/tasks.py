"""A real pretrained model on several reasoning tasks: LoGRA against dense AdamW, LoRA and a low-memory peer.

    python -m bench.tasks --survey     # the base model's pass@8 on 14 candidate tasks (one `validate`, ~10 min)
    python -m bench.tasks              # the comparison on configs/smollm2_reasoning.yaml's tasks (60 steps a row,
                                       # one seed)
    python -m bench.tasks --quick      # 2 candidate tasks, and every row for 1 step (groups of 4) on 2 held-out
                                       # items per task, the policy generating (no vLLM engine): checks the script
                                       # (CI)

The model is SmolLM2-135M-Instruct (`lightning-logra fetch smollm2-135m-instruct`; Q4_1 weights dequantized), the
tasks reasoning-gym's (`lightning_logra.data.reasoning_gym`), each scored by its own scorer on the answer the
completion states after "The answer is", which the prompt begins (`rewards.ReasoningGymScore`, 0/1), sampled at the
config's temperature (0.7). Every run is `python cli.py` of a config built from
`configs/smollm2_reasoning.yaml` (written beside the runs; `--reuse` keeps the runs already finished with the same
config), one at a time, alone, with both cores, so that seconds per step compare.

`--survey`: one `validate` of the base model on CANDIDATES (easy settings of arithmetic, string, counting and logic
tasks), `--survey-size` held-out items each, 8 samples each: pass@1 and pass@8 per task. The tasks RL can
move are those where pass@8 is neither near 0 (no sample is ever right: nothing to learn from) nor near 1.

The comparison, each row training the same matrices (q, k, v, o, gate, up, down of every layer) for `--steps` steps
on the config's tasks, with the config's batch, sampling, engine (vLLM's CPU engine, in the trainer's process) and
seed:
- `logra`: the config itself: sketches at rank 16, sketch Adam, the predicted-KL controller under a total budget
  (`--logra-kl` a step);
- `dense`: dense AdamW at `--dense-lr`;
- `lora`: LoRA adapters at rank 16 (alpha 32) at `--lora-lr`;
- `apollo_mini`: APOLLO-Mini (`apollo_torch.APOLLOAdamW`, rank 1, tensor-wise scaling: bench/peers.py), the
  full-parameter peer whose peak memory came closest to LoGRA's among those a
  `trainer.strategy.init_args.dense.optimizer` can run (layer-wise GaLore steps inside the backward pass, which the
  trainer's accumulated, clipped and controlled step does not allow), at `--apollo-lr`.
The rows other than LoGRA have no KL control; a budget that never binds logs their per-step KL. LoGRA's total budget
is `--logra-kl` per step times the steps, and the others' learning rates put their KL per step near it (see the
options' defaults), so that the rows compare at about equal movement.
Every row measures, at its last validation, KL(π_t ‖ π_0) on held-out completions (`KLFromStart`). Before any step,
one `validate` measures the base model (the `start`).

Reported per row and per task: validation pass@1 and pass@8 (8 samples) before and after, the reward curve
(`train/reward_mean`, `reward/<task>/mean`), KL(π‖π₀) at the end, peak memory (`memory/peak_gib`: the process's
resident memory, the engine's included, since it runs in the process), and the median seconds per step with its parts
(generation, the update, the weight sync). LoGRA's update includes its KL control; the other rows' step and update
are timed without the KL check that only logs their KL per step. One seed unless `--seeds`. JSON, markdown and a plot
under bench/out/.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

import yaml

from bench.lib import grid, peers
from bench.lib.configs import dense_strategy, lora_strategy, optimizer_dict, set_model
from bench.lib.plotting import pyplot, save_figure
from bench.lib.runs import ROOT, run_all

BASE_CONFIG = ROOT / "configs" / "smollm2_reasoning.yaml"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 16
# The candidates of the survey: easy settings of structurally different tasks, each with room for a held-out set
# apart from a few thousand training items.
CANDIDATES: dict[str, dict] = {
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "max_digits": 2, "allow_parentheses": False,
                         "allow_negation": False, "operators": ["+", "-"]},
    "chain_sum": {"min_terms": 2, "max_terms": 2, "max_digits": 2},
    "products": {"min_terms": 2, "max_terms": 2, "max_digits": 2},
    "gcd": {"max_value": 100},
    "lcm": {"max_value": 50},
    "count_bits": {"max_n": 100000},
    "letter_counting": {"min_words": 3, "max_words": 5},
    "spell_backward": {"min_word_len": 3, "max_word_len": 5},
    "word_sequence_reversal": {"min_words": 2, "max_words": 3},
    "number_sorting": {"min_numbers": 3, "max_numbers": 3, "max_decimals": 0},
    "syllogism": {},
    "aiw": {},
    "leg_counting": {"min_animals": 1, "max_animals": 2, "max_instances": 5},
    "base_conversion": {"max_base": 10, "max_value": 100},
}
QUICK_CANDIDATES = ["basic_arithmetic", "syllogism"]
ROWS = ("logra", "dense", "lora", "apollo_mini")
LABELS = {"start": "base model", "logra": "LoGRA (sketch Adam, rank 16, total KL budget)",
          "dense": "dense AdamW", "lora": "LoRA (rank 16)", "apollo_mini": "APOLLO-Mini (rank 1)"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--survey", action="store_true", help="measure the base model on the candidate tasks instead")
    parser.add_argument("--survey-size", type=int, default=24, help="held-out items per candidate task")
    parser.add_argument("--steps", type=int, default=60, help="training steps of every row")
    parser.add_argument("--seeds", type=int, default=1, help="paired seeds per row (0, 1, ...)")
    parser.add_argument("--eval-size", type=int, default=32, help="held-out items per task")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from {', '.join(ROWS)}")
    # The rows move about equally per step: 60-step runs at these rates measured 4.1e-4 (dense), 5.2e-4 (LoRA) and
    # 4.6e-4 (APOLLO-Mini) per step, and LoGRA is held to 5e-4 a step. Equal movement is what makes their task
    # scores comparable: LoGRA given 7x the others' KL a step ended further from the base model and worse.
    parser.add_argument("--logra-kl", type=float, default=5e-4,
                        help="LoGRA's KL budget per step: its total budget is this times --steps")
    parser.add_argument("--dense-lr", type=float, default=1.5e-6)
    parser.add_argument("--lora-lr", type=float, default=4e-5)
    parser.add_argument("--apollo-lr", type=float, default=1.5e-6)
    parser.add_argument("--kl-prompts", type=int, default=64, help="held-out prompts of the KL(π‖π₀) measurement")
    parser.add_argument("--quick", action="store_true", help="see above")
    grid.add_options(parser, ROOT / "bench" / "out" / "tasks.json", ROOT / "bench" / "out" / "tasks_runs")
    args = parser.parse_args(argv)
    args.rows = grid.chosen_rows(args.rows, ROWS)
    if args.quick:
        args.steps, args.seeds, args.eval_size, args.survey_size, args.kl_prompts = 1, 1, 2, 2, 2
    grid.positive(args, "steps", "seeds", "eval_size", "survey_size", "kl_prompts")
    if not args.logra_kl > 0:  # NaN too
        raise SystemExit(f"--logra-kl must be a positive KL per step, got {args.logra_kl}")
    if args.survey:
        args.out = args.out.with_name(args.out.stem + "_survey.json")
        args.plot = args.plot.with_name(args.plot.stem + "_survey.png")
    return args


# ---- one run: a config built from configs/smollm2_reasoning.yaml ---------------------------------------------------

def kl_logger() -> dict:
    """A PredictedKLBudget that never binds (α = min(1, √(1e6/q)) = 1): it only logs each step's KL."""
    return {"class_path": "lightning_logra.callbacks.PredictedKLBudget",
            "init_args": {"budget": 1e6, "alpha_max": 1.0, "subset": 16}}


def run_config(run: dict, args: argparse.Namespace) -> dict:
    """The whole config of one run: the shipped config with the run's method, seed, steps and tasks."""
    config = yaml.safe_load(BASE_CONFIG.read_text())
    trainer, data = config["trainer"], config["data"]["init_args"]
    # A seed varies sampling and the sketches' projections; the items stay the config's (data.seed), so that every
    # row and seed is validated on the same held-out items as the base model's `start`.
    config["seed_everything"] = run["seed"]
    set_model(config, "sampling.seed", run["seed"])
    data["seed"] = data.get("seed", 0)
    trainer.update(max_steps=args.steps, val_check_interval=args.steps, enable_checkpointing=False,
                   enable_progress_bar=False)
    trainer["logger"]["init_args"].update(save_dir=str(args.runs_dir), name=run["name"])
    data["eval_size"] = args.eval_size
    if run.get("tasks") is not None:
        data["tasks"] = run["tasks"]
        # the config's context fits its own mix's prompts (84 tokens); other tasks' can be longer
        config["model"]["rollouts"]["engine"]["init_args"]["max_model_len"] = 512
    kinds = {callback["class_path"].rsplit(".", 1)[1]: callback for callback in trainer["callbacks"]}
    callbacks = [{"class_path": "lightning_logra.callbacks.KLFromStart",
                  "init_args": {"prompts": args.kl_prompts, "samples": 4}},
                 kinds["PredictedKLBudget"] if run["method"] == "logra" else kl_logger(), kinds["MemoryProfiler"]]
    if args.quick:  # the policy generates: no engine to start, and no reward process; groups of 4 (a CI check)
        set_model(config, "rollouts.engine", None)
        set_model(config, "scoring.timeout_s", None)
        set_model(config, "sampling.num_generations", 4)
    else:
        callbacks.append(kinds["RolloutWeightSync"])
    trainer["callbacks"] = callbacks
    method = run["method"]
    if method in ("dense", "apollo_mini"):
        peer = optimizer_dict(peers.spec("apollo_mini", RANK), run["lr"]) if method == "apollo_mini" else None
        trainer["strategy"] = dense_strategy(run["lr"], TARGETS, peer)
    elif method == "lora":
        trainer["strategy"] = lora_strategy(TARGETS, RANK, run["lr"], run["seed"])
    elif method == "logra":
        trainer["strategy"]["init_args"]["sketch"]["seed"] = run["seed"]
        kinds["PredictedKLBudget"]["init_args"]["total_budget"] = args.logra_kl * args.steps
    return config


def validate_config(run: dict, args: argparse.Namespace) -> dict:
    """The base model measured by `validate` (no step): the LoGRA config with only the engine's weight sync."""
    config = run_config({**run, "method": "logra"}, args)
    trainer = config["trainer"]
    trainer["callbacks"] = [c for c in trainer["callbacks"] if c["class_path"].endswith(".RolloutWeightSync")]
    return config


def command(run: dict, args: argparse.Namespace) -> list[str]:
    if run["method"] == "start":
        return grid.cli(validate_config(run, args), args.runs_dir, run["name"], "validate")
    return grid.cli(run_config(run, args), args.runs_dir, run["name"])


def kept(run: dict, args: argparse.Namespace) -> bool:
    """With --reuse: the run's config is the one it would be given now, and its log holds its evaluation."""
    config = validate_config(run, args) if run["method"] == "start" else run_config(run, args)
    return args.reuse and grid.finished(args.runs_dir, run["name"], config, 1)


def train(runs: list[dict], args: argparse.Namespace) -> list[dict]:
    """Every run not kept, one at a time with both cores (their seconds per step compare)."""
    todo = [run for run in runs if not kept(run, args)]
    done = {row["name"]: row for row in run_all(todo, lambda run: command(run, args), parallel=1, threads=2)}
    failed = [row for row in done.values() if "error" in row]
    if failed:
        raise SystemExit("runs failed: " + "; ".join(f"{row['name']}: {row['error']}" for row in failed))
    return [done.get(run["name"], run) for run in runs]


# ---- what a run measured --------------------------------------------------------------------------------------------

def last(values: dict[str, list[float]], key: str) -> float:
    return values[key][-1] if values.get(key) else math.nan


def per_task(values: dict[str, list[float]], tasks: list[str]) -> dict[str, dict[str, float]]:
    """{task: {pass@1, pass@8, mean@8}} at the run's last validation, and {"all": ...} over every task's items."""
    out = {"all": {k: last(values, f"val/{k}") for k in ("pass@1", "pass@8", "mean@8")}}
    for task in tasks:
        out[task] = {k: last(values, f"val/{task}/{k}") for k in ("pass@1", "pass@8", "mean@8")}
    return out


def measure(run: dict, args: argparse.Namespace, tasks: list[str]) -> dict:
    values = grid.read(args.runs_dir, run["name"])
    result = {**run, "validation": per_task(values, tasks)}
    if run["method"] in ("start", "survey"):
        return result
    rewards = values["train/reward_mean"]
    tenth = grid.tenth(rewards)

    def median(key: str, less: list[float] | None = None) -> float:
        """The median over steps of `key`, each step's value less that step's `less` where given."""
        per_step = values.get(key, [])
        if less is not None:
            if len(less) != len(per_step):
                raise SystemExit(f"{run['name']}: {len(per_step)} values of {key} but {len(less)} of kl/seconds")
            per_step = [value - other for value, other in zip(per_step, less)]
        finite = [v for v in per_step if math.isfinite(v)]
        return statistics.median(finite) if finite else math.nan

    # The KL check is part of LoGRA's step (its controller scales every update). The other rows run it only to log
    # their KL per step, which their users would not pay for: their step and update are timed without it.
    check = values.get("kl/seconds", [])
    logging_only = None if run["method"] == "logra" else [v if math.isfinite(v) else 0.0 for v in check]

    return {**result, "rewards": rewards,
            "task_rewards": {task: values.get(f"reward/{task}/mean", []) for task in tasks},
            "reward_first": statistics.fmean(rewards[:tenth]), "reward_last": statistics.fmean(rewards[-tenth:]),
            "kl_from_start": last(values, "val/kl_from_start"),
            "kl_per_step": grid.mean_std(values.get("kl/realized", []))[0],
            "peak_gib": max(values.get("memory/peak_gib", [math.nan])),
            "step_s": median("train/step_s", logging_only), "rollout_s": median("train/rollout_s"),
            "update_s": median("train/update_s", logging_only),
            "control_s": median("kl/seconds") if run["method"] == "logra" else math.nan,
            "sync_s": median("sync/seconds"),
            "sync_mib": median("sync/bytes") / 2**20}


# ---- the survey -----------------------------------------------------------------------------------------------------

def survey(args: argparse.Namespace) -> None:
    names = QUICK_CANDIDATES if args.quick else list(CANDIDATES)
    tasks = [{"name": name, "settings": CANDIDATES[name]} for name in names]
    args.eval_size = args.survey_size
    run = {"name": "survey", "row": "survey", "method": "start", "seed": 0, "tasks": tasks}
    train([run], args)
    result = measure({**run, "method": "survey"}, args, names)["validation"]
    chosen = {task["name"] for task in yaml.safe_load(BASE_CONFIG.read_text())["data"]["init_args"]["tasks"]}
    order = sorted(names, key=lambda name: -result[name]["pass@8"])
    rows = [[name + (" (chosen)" if name in chosen else ""), f"{CANDIDATES[name]}", f"{result[name]['pass@1']:.3f}",
             f"{result[name]['pass@8']:.3f}"] for name in order]
    evaluation = yaml.safe_load(BASE_CONFIG.read_text())["model"]["evaluation"]
    table = "\n".join([f"SmolLM2-135M-Instruct before training: {args.survey_size} held-out items per task, "
                       f"{evaluation['num_samples']} samples at temperature {evaluation['temperature']}, the answer "
                       "stated after 'The answer is' (0/1, the task's scorer)", "",
                       *grid.markdown(["task", "settings", "pass@1", "pass@8"], rows, left=2)])
    print(table)
    grid.write_report(args.out, {"survey": result, "candidates": CANDIDATES, "settings": grid.arguments(args)})
    args.out.with_suffix(".md").write_text(table + "\n")
    plt = pyplot()
    fig, axis = plt.subplots(figsize=(10, 4.5))
    axis.bar(range(len(order)), [result[name]["pass@8"] for name in order], label="pass@8")
    axis.bar(range(len(order)), [result[name]["pass@1"] for name in order], label="pass@1")
    axis.set_xticks(range(len(order)), order, rotation=40, ha="right", fontsize=8)
    axis.set(ylabel="held-out, before training", ylim=(0, 1))
    axis.legend()
    save_figure(fig, f"SmolLM2-135M-Instruct on reasoning-gym candidates ({evaluation['num_samples']} samples, "
                     f"T = {evaluation['temperature']})", args.plot)
    print(f"wrote {args.out} and {args.plot}", file=sys.stderr)


# ---- the comparison -------------------------------------------------------------------------------------------------

def comparison_runs(args: argparse.Namespace) -> list[dict]:
    lrs = {"logra": None, "dense": args.dense_lr, "lora": args.lora_lr, "apollo_mini": args.apollo_lr}
    runs = [{"name": "start", "row": "start", "method": "start", "seed": 0}]
    for row in args.rows:
        for seed in range(args.seeds):
            runs.append({"name": f"{row}_seed{seed}", "row": row, "method": row, "lr": lrs[row], "seed": seed})
    return runs


def summarize(results: list[dict], tasks: list[str]) -> dict[str, dict]:
    summary = {}
    for row in ["start", *ROWS]:
        rows = [r for r in results if r["row"] == row]
        if not rows:
            continue
        entry = {"label": LABELS[row], "seeds": len(rows), "lr": rows[0].get("lr")}
        for task in ["all", *tasks]:
            for metric in ("pass@1", "pass@8"):
                entry[f"{task}/{metric}"] = grid.mean_std([r["validation"][task][metric] for r in rows])
        if row != "start":
            entry |= grid.over_seeds(rows, ("reward_first", "reward_last", "kl_from_start", "kl_per_step", "peak_gib",
                                            "step_s", "rollout_s", "update_s", "control_s", "sync_s",
                                            "sync_mib"))
        summary[row] = entry
    return summary


def tables(summary: dict[str, dict], tasks: list[str], args: argparse.Namespace) -> str:
    start, evaluation = summary["start"], yaml.safe_load(BASE_CONFIG.read_text())["model"]["evaluation"]
    header = ["row", "lr"] + [f"{task} pass@1 / pass@8" for task in ["all", *tasks]]
    rows = []
    for row, e in summary.items():
        lr = "" if e["lr"] is None else f"{e['lr']:g}"
        cells = []
        for task in ["all", *tasks]:
            p1, p8 = e[f"{task}/pass@1"][0], e[f"{task}/pass@8"][0]
            gain = "" if row == "start" else (f" ({p1 - start[f'{task}/pass@1'][0]:+.3f} / "
                                              f"{p8 - start[f'{task}/pass@8'][0]:+.3f})")
            cells.append(f"{p1:.3f} / {p8:.3f}{gain}")
        rows.append([e["label"], lr, *cells])
    cost = [[e["label"], grid.pm(e["reward_first"]), grid.pm(e["reward_last"]), f"{e['kl_from_start'][0]:.2e}",
             f"{e['kl_per_step'][0]:.2e}", f"{e['peak_gib'][0]:.2f}", f"{e['step_s'][0]:.1f}",
             f"{e['rollout_s'][0]:.1f}", f"{e['update_s'][0]:.1f}",
             "" if math.isnan(e["control_s"][0]) else f"{e['control_s'][0]:.1f}", f"{e['sync_s'][0]:.2f}",
             f"{e['sync_mib'][0]:.1f}"] for row, e in summary.items() if row != "start"]
    return "\n".join([
        f"SmolLM2-135M-Instruct, {args.steps} steps, {args.seeds} seed(s); validation on {args.eval_size} held-out "
        f"items per task, {evaluation['num_samples']} samples at temperature {evaluation['temperature']} (change from "
        "the base model in brackets)", "",
        *grid.markdown(header, rows, left=2), "",
        *grid.markdown(["row", "reward, first tenth", "reward, last tenth", "KL(π‖π₀) at the end", "KL per step",
                        "peak GiB", "s / step", "generation s", "update s", "of which KL control s", "sync s",
                        "sync MiB"], cost), "",
        "The rows without KL control are timed without the KL check that only logs their KL per step."])


def plot(results: list[dict], summary: dict[str, dict], tasks: list[str], args: argparse.Namespace) -> None:
    plt = pyplot()
    fig, (reward_axis, pass_axis) = plt.subplots(1, 2, figsize=(16, 5.5))
    window = max(1, args.steps // 10)
    trained = [row for row in summary if row != "start"]
    colors = {"start": "0.6", **{row: f"C{i}" for i, row in enumerate(trained)}}  # a row's colour in both panels
    for row in trained:
        curves = [grid.moving_mean(r["rewards"], window) for r in results if r["row"] == row]
        reward_axis.plot(range(1, len(curves[0]) + 1), grid.mean_curve(curves), label=summary[row]["label"],
                         color=colors[row])
    reward_axis.set(xlabel="step", ylabel=f"sampled reward, all tasks (moving mean of {window} steps)")
    reward_axis.legend(fontsize=8)
    groups = ["all", *tasks]
    width = 0.8 / (len(trained) + 1)
    for i, row in enumerate(["start", *trained]):
        xs = [g + i * width for g in range(len(groups))]
        pass_axis.bar(xs, [summary[row][f"{task}/pass@8"][0] for task in groups], width, label=summary[row]["label"],
                      color=colors[row])
        pass_axis.scatter(xs, [summary[row][f"{task}/pass@1"][0] for task in groups], color="black", s=12, zorder=3)
    pass_axis.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups)
    pass_axis.set(ylabel="held-out pass@8 (bars), pass@1 (dots)", ylim=(0, 1))
    pass_axis.legend(fontsize=8)
    save_figure(fig, f"SmolLM2-135M-Instruct on reasoning-gym tasks: {args.steps} steps, {args.seeds} seed(s)",
                args.plot)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    if args.survey:
        survey(args)
        return
    tasks = [task["name"] for task in yaml.safe_load(BASE_CONFIG.read_text())["data"]["init_args"]["tasks"]]
    results = [measure(run, args, tasks) for run in train(comparison_runs(args), args)]
    summary = summarize(results, tasks)
    text = tables(summary, tasks, args)
    print(text)
    grid.write_report(args.out, {"summary": summary, "runs": results, "settings": grid.arguments(args)})
    args.out.with_suffix(".md").write_text(text + "\n")
    plot(results, summary, tasks, args)
    print(f"wrote {args.out} and {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
