"""The reward–KL frontier on add3: what each method reaches for the distance it moves the policy from its start.

    python -m bench.frontier            # every row, 400 steps, 3 paired seeds (5 for dense and the best controlled
                                        # LoGRA row), 46 runs: about 1 h 46 min alone on 2 cores; and the 7 peers
                                        # at one learning rate, 21 runs more (--peers "" leaves them out)
    python -m bench.frontier --quick    # every kind of row at 4 steps, 1 seed, 64 held-out items, the reward
                                        # scored in the trainer's process: checks the script (CI); of the rows
                                        # that differ only by a number, dense at 1e-4, LoGRA uncontrolled at 1e-3,
                                        # δ 0.1× and 1×, and one peer (GaLore): 12 runs, not 22

`bench.quality` compares methods at equal steps, each at its best learning rate. RL methods are compared on the
frontier instead: greedy pass@1 and sampled reward against KL(π_t ‖ π_0), measured every `--every` steps by
`lightning_logra.callbacks.KLFromStart` (the mean per-token exact KL from a frozen copy of the starting policy on
completions the current policy samples for 256 held-out prompts × 4; measured, not the sum of per-step KLs, since
steps that point the same way compound). A method whose curve lies above another's reaches more for the same
distance. Every run is `python cli.py fit` of a config built from configs/add3.yaml by bench/lib/add3.py's
`run_config`, with its `--reward-in-trainer` (paired seeds: seed s gives every row the same prompts, sampling noise,
projections and adapters).

Rows (learning rates: bench/quality.py's best per method on the same task):
- dense AdamW on the target matrices (what LoGRA and LoRA train), 1e-4 and 3e-4, and at 1e-4 with TRL's KL penalty
  to π_0 (`model.loss.beta` 0.04): the penalty is what the predicted-KL controller is the paper's alternative to;
- LoRA rank 16 at 1e-3, and LoRA rank 1 at 10× dense's rate ("LoRA Without Regret": small-rank LoRA at about 10× the
  full fine-tuning rate matches it in RL);
- LoGRA rank 16 uncontrolled at its grid 3e-4 / 1e-3 / 3e-3 (α = 1: a budget that never binds logs the per-step KL);
- LoGRA rank 16 at 1e-3 under a constant predicted-KL budget δ = 0.1×, 0.3× and 1× the per-step KL of the
  uncontrolled 1e-3 runs in bench/quality.py (1.8e-2), α_max 4;
- LoGRA rank 16 under a total budget (`PredictedKLBudget.total_budget`: Σ `kl/realized` over the run, spread over the
  remaining steps), set to what the best constant-δ row spent: the budget form that needs no per-step δ, against the
  hand-tuned one;
- the paper's pair, done fairly: LoRA at a constant 2e-4 against LoGRA under a total budget equal to LoRA's measured
  Σ `kl/realized` (mean over seeds), both placed on the frontier by their measured KL(π_t ‖ π_0);
- the optimizers a user would pick instead (`--peers`, bench/lib/peers.py: GaLore, Fira, APOLLO, APOLLO-Mini, Flora,
  Adafactor, 8-bit AdamW at their papers' settings, rank --rank where they have one), each through
  `trainer.strategy.init_args.dense.optimizer` on the target matrices at `--peer-lrs` (default dense's 1e-4),
  uncontrolled as dense is; a peer whose package does not import here is left out, saying so.

Reported per row (mean ± std over seeds): where it ends (KL from π_0, greedy pass@1, sampled reward over the last
tenth), Σ `kl/realized`, and pass@1's paired difference from dense **at equal measured KL**: for each seed, dense's
frontier there: the best pass@1 any dense row (1e-4; 3e-4, to carry it further out; 1e-4 with the KL penalty; a
point every `--every` steps from the start's (0, pass@1₀)) reached within the row's final KL from π_0, between
measurements interpolated along each curve; a row that moved further than dense ever did is compared with dense's best
point and marked. With peer rows, also the paired difference from the peers' frontier at equal measured KL (the best
any of the other peer rows reached there, found the same way): "within 0.02 of the best of them" is a statement about
it. JSON and plot under bench/out/.

    python -m bench.frontier --rows 'logra_total,peer_*' --total-budget 2.2 --more-seeds 3
                                        # a subset: the peers against dense's rows (which always run) and LoGRA's
                                        # total budget at the Σ docs/results/frontier.md's constant-δ rows set, 33 runs
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import statistics
import sys

from bench.lib import add3, grid, peers
from bench.lib.configs import optimizer_dict, set_model
from bench.lib.plotting import pyplot, save_figure
from bench.lib.runs import ROOT, add_reward_option

DENSE_LR, LORA_LR, LOGRA_LR = 1e-4, 1e-3, 1e-3  # bench/quality.py's best on add3 (docs/results/task-performance.md)
FAST_DENSE_LR = 3e-4  # dense at the next rate of quality.py's grid: its curve carries dense's frontier further out
LOGRA_GRID = [3e-4, 1e-3, 3e-3]
UNCONTROLLED_KL = 1.8e-2  # LoGRA rank 16 at 1e-3, uncontrolled: realized KL per step in bench/quality.py
FRACTIONS = [0.1, 0.3, 1.0]  # the constant budgets δ, as fractions of UNCONTROLLED_KL
QUICK_FRACTIONS = [0.1, 1.0]  # --quick: two, so that the best controlled row is still a choice
BETA = 0.04  # TRL's long-standing default for its KL penalty
ALPHA_MAX = 4.0  # as configs/add3.yaml: lets the controller enlarge steps too
START = {"method": "dense_targets", "lr": DENSE_LR}  # the config the start's validation takes (it takes no step)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=50, help="steps between measurements (pass@1, KL from π_0)")
    parser.add_argument("--seeds", type=int, default=3, help="paired seeds per row (0, 1, ...)")
    parser.add_argument("--more-seeds", type=int, default=5, help="seeds of dense and of the best controlled row")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=256, help="held-out prompts of the KL measurement")
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt of the KL measurement")
    parser.add_argument("--eval-limit", type=int, default=None, help="held-out items of pass@1 (default: all 2,054)")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--quick", action="store_true",
                        help="4 steps, 1 seed, 64 held-out items, 16 KL prompts; of the rows that differ only by a "
                             f"number, dense at {DENSE_LR:g}, LoGRA uncontrolled at {LOGRA_LR:g} and δ "
                             + " and ".join(f"{f:g}×" for f in QUICK_FRACTIONS) + "; --reward-in-trainer")
    parser.add_argument("--peers", default=",".join(peers.PEERS),
                        help="comma-separated, from " + ", ".join(peers.PEERS) + " (--quick: galore); empty: none")
    parser.add_argument("--peer-lrs", default=f"{DENSE_LR:g}", help="comma-separated learning rates of every peer")
    parser.add_argument("--rows", default="*",
                        help="comma-separated patterns (fnmatch) of the rows to run, e.g. 'logra_total,peer_*'; "
                             "dense's rows always run, since every row is placed against their frontier")
    parser.add_argument("--total-budget", type=float, default=None,
                        help="the total-budget row's Σ, for --rows without the constant-δ rows it is otherwise set "
                             "from (docs/results/frontier.md: 2.2)")
    add_reward_option(parser)
    grid.add_options(parser, ROOT / "bench" / "out" / "frontier.json", ROOT / "bench" / "out" / "frontier_runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.every, args.seeds, args.more_seeds = 4, 2, 1, 1
        args.eval_limit, args.prompts, args.reward_in_trainer = args.eval_limit or 64, 16, True
        args.peers = "galore"
    args.peers = [name for name in args.peers.split(",") if name]
    unknown = sorted(set(args.peers) - set(peers.PEERS))
    if unknown:
        raise SystemExit(f"--peers: unknown {unknown}; choose from {', '.join(peers.PEERS)}")
    args.peer_lrs = [float(lr) for lr in args.peer_lrs.split(",")]
    args.rows = args.rows.split(",")
    if selected("logra_total", args) and not selected("logra_delta0.3", args) and args.total_budget is None:
        raise SystemExit("--rows: logra_total without the logra_delta* rows needs --total-budget (its Σ)")
    grid.positive(args, "steps", "every", "seeds", "more_seeds", "rank", "prompts", "samples", "parallel")
    if args.steps % args.every:
        raise SystemExit(f"--steps ({args.steps}) must be a multiple of --every ({args.every})")
    args.evals = args.steps // args.every  # what add3.run_config reads
    return args


# ---- the runs -------------------------------------------------------------------------------------------------------

def selected(row: str, args: argparse.Namespace) -> bool:
    return row in DENSE_ROWS or any(fnmatch.fnmatchcase(row, pattern) for pattern in args.rows)


def budget_callback(run: dict) -> dict:
    """The run's PredictedKLBudget: a constant δ, a total, or (uncontrolled) one that never binds and only logs."""
    if run.get("delta") is not None:
        settings = {"budget": run["delta"], "alpha_max": ALPHA_MAX}
    elif run.get("total") is not None:
        settings = {"total_budget": run["total"], "alpha_max": ALPHA_MAX}
    else:
        settings = {"budget": 1e6, "alpha_max": 1.0}  # α = min(1, √(1e6/q)) = 1
    return {"class_path": "lightning_logra.callbacks.PredictedKLBudget", "init_args": {**settings, "subset": 16}}


