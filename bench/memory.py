"""Memory and time of one RL update per method, side by side on the same model and the same rollouts.

    python -m bench.memory                                   # Qwen2.5-0.5B shape, fp32, all six methods
    python -m bench.memory --shape 1.5b --dtype bf16 --methods logra,lora --out bench/out/memory_1_5b.json

Generation is left out: every method trains on the same fixed prompts, completions and advantages, built from
`--seed`. The model is a `transformers` Qwen2 with random weights in the shape of the chosen Qwen2.5 size (the
memory and the time of a step do not depend on the weights' values). Each method runs in its own subprocess
(`python -m bench.memory ... --worker`: bench/lib/memory_worker.py), so that memory one method held, or an allocator
kept, never shows up in another's numbers, and so that one that runs out of memory fails alone.

With `--dtype bf16` the methods that update weights with AdamW (dense AdamW on everything or on the targets, GaLore)
keep fp32 master weights and run the forward under bf16 autocast, as `precision: bf16-mixed` does: AdamW stepping
bf16 weights rounds each update to nearest and loses most of it at RL learning rates, so that would not be a fair
baseline. LoRA keeps the base weights in bf16 (peft holds its adapters in fp32) and LoGRA trains the bf16 weights
themselves (its merge rounds stochastically). The table's "weights" column says which.

A step is the forward, loss, backward over all micro-batches, the optimizer step and zero_grad: the loss and its
passes are the training step's own objective (`lightning_logra.train.objective.PolicyGradient`: dapo at temperature 1,
its log-probs `--logprob-chunk` tokens at a time, the token entropy it logs), every sample through the backward
passes (as in a batch whose every group is learnable), the sampler correction off (the rollouts have no sampler).
Memory is the process's resident set size sampled during each step: the peak is the maximum over all steps (the first
included, where the optimizers allocate their state), the average and the median step time leave the first step out.

`--device cuda` builds the model on the GPU and measures with the CUDA allocator instead, as
`lightning_logra.callbacks.MemoryProfiler` does on a GPU: the average samples `torch.cuda.memory_allocated` (the
bytes tensors hold, not what the caching allocator keeps in reserve), the peak is `torch.cuda.max_memory_allocated`
since before the first step (exact, where samples can miss a short spike), and each step ends with
`torch.cuda.synchronize` so that its time is the GPU's, not the time to queue its kernels.

`--kl-check N` adds the predicted-KL controller's work to the LoGRA steps, as `PredictedKLBudget` does it: q of the
proposal on N responses, α = min(1, √(δ/q)), the intended KL for bf16 weights, and the realized KL after the merge;
its seconds are reported beside the step's (`kl_s`, `kl_share`). `dense_adamw_meta` is dense AdamW where it cannot
run: the model is built on the meta device (no memory) and its row is the floor of what dense AdamW holds, 16 bytes
per parameter (fp32 weights or master weights, fp32 gradients, two fp32 moments), before any activation.

    # the headline: one full-depth 7B-shape LoGRA step in bf16 with 1,024-token completions, KL check on
    python -m bench.memory --shape 7b --dtype bf16 --methods logra_adam,dense_adamw_meta --batch 2 --group 2 \
        --micro-batch 1 --completion-len 1024 --steps 1 --kl-check 1 --gradient-checkpointing

Every row of the worker's own loop also gives `saved_bytes`: the bytes autograd saves for the backward pass during
one micro-batch's forward and loss (each storage once, weights left out; `saved_activation_bytes`), counted exactly
after the timed steps, so it neither disturbs them nor depends on the allocator. `logra_shared` and
`logra_adam_shared` are `logra` and `logra_adam` with one projection per input (`sketch.share_projection`: q/k/v and
gate/up of a layer share A, and their x·Aᵀ is computed and saved once): beside them in one invocation they measure
what sharing saves, e.g. `--methods logra_adam,logra_adam_shared`. `--saved-bytes-only` counts `saved_bytes` alone
(one forward per method, no step, nothing timed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from bench.lib import peers
from bench.lib.memory_rows import EXTRA_METHODS, LIGHTNING_METHODS, METHODS, PEER_METHODS, PEERS_RUN, run_method
from bench.lib.memory_worker import run_worker
from bench.lib.plotting import pyplot, save_figure
from bench.lib.shapes import DTYPES, SHAPES, is_target, qwen2_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="0.5b")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated, from " + ", ".join(METHODS + EXTRA_METHODS) + "; or `peers`: "
                        + ", ".join(PEERS_RUN))
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every row this many times, each round in another order (the rows rotated), and "
                             "report each row's spread: a row run later in a process tree measures slower")
    parser.add_argument("--at-shapes", help="comma-separated shapes (7b,32b): no step is run; each method's state "
                        "bytes per trained matrix are counted from one real optimizer step on one matrix of each "
                        "shape, and the weights, gradients and states of the whole model added up")
    # A sketch's rank must stay below every target's in_features (LoRA and GaLore need it below both sides:
    # k_proj and v_proj are only 128 rows in 0.5B, 2 kv heads × 64, and 64 in tiny).
    parser.add_argument("--rank", type=int, help="of LoRA, GaLore and the sketches; default 64, 16 for tiny")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the shape's); fewer keep a "
                        "long-sequence, full-vocabulary step short where the logits are what is measured")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--group", type=int, default=4, help="samples per prompt (advantages are group-normalized)")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--completion-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5, help="the first one is warm-up (with 1, it is measured)")
    parser.add_argument("--kl-check", type=int, default=0, metavar="N",
                        help="LoGRA steps run the predicted-KL check on N responses (0: off)")
    parser.add_argument("--kl-budget", type=float, default=2e-4, help="δ of the KL check (the Qwen configs' start)")
    parser.add_argument("--logprob-chunk", type=int, default=256,
                        help="tokens whose full-vocabulary logits exist at a time (the trainer's "
                             "model.training.logprob_chunk_tokens); 0: the whole micro-batch's (m, C, V) logits at "
                             "once")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="recompute activations in the backward pass (model.training.gradient_checkpointing in a "
                             "config)")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed steps, one more under torch.profiler: the ops that took the most time "
                             "and the sketch's own ranges (its projections x·Aᵀ and contractions δᵀz)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the model on the GPU, memory from the CUDA allocator (else process RSS)")
    parser.add_argument("--processes", type=int, default=2, help="of logra_ddp and logra_fsdp (gloo on the CPU, "
                        "nccl on GPUs)")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/out/memory.json"))
    parser.add_argument("--plot", type=Path, default=Path("bench/out/memory.png"))
    parser.add_argument("--no-plot", action="store_true", help="no plot (matplotlib need not be installed)")
    parser.add_argument("--saved-bytes-only", action="store_true",
                        help="only count each method's bytes saved for the backward pass (no steps, no timing)")
    # set by the parent for a worker
    parser.add_argument("--method", choices=METHODS + EXTRA_METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.rank = args.rank or (16 if args.shape == "tiny" else 64)
    args.methods = list(PEERS_RUN) if args.methods == "peers" else args.methods.split(",")
    unknown = sorted(set(args.methods) - set(METHODS + EXTRA_METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {', '.join(METHODS + EXTRA_METHODS)}")
    if args.batch % args.group or args.batch % args.micro_batch:
        parser.error("--batch must be a multiple of --group and of --micro-batch")
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1")
    if not 0 <= args.kl_check <= args.batch:
        parser.error(f"--kl-check must be between 0 and --batch ({args.batch}), got {args.kl_check}")
    if args.saved_bytes_only:
        args.no_plot = True
        if set(LIGHTNING_METHODS) & set(args.methods):
            parser.error(f"--saved-bytes-only: {', '.join(LIGHTNING_METHODS)} are measured by a Trainer's "
                         "MemoryProfiler, not counted")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False)")
    return args


# ---------------------------------------------------------------- parent: one subprocess per method, then report


def run_rounds(methods: list[str], argv: list[str], rounds: int) -> list[dict]:
    """Every method's row, measured `rounds` times, round i in the order of `methods` rotated by i/rounds of its
    length, so that no row always runs first or last; one row per method (`combine`)."""
    measured_rows: dict[str, list[dict]] = {method: [] for method in methods}
    for round_ in range(rounds):
        shift = round_ * len(methods) // rounds
        for method in methods[shift:] + methods[:shift]:
            measured_rows[method].append(run_method(method, argv))
    return [combine(rows) for rows in measured_rows.values()]


def combine(rows: list[dict]) -> dict:
    """One method's rounds as one row: the largest peak, the mean average, the median of the rounds' median step
    times with every round's (`step_s_rounds`); an error row when no round ran."""
    ran = [row for row in rows if "error" not in row]
    if len(rows) == 1 or not ran:
        return rows[0]
    row = dict(ran[0])
    row.update(peak_gib=max(r["peak_gib"] for r in ran), avg_gib=statistics.mean(r["avg_gib"] for r in ran),
               rounds=len(ran))
    if "step_s" in row:
        row.update(step_s=statistics.median(r["step_s"] for r in ran), step_s_rounds=[r["step_s"] for r in ran])
    return row