def run_config(run: dict, args: argparse.Namespace) -> dict:
    config = add3.run_config(run, args)
    config["trainer"]["callbacks"] = [
        {"class_path": "lightning_logra.callbacks.KLFromStart",
         "init_args": {"prompts": args.prompts, "samples": args.samples}},
        budget_callback(run)]
    if run.get("beta"):
        set_model(config, "loss.beta", run["beta"])
    if run.get("peer"):  # a dense_targets run: the peer optimizes what dense AdamW would
        dense = config["trainer"]["strategy"]["init_args"]["dense"]
        dense["optimizer"] = optimizer_dict(peers.spec(run["peer"], run["rank"]), run["lr"])
    return config


def spec(row: str, method: str, seeds: int, **settings) -> list[dict]:
    """A row's runs, one per seed; `settings` are what add3.run_config and run_config read."""
    base = dict(row=row, method=method, rank=settings.pop("rank", 16), distribution="rademacher", refresh_every=None)
    return [dict(base, **settings, seed=seed, name=f"{row}_seed{seed}") for seed in range(seeds)]


def first_rows(args: argparse.Namespace) -> list[dict]:
    """The rows that need nothing measured first; the pair's LoRA first, since two later rows are set from it.
    --quick leaves out the rows that differ from one it keeps only by a number: dense at FAST_DENSE_LR, the LoGRA
    grid but LOGRA_LR, and the δ fractions but QUICK_FRACTIONS (every kind of row still runs)."""
    more, seeds = args.more_seeds, args.seeds
    runs = spec("pair_lora", "lora", seeds, lr=add3.PAPER_LORA_LR, rank=args.rank)
    runs += spec("dense", "dense_targets", more, lr=DENSE_LR)
    if not args.quick:
        runs += spec(f"dense_lr{FAST_DENSE_LR:g}", "dense_targets", seeds, lr=FAST_DENSE_LR)
    runs += spec("lora", "lora", seeds, lr=LORA_LR, rank=args.rank)
    runs += spec("lora_rank1", "lora", seeds, lr=10 * DENSE_LR, rank=1)
    for fraction in QUICK_FRACTIONS if args.quick else FRACTIONS:
        runs += spec(f"logra_delta{fraction:g}", "logra", seeds, lr=LOGRA_LR, rank=args.rank,
                     delta=fraction * UNCONTROLLED_KL)
    for lr in [LOGRA_LR] if args.quick else LOGRA_GRID:
        runs += spec(f"logra_lr{lr:g}", "logra", seeds, lr=lr, rank=args.rank)
    for name in args.peers:
        if reason := peers.missing(name):
            print(f"peer {name} left out: {reason}", file=sys.stderr)
            continue
        for lr in args.peer_lrs:
            runs += spec(f"peer_{name}_lr{lr:g}", "dense_targets", seeds, lr=lr, rank=args.rank, peer=name)
    return [run for run in runs if selected(run["row"], args)]


def second_rows(args: argparse.Namespace, measured: dict[str, list[dict]]) -> list[dict]:
    """The best constant-δ row's extra seeds, the total budget at what it spent (or at --total-budget), the pair's
    LoGRA at LoRA's Σ, and dense with the KL penalty: those of them --rows selects and whose references ran."""
    constant = [row for row in measured if row.startswith("logra_delta")]
    runs, spent = [], args.total_budget
    if constant:
        best = best_controlled(measured)
        delta = measured[best][0]["delta"]
        runs += [run for run in spec(best, "logra", args.more_seeds, lr=LOGRA_LR, rank=args.rank, delta=delta)
                 if run["seed"] >= args.seeds]
        if spent is None:
            spent = statistics.fmean(r["kl_sum"] for r in measured[best])
    if spent is not None:
        runs += spec("logra_total", "logra", args.seeds, lr=LOGRA_LR, rank=args.rank, total=spent)
    if "pair_lora" in measured:
        lora_spent = statistics.fmean(r["kl_sum"] for r in measured["pair_lora"])
        runs += spec("pair_logra_total", "logra", args.seeds, lr=LOGRA_LR, rank=args.rank, total=lora_spent)
    runs += spec("dense_beta", "dense_targets", args.seeds, lr=DENSE_LR, beta=BETA)
    return [run for run in runs if selected(run["row"], args)]