def ratio(value: float | None, reference: dict | None, key: str) -> str:
    if value is None or reference is None or key not in reference:
        return "–"
    return f"{value / reference[key]:.2f}"


def _number(row: dict, key: str, scale: float = 1.0) -> str:
    return f"{row[key] / scale:.2f}" if key in row else "–"


def markdown_table(rows: list[dict]) -> str:
    # Against dense AdamW as it ran, else against its floor from the meta device (a ratio to a lower bound).
    reference = next((row for row in rows if row["method"] == "dense_adamw"), None)
    reference = reference or next((row for row in rows if row["method"] == "dense_adamw_meta"), None)
    name = reference["method"] if reference else "dense_adamw"
    lines = [
        "| method | weights | peak GiB | avg GiB | median step s (rounds: min–max) | optimizer state MiB | KL check "
        f"share of step | saved for backward, MiB per micro-batch | peak vs {name} | step time vs {name} |"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['method']} | | error: {row['error']} | | | | | | | |")
            continue
        spread = (f" ({min(row['step_s_rounds']):.2f}–{max(row['step_s_rounds']):.2f})"
                  if "step_s_rounds" in row else "")
        lines.append(
            f"| {row['method']} | {row.get('weights', '')} | {_number(row, 'peak_gib')} | {_number(row, 'avg_gib')} "
            f"| {_number(row, 'step_s')}{spread} | {_number(row, 'state_mib')} | {_number(row, 'kl_share')} "
            f"| {_number(row, 'saved_bytes', 2**20)} | {ratio(row.get('peak_gib'), reference, 'peak_gib')} "
            f"| {ratio(row.get('step_s'), reference, 'step_s')} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], title: str, path: Path, device: str = "cpu") -> None:
    plt = pyplot()

    names = [row["method"] for row in rows]
    x = range(len(rows))

    def values(key: str) -> list[float]:
        return [row.get(key, float("nan")) for row in rows]  # a failed method, or one that did not run: no bar

    fig, (mem, speed) = plt.subplots(1, 2, figsize=(12, 4.5))
    mem.bar([i - 0.2 for i in x], values("peak_gib"), width=0.4, label="peak")
    mem.bar([i + 0.2 for i in x], values("avg_gib"), width=0.4, label="average")
    mem.set_ylabel("CUDA allocated during a step, GiB" if device == "cuda" else "process RSS during a step, GiB")
    mem.legend()
    speed.bar(x, values("step_s"), color="tab:green")
    speed.set_ylabel("median step, s")
    for axis in (mem, speed):
        axis.set_xticks(list(x), names, rotation=30, ha="right")
    save_figure(fig, title, path)


# ---------------------------------------------------------------- --at-shapes: the 7B and 32B states, counted

GB = 1e9  # GPU sizes are sold in these
AT_SHAPES = ("dense_adamw_targets", "lora_r16", "lora_r1", "galore", "galore_layerwise", *PEER_METHODS[1:-2],
             "logra", "logra_adam")


def target_shapes(shape: str) -> dict[tuple[int, int], int]:
    """{(out, in): how many} of a Qwen2.5 shape's target matrices, from its config on the meta device."""
    model = qwen2_model(shape, torch.bfloat16, 16, "meta")
    counts: dict[tuple[int, int], int] = {}
    for name, param in model.named_parameters():
        if is_target(name):
            counts[tuple(param.shape)] = counts.get(tuple(param.shape), 0) + 1
    return counts


def at_shape_row(method: str, shape: str, rank: int) -> dict:
    """GB of the whole model for `method` at `shape`, as the GPU configs hold it (bf16 weights, `bf16-true`), before
    activations: the weights, the trained matrices' gradients (bf16; layer-wise: one matrix at a time), and the
    optimizer state, counted per distinct matrix shape from one real step (`peers.matrix_state_bytes`)."""
    shapes = target_shapes(shape)
    total = sum(p.numel() for p in qwen2_model(shape, torch.bfloat16, 16, "meta").parameters())
    trained = sum(out * inp * n for (out, inp), n in shapes.items())
    weights, gradients, state = 2 * total, 2 * trained, 0
    if method.startswith("logra"):
        # no gradient of a target matrix: its fp32 d×r sketch, and sketch Adam's two fp32 d×r moments
        gradients = sum(4 * out * rank * n for (out, _), n in shapes.items())
        state = 2 * gradients if method == "logra_adam" else 0
    elif method.startswith("lora"):
        r = int(method.removeprefix("lora_r"))
        adapters = sum(r * (out + inp) * n for (out, inp), n in shapes.items())
        gradients, state = 4 * adapters, 8 * adapters  # fp32 adapters (peft), their gradients, AdamW's m and v
        weights += 4 * adapters
    else:
        name = "adamw" if method == "dense_adamw_targets" else method
        state = sum(n * peers.matrix_state_bytes(name, matrix, rank, torch.bfloat16) for matrix, n in shapes.items())
        if method == "galore_layerwise":
            gradients = 2 * max(out * inp for out, inp in shapes)
    # A dense optimizer on bf16 weights rounds each step to nearest (most of an RL step is lost): users keep an fp32
    # master copy of what it trains. LoGRA merges with stochastic rounding; LoRA's adapters are fp32 already.
    masters = 4 * trained if not method.startswith(("logra", "lora")) else 0
    return dict(method=method, shape=shape, weights_gb=weights / GB, gradients_gb=gradients / GB,
                state_gb=state / GB, total_gb=(weights + gradients + state) / GB,
                with_masters_gb=(weights + gradients + state + masters) / GB)


def at_shapes(args: argparse.Namespace) -> None:
    rows = []
    for shape in args.at_shapes.split(","):
        for method in AT_SHAPES:
            if reason := peers.missing(method):
                rows.append(dict(method=method, shape=shape, error=f"not run here: {reason}"))
                continue
            print(f"counting {method} at {shape} ...", file=sys.stderr, flush=True)
            rows.append(at_shape_row(method, shape, args.rank))
    print(at_shapes_table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "settings": {"at_shapes": args.at_shapes, "rank": args.rank}},
                                   indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


def per_gpu_gb(row: dict, gpus: int = 8) -> float:
    """A row's GB per GPU when FSDP shards it over `gpus`: weights, gradients and state split by rows, except
    LoGRA's d×r sketches, which every rank holds whole until the reduction (configs/qwen32b_fsdp.yaml's header)."""
    sharded = row["weights_gb"] + row["state_gb"]
    gradients = row["gradients_gb"] if row["method"].startswith("logra") else row["gradients_gb"] / gpus
    return sharded / gpus + gradients


def at_shapes_table(rows: list[dict]) -> str:
    lines = ["| shape | method | weights GB | gradients (LoGRA: sketches) GB | optimizer state GB | total GB "
             "| fits 24 / 48 / 80 GB | with fp32 master weights GB | per GPU of 8 under FSDP, GB |",
             "|---|---|---:|---:|---:|---:|---|---:|---:|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['shape']} | {row['method']} | error: {row['error']} | | | | | | |")
            continue
        fits = " / ".join("yes" if row["total_gb"] <= size else "no" for size in (24, 48, 80))
        masters = f"{row['with_masters_gb']:.1f}" if row["with_masters_gb"] > row["total_gb"] else "—"
        lines.append(f"| {row['shape']} | {row['method']} | {row['weights_gb']:.1f} | {row['gradients_gb']:.2f} "
                     f"| {row['state_gb']:.2f} | {row['total_gb']:.1f} | {fits} | {masters} | {per_gpu_gb(row):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        row = run_worker(args)
        if row is not None:  # None: a rank other than 0 of a multi-process method
            print(json.dumps(row), flush=True)
        return
    settings = {key: getattr(args, key) for key in (
        "shape", "dtype", "rank", "batch", "group", "micro_batch", "prompt_len", "completion_len", "steps", "lr",
        "seed", "logprob_chunk", "layers", "gradient_checkpointing", "device", "kl_check", "kl_budget",
        "saved_bytes_only", "processes", "rounds")}
    settings["torch_threads"] = torch.get_num_threads()
    if args.at_shapes:
        at_shapes(args)
        return
    rows = run_rounds(args.methods, argv, args.rounds)
    print(markdown_table(rows))
    if any("state_gib" in row for row in rows):
        print("\n| method | processes | weights + gradients + sketches + optimizer state, GiB per rank |")
        print("|---|---:|---:|")
        for row in rows:
            if "state_gib" in row:
                print(f"| {row['method']} | {row['processes']} | {row['state_gib']:.4f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "settings": settings}, indent=2) + "\n")
    if args.no_plot:
        print(f"wrote {args.out}", file=sys.stderr)
        return
    depth = "" if args.layers is None else f" ({args.layers} layers)"
    title = (f"Qwen2.5-{args.shape} shape{depth}, {args.dtype}, rank {args.rank}, {args.batch} × "
             f"({args.prompt_len}+{args.completion_len}) tokens, micro-batch {args.micro_batch}, "
             f"log-prob chunk {args.logprob_chunk or 'off'}")
    plot(rows, title, args.plot, args.device)
    print(f"wrote {args.out} and {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