def best_controlled(measured: dict[str, list[dict]]) -> str:
    rows = [row for row in measured if row.startswith("logra_delta")]
    return max(rows, key=lambda row: statistics.fmean(r["pass_at_1"] for r in measured[row]))


# ---- what each run measured ---------------------------------------------------------------------------------------

def measure(run: dict, args: argparse.Namespace, start: float) -> dict:
    values = grid.read(args.runs_dir, run["name"])
    rewards, kl = values["train/reward_mean"], [k for k in values.get("kl/realized", []) if math.isfinite(k)]
    tenth = grid.tenth(rewards)
    reward_at = [statistics.fmean(rewards[max(0, s - tenth):s]) for s in range(args.every, args.steps + 1,
                                                                                 args.every)]
    return {**run, "kl_curve": [0.0] + values["val/kl_from_start"], "pass_curve": [start] + values["val/pass@1"],
            "reward_curve": [statistics.fmean(rewards[:tenth])] + reward_at,
            "pass_at_1": values["val/pass@1"][-1], "kl_from_start": values["val/kl_from_start"][-1],
            "reward_last": statistics.fmean(rewards[-tenth:]), "kl_sum": sum(kl)}


DENSE_ROWS = ("dense", f"dense_lr{FAST_DENSE_LR:g}", "dense_beta")  # dense's frontier: the best any of them reached


def frontier_at(curves: list[tuple[list[float], list[float]]], kl: float) -> tuple[float, bool]:
    """The best pass@1 that any of `curves` ((KL, pass@1) measurements in the order taken) reached within KL `kl`:
    the best of its points at KL ≤ `kl` and of its segments interpolated at `kl` (a run's KL from the start need not
    grow monotonically); and whether `kl` lay beyond every curve's reach (then the best point of all, marked)."""
    best, beyond = -math.inf, kl > max(max(k) for k, _ in curves)
    for kls, passes in curves:
        for (k0, p0), (k1, p1) in zip(zip(kls, passes), zip(kls[1:], passes[1:])):
            if min(k0, k1) <= kl <= max(k0, k1):
                best = max(best, p0 if k1 == k0 else p0 + (p1 - p0) * (kl - k0) / (k1 - k0))
        best = max([best] + [p for k, p in zip(kls, passes) if k <= kl or beyond])
    return best, beyond


def frontier_of(measured: dict[str, list[dict]], rows: list[str], seed: int, kl: float) -> tuple[float, bool]:
    """The frontier of `rows` at KL `kl` on seed `seed`: the best pass@1 any of their runs reached within that
    distance of the start (`frontier_at`)."""
    return frontier_at([(r["kl_curve"], r["pass_curve"]) for row in rows for r in measured.get(row, [])
                        if r["seed"] == seed], kl)


def summarize(measured: dict[str, list[dict]]) -> dict[str, dict]:
    """Per row: its ends over seeds and its paired difference from dense's frontier (its rows: both learning rates,
    or the one --quick runs, and the KL penalty's) at the row's own final KL; with peer rows, also from the peers'
    frontier (the best any optimizer a user would pick instead reached within that distance, the row's own left
    out)."""
    seeds = {r["seed"] for r in measured["dense"]}
    peer_rows = [row for row in measured if row.startswith("peer_")]
    summary = {}
    for row, results in measured.items():
        differences, beyond, from_peers = [], 0, []
        others = [peer for peer in peer_rows if peer != row]
        for r in results:
            if r["seed"] not in seeds:
                continue
            value, past = frontier_of(measured, DENSE_ROWS, r["seed"], r["kl_from_start"])
            differences.append(r["pass_at_1"] - value)
            beyond += past
            if others:
                from_peers.append(r["pass_at_1"] - frontier_of(measured, others, r["seed"], r["kl_from_start"])[0])
        entry = {"seeds": len(results), "vs_dense_at_kl": grid.mean_se(differences), "beyond_dense": beyond}
        if from_peers:
            entry["vs_peers_at_kl"] = grid.mean_se(from_peers)
        entry |= grid.over_seeds(results, ("pass_at_1", "kl_from_start", "reward_last", "kl_sum"))
        for key in ("lr", "delta", "total", "beta", "rank"):
            if results[0].get(key) is not None:
                entry[key] = results[0][key]
        summary[row] = entry
    return summary


LABELS = {"dense": "dense AdamW, targets", f"dense_lr{FAST_DENSE_LR:g}": f"dense AdamW, targets, {FAST_DENSE_LR:g}",
          "dense_beta": f"dense AdamW + KL penalty β {BETA:g}",
          "lora": "LoRA r16", "lora_rank1": "LoRA r1, 10× dense lr", "pair_lora": "LoRA r16, 2e-4 (paper's pair)",
          "logra_total": "LoGRA r16, total budget", "pair_logra_total": "LoGRA r16, total = LoRA 2e-4's (pair)"}


def label(row: str, entry: dict) -> str:
    if row in LABELS:
        return LABELS[row]
    if row.startswith("logra_delta"):
        return f"LoGRA r16, δ {entry['delta']:.1e}"
    if row.startswith("peer_"):
        return f"{row.removeprefix('peer_').rsplit('_lr', 1)[0]} (trainer.strategy.init_args.dense.optimizer), targets"
    return f"LoGRA r16, uncontrolled, lr {entry['lr']:g}"


def sketch_cosines(ranks: list[int], seeds: int = 3) -> dict[int, float]:
    """{rank: mean over add3's target matrices and `seeds` projections of cos(G, S·A)}: how much of the gradient a
    sketch of that rank sees (one policy-gradient batch of random tokens through the shipped add3 model, float32).
    A step along S·A spends KL in every direction it moves, and makes first-order progress only along G."""
    import torch
    from transformers import AutoModelForCausalLM

    from bench.lib.cosines import dense_gradients, reconstruction_cosines
    from bench.lib.policy_step import fixed_batch
    from lightning_logra.paths import model_path

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path("lightning_logra/data/add3"), dtype=torch.float32)
    batch = fixed_batch(argparse.Namespace(seed=0, batch=8, group=4, prompt_len=8, completion_len=5),
                        model.config.vocab_size)
    gradients = dense_gradients(model, batch)
    cosines = {}
    for rank in ranks:
        per_seed = [reconstruction_cosines(model, batch, gradients, rank, "rademacher", seed)
                    for seed in range(seeds)]
        cosines[rank] = statistics.fmean(statistics.fmean(c.values()) for c in per_seed)
    return cosines


def kept_sketch_cosines(args: argparse.Namespace) -> dict[int, float]:
    """`sketch_cosines` at --rank and 4× it, kept beside the runs: with --reuse they are read back, not computed
    again (they depend on the shipped model alone), so that a rerun that trains nothing builds no model either."""
    path, ranks = args.runs_dir / "sketch_cosines.json", [args.rank, 4 * args.rank]
    if args.reuse and path.exists():
        kept = {int(rank): cosine for rank, cosine in json.loads(path.read_text()).items()}
        if list(kept) == ranks:
            return kept
    cosines = sketch_cosines(ranks)
    path.write_text(json.dumps(cosines) + "\n")
    return cosines


def table(summary: dict[str, dict], start: float, args: argparse.Namespace) -> str:
    peers_ran = any("vs_peers_at_kl" in e for e in summary.values())
    rows = []
    for row, e in summary.items():
        setting = ", ".join(f"{k} {e[k]:.3g}" for k in ("lr", "delta", "total", "beta") if k in e)
        mark = f" ({e['beyond_dense']} beyond dense's reach)" if e["beyond_dense"] else ""
        cells = [label(row, e), setting, str(e["seeds"]), grid.pm(e["kl_from_start"]), grid.pm(e["kl_sum"]),
                 grid.pm(e["pass_at_1"]), grid.pm(e["vs_dense_at_kl"]) + mark]
        if peers_ran:
            cells.append(grid.pm(e["vs_peers_at_kl"]) if "vs_peers_at_kl" in e else "")
        rows.append([*cells, grid.pm(e["reward_last"])])
    header = ["row", "setting", "seeds", f"KL(π_{args.steps} ‖ π_0)", "Σ kl/realized", "greedy pass@1",
              "vs dense at equal KL, paired (± s.e.)"]
    header += ["vs the peers' frontier at equal KL"] if peers_ran else []
    header.append("sampled reward, last tenth")
    return "\n".join([f"greedy pass@1 at the start: {start:.3f}", "", *grid.markdown(header, rows, left=2)])


def plot(measured: dict[str, list[dict]], summary: dict[str, dict], args: argparse.Namespace) -> None:
    plt = pyplot()
    fig, (pass_axis, reward_axis) = plt.subplots(1, 2, figsize=(16, 6.5))
    # A linear KL axis up to the rows that stayed near the others; a row that ran far off (a collapse) is named,
    # not drawn, so that the rest stay readable.
    ends = {row: statistics.fmean(r["kl_from_start"] for r in results) for row, results in measured.items()}
    near = [kl for kl in ends.values() if kl < 4 * statistics.median(ends.values())]
    for index, (row, results) in enumerate(measured.items()):
        name = label(row, summary[row])
        if ends[row] not in near:
            name += f" (off the axis: KL {ends[row]:.1f}, pass@1 {summary[row]['pass_at_1'][0]:.2f})"
        kl = grid.mean_curve([r["kl_curve"] for r in results])
        style = "--" if row.startswith(("pair", "dense_beta")) else (":" if row.startswith("logra_lr") else "-")
        width = 2.5 if row in DENSE_ROWS else 1.2
        for axis, key in ((pass_axis, "pass_curve"), (reward_axis, "reward_curve")):
            axis.plot(kl, grid.mean_curve([r[key] for r in results]), style, color=plt.cm.tab20(index % 20),
                      marker="o", markersize=3, linewidth=width, label=name)
    for axis, name in ((pass_axis, "greedy pass@1, held-out"), (reward_axis, "sampled reward (moving mean)")):
        axis.set(xlabel="KL(π_t ‖ π_0), per token, measured", ylabel=name, xlim=(0, 1.1 * max(near)))
    pass_axis.legend(fontsize=7)
    save_figure(fig, f"reward–KL frontier on add3: a point every {args.every} steps, mean over paired seeds",
                args.plot)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    first = first_rows(args)
    add3.train([add3.start_run(args), *first], args, run_config, START)
    start = grid.read(args.runs_dir, "start")["val/pass@1"][-1]
    measured: dict[str, list[dict]] = {}
    for run in first:
        measured.setdefault(run["row"], []).append(measure(run, args, start))
    second = second_rows(args, measured)
    add3.train(second, args, run_config, START)
    for run in second:
        measured.setdefault(run["row"], []).append(measure(run, args, start))
    summary = summarize(measured)
    cosines = kept_sketch_cosines(args)
    print(table(summary, start, args))
    print("cos(G, S·A) on add3's model: " + ", ".join(f"rank {r} {c:.3f}" for r, c in cosines.items()))
    grid.write_report(args.out, {"start_pass_at_1": start, "summary": summary, "runs": measured,
                                 "sketch_cosines": cosines, "settings": grid.arguments(args)})
    plot(measured, summary, args)
    print(f"wrote {args.out} and {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
