"""Rollout throughput: the in-process engine on an FSDP-sharded policy against vLLM CPU engines, and the weight sync.

    python -m bench.rollout            # Qwen2.5-0.5B shape, fp32, 8 prompts × 4 samples × 128 new tokens, 2 ranks
    python -m bench.rollout --tiny     # the same code on lightning_logra/data/tiny_arith, a few tokens (a test)

One fixed batch of prompts, split over 2 ranks (gloo on the CPU), each rank generating its half, by each side:

- `hf_fsdp`: `HFEngine` on the policy sharded as `SketchFSDPStrategy` shards it (sketches installed, then
  `shard_policy`: every decoder layer and the decoder `fully_shard`-ed, the tied embedding / LM head whole), with
  the strategy's `all_finished`, as `RLVRModule.configure_model` builds it. Every forward pass all-gathers every
  sharded parameter: per decoding step each rank receives the (world−1) shards it does not hold. That is computed
  from the parameters' shapes (FSDP2 pads dim 0 to ⌈d/world⌉ rows per rank) and counted too, by wrapping the
  `all_gather_single` FSDP calls (`allgather_bytes_counted`);
- `vllm_processes`: a `VLLMEngine` per rank in processes of its own (`placement: processes`, as under FSDP with
  several ranks), each bound to its own core (`VLLM_CPU_OMP_THREADS_BIND=0|1`), each given its rank's half;
- `vllm_trainer_ranks`: one tensor-parallel engine (`tensor_parallel_size: 2`) whose 2 workers are the 2 ranks
  themselves (`placement: trainer_ranks`, vLLM's external launcher); the ranks' prompts are generated together.

Every row is forced to exactly `--new-tokens` tokens on both sides: the model folder the engines read has no EOS
(config, generation config and tokenizer), no stop tokens are given, and the script checks every completion's
length. Sampling at temperature 1. Each side generates once untimed (2 tokens, warm-up) and then once timed,
between barriers of the ranks; tokens per second = all ranks' generated tokens / the slowest rank's seconds.

The weight sync: in each vLLM side, after generation, each rank's engine gets one `Update` with a `LowRankDelta`
per sketched matrix (q, k, v, o, gate, up, down of every layer) at `--rank`, F in float32 — the payload
`RolloutWeightSync` sends after a LoGRA step, built by bench/sync.py's `make_payload`. Timed twice: the first call
also recovers the CPU backend's prepacked weights (once per engine), the second is the steady state. Its bytes are
`Update.to_bytes()`'s length, which each rank hands its own engine (host memory, no collective), set beside the
bytes each rank receives in all-gathers while it generates one step's rollouts under FSDP.

Model folders: the 0.5B shape is `bench/memory.py`'s `qwen2_model` with random fp32 weights, saved with the tiny
model's tokenizer (as bench/sync.py does for 1.5B); prompts use ids of that tokenizer's 15-token vocabulary because
vLLM refuses prompt ids beyond its tokenizer (the weights are random: which tokens does not matter).

`--step` (on by default at 0.5B) times one LoGRA update step (sketch SGD) on the same batch's shape with
bench/memory.py, in one process without FSDP. A side that fails (an engine that does not start) is recorded under
`settings.errors` and the others still run. Output: `--out-dir`/rollout.json (rollout_tiny.json with `--tiny`), the
markdown table beside it (.md, also printed) and a plot (.png).
"""

from __future__ import annotations

import os

# Before vllm is imported (here and in the processes it spawns): its CPU backend logs a screenful at start-up.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from bench.lib.payloads import make_payload, target_names  # noqa: E402
from bench.lib.plotting import pyplot, save_figure  # noqa: E402
from bench.lib.runs import ROOT  # noqa: E402
from bench.lib.shapes import TINY_MODEL, qwen2_model  # noqa: E402

SIDES = ("hf_fsdp", "vllm_processes", "vllm_trainer_ranks")
WORLD = 2  # ranks: this machine has 2 cores, one per rank
PROMPT_VOCAB = range(3, 15)  # the tiny tokenizer's ordinary tokens (0-2: pad, eos, unk)
# Per size: prompts, samples per prompt, new tokens, prompt length, sketch rank, vLLM's max_model_len, sides run,
# whether a sketch update step is timed, each vLLM engine's (worker's) gpu_memory_utilization. On the CPU backend
# that share of host memory (23 GiB here) must hold the weights and the engine's working memory as well as the KV
# cache: at the 0.5B shape (2 GiB of fp32 weights) vLLM refused to start with 0.05 (1.2 GiB) and with 0.15
# (3.5 GiB, 3.6 GiB taken before any KV cache). tiny's max_position_embeddings is 32: prompt +
# completion must fit. Its default leaves out the per-rank engines: two engines starting at once on 2 cores took
# 60-75 s (the tensor-parallel engine in the ranks, no processes of its own, 7-23 s), and a test's budget is a minute.
PRESETS = {
    "0.5b": dict(prompts=8, samples=4, new_tokens=128, prompt_len=32, rank=64, max_model_len=256,
                 sides=",".join(SIDES), step=True, memory=0.22),
    "tiny": dict(prompts=4, samples=2, new_tokens=16, prompt_len=8, rank=16, max_model_len=32,
                 sides="hf_fsdp,vllm_trainer_ranks", step=False, memory=0.05),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the shipped tiny model, few tokens (about a minute)")
    parser.add_argument("--sides", help="comma-separated, from " + ", ".join(SIDES))
    parser.add_argument("--prompts", type=int, help="prompts in the batch (split over the 2 ranks)")
    parser.add_argument("--samples", type=int, help="completions per prompt")
    parser.add_argument("--new-tokens", type=int, help="tokens generated per completion (forced: no EOS)")
    parser.add_argument("--rank", type=int, help="r of the sync's factors and of the installed sketches")
    parser.add_argument("--memory", type=float, help="each vLLM engine's gpu_memory_utilization (on the CPU "
                        "backend: its share of host memory, weights and KV cache); default 0.22, 0.05 with --tiny")
    parser.add_argument("--step", action=argparse.BooleanOptionalAction, default=None,
                        help="also time one LoGRA (sketch SGD) update step on the same batch's shape with "
                             "bench/memory.py, in one process (default: on for 0.5B, off with --tiny)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=Path("bench/out/rollout"))
    # set by the parent for a rank of one side
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    preset = PRESETS["tiny" if args.tiny else "0.5b"]
    for key in ("prompts", "samples", "new_tokens", "rank", "sides", "step", "memory"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    args.prompt_len, args.max_model_len = preset["prompt_len"], preset["max_model_len"]
    args.sides = args.sides.split(",")
    unknown = sorted(set(args.sides) - set(SIDES))
    if unknown:
        parser.error(f"unknown sides {unknown}; choose from {', '.join(SIDES)}")
    if args.prompts % WORLD:
        parser.error(f"--prompts must split evenly over {WORLD} ranks")
    if args.prompt_len + args.new_tokens > args.max_model_len:
        parser.error(f"prompt ({args.prompt_len}) + --new-tokens must fit {args.max_model_len} positions")
    return args


# ---------------------------------------------------------------- the model folder


def save_model(directory: Path, tiny: bool, max_positions: int, seed: int) -> None:
    """The model the sides read, without any EOS so that every row generates exactly the asked number of tokens:
    tiny_arith copied, or a random fp32 Qwen2 in Qwen2.5-0.5B's shape with the tiny model's tokenizer."""
    if tiny:
        shutil.copytree(TINY_MODEL, directory, dirs_exist_ok=True)
    else:
        torch.manual_seed(seed)
        model = qwen2_model("0.5b", torch.float32, max_positions)
        model.save_pretrained(directory)
        del model
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TINY_MODEL / name, directory / name)
    # vLLM stops a row at the tokenizer's EOS and the generation config's; with neither it stops at max_tokens.
    (directory / "generation_config.json").unlink(missing_ok=True)
    # Null, not absent, in the config: a generation config derived from it would take the class's default EOS.
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "eos_token_id": None, "bos_token_id": None}))
    tokenizer = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer.pop("eos_token", None)
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer, indent=2))


def sketch_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """(d, k) of every sketched matrix (bench/sync.py's targets), from the config on the meta device (no weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return {name: tuple(model.get_parameter(name).shape) for name in target_names(model_dir)}


# ---------------------------------------------------------------- one rank of one side (a subprocess)


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    job = json.loads(args.job.read_text())
    rank = int(os.environ["RANK"])
    # One core per rank: the 2 ranks share this machine's 2 cores, as the trainer's processes would.
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    half = len(job["prompts"]) // WORLD
    mine = slice(rank * half, (rank + 1) * half)  # (prompts/world,) this rank's prompts, as the data module splits
    prompts, seeds = job["prompts"][mine], job["seeds"][mine]
    result = (hf_fsdp if args.worker == "hf_fsdp" else vllm_side)(args, job, rank, prompts, seeds)
    Path(job["results"], f"{args.worker}_rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():  # (a tensor-parallel engine in the ranks destroys the group when it closes)
        dist.destroy_process_group()


def timed_generate(engine, prompts, seeds, samples, new_tokens) -> tuple[float, int]:
    """One untimed warm-up call (2 tokens), then the timed one between barriers; checks every row's length."""
    import torch.distributed as dist

    from lightning_logra.rollout import SamplingParams

    engine.generate(prompts, samples, SamplingParams(max_new_tokens=2), seeds)
    dist.barrier()
    start = time.perf_counter()
    rollout = engine.generate(prompts, samples, SamplingParams(temperature=1.0, max_new_tokens=new_tokens), seeds)
    seconds = time.perf_counter() - start
    dist.barrier()
    lengths = rollout.completion_mask.sum(1)  # (rows,)
    if not bool((lengths == new_tokens).all()):
        raise AssertionError(f"rows stopped early: lengths {lengths.tolist()}, expected {new_tokens}")
    return seconds, int(lengths.sum())


def hf_fsdp(args, job, rank, prompts, seeds) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from lightning_logra.rollout import HFEngine
    from lightning_logra.sketch.config import DEFAULT_TARGETS
    from lightning_logra.sketch.install import install_sketches
    from lightning_logra.train.strategies.fsdp import SketchFSDPStrategy, shard_policy

    start = time.perf_counter()
    policy = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    install_sketches(policy, DEFAULT_TARGETS, job["rank"], seed=args.seed)  # as the training mode does, first
    shard_policy(policy, init_device_mesh("cpu", (WORLD,)))
    policy.eval()
    load_s = time.perf_counter() - start
    # Bytes this rank receives per forward pass: for every sharded parameter (d, ...), the (world−1) shards of
    # ⌈d/world⌉ rows it does not hold (FSDP2's padded all-gather), in the parameter's dtype.
    sharded = [p for p in policy.parameters() if isinstance(p, DTensor)]
    per_forward = sum((WORLD - 1) * math.ceil(p.shape[0] / WORLD) * math.prod(p.shape[1:]) * p.element_size()
                      for p in sharded)
    # Counted as well: FSDP2's all-gathers go through dist.all_gather_single (output: world × the input).
    counted = {"bytes": 0, "calls": 0}
    gather = dist.all_gather_single

    def counting(output, shard, *rest, **kwargs):
        counted["bytes"] += (output.numel() - shard.numel()) * output.element_size()  # the others' shards
        counted["calls"] += 1
        return gather(output, shard, *rest, **kwargs)

    dist.all_gather_single = counting
    forwards = [0]
    policy.get_decoder().register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    # The strategy's own all_finished (an all-reduce of "every row done" per step); it reads no trainer state.
    engine = HFEngine(policy, eos_token_ids=[], pad_token_id=0, all_finished=SketchFSDPStrategy().all_finished)
    seconds, tokens = timed_generate(engine, prompts, seeds, job["samples"], job["new_tokens"])
    return dict(side="hf_fsdp", rank=rank, seconds=seconds, tokens=tokens, start_s=load_s,
                # forwards and counted bytes include the warm-up call's (2 forward passes)
                forwards=forwards[0], allgather_bytes_counted=counted["bytes"], allgather_calls=counted["calls"],
                allgather_bytes_per_forward=per_forward,
                sharded_params=sum(p.numel() for p in sharded),
                sharded_bytes=sum(p.numel() * p.element_size() for p in sharded),
                params=sum(p.numel() for p in policy.parameters()))


def vllm_side(args, job, rank, prompts, seeds) -> dict:
    from lightning_logra.rollout import VLLMEngine

    tensor_parallel = args.worker == "vllm_trainer_ranks"
    engine = VLLMEngine(dtype="float32", gpu_memory_utilization=args.memory, max_model_len=job["max_model_len"],
                        placement="trainer_ranks" if tensor_parallel else "processes",
                        tensor_parallel_size=WORLD if tensor_parallel else 1)
    engine.place(rank, WORLD, torch.device("cpu"))
    try:
        start = time.perf_counter()
        engine.start(job["model"], pad_token_id=0, stop_token_ids=[])
        start_s = time.perf_counter() - start
        seconds, tokens = timed_generate(engine, prompts, seeds, job["samples"], job["new_tokens"])
        shapes = {name: tuple(shape) for name, shape in job["shapes"].items()}
        syncs = []
        for repeat in range(2):  # the first also recovers the CPU backend's prepacked weights
            payload = make_payload(shapes, job["rank"], 1e-3, args.seed + repeat, torch.float32)
            torch.distributed.barrier()
            start = time.perf_counter()
            sent = engine.apply_update(payload)
            syncs.append(time.perf_counter() - start)
            assert sent == len(payload.to_bytes())
        return dict(side=args.worker, rank=rank, seconds=seconds, tokens=tokens, start_s=start_s,
                    sync_bytes=sent, sync_tensor_bytes=payload.tensor_bytes, first_sync_s=syncs[0], sync_s=syncs[1])
    finally:
        engine.close()


# ---------------------------------------------------------------- the parent: model, sides, report


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_side(side: str, job_path: Path, args: argparse.Namespace, results: Path) -> list[dict]:
    """The side's 2 ranks as 2 processes of this tool (`python -m bench.rollout --worker`, gloo over localhost); their
    reports, by rank."""
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1",
                   # each rank's vLLM worker on its own core (VLLMEngine picks the rank's list)
                   VLLM_CPU_OMP_THREADS_BIND="0|1")
        procs.append(subprocess.Popen([sys.executable, "-m", "bench.rollout", "--worker", side, "--job", str(job_path),
                                       "--seed", str(args.seed), "--memory", str(args.memory)], cwd=ROOT, env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"{side}: ranks exited with {codes}")
    return [json.loads((results / f"{side}_rank{r}.json").read_text()) for r in range(WORLD)]


def update_step(args: argparse.Namespace, tmp: Path) -> dict:
    """Seconds of one LoGRA update (sketch SGD, rank r) on this batch's shape: forward, loss, backward over every
    micro-batch of prompts × samples sequences of (prompt + new tokens), and the sketch optimizer's merge, by
    bench/memory.py in one process with both cores (no FSDP; its first step, which allocates the optimizer's
    state, since only one is run). A failure is recorded, not raised: the rollout numbers stand without it."""
    out = tmp / "step.json"
    command = [sys.executable, "-m", "bench.memory", "--shape", "tiny" if args.tiny else "0.5b",
               "--methods", "logra", "--rank", str(args.rank), "--batch", str(args.prompts * args.samples),
               "--group", str(args.samples), "--micro-batch", "4", "--prompt-len", str(args.prompt_len),
               "--completion-len", str(args.new_tokens), "--steps", "1", "--seed", str(args.seed), "--no-plot",
               "--out", str(out)]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode or not out.exists():
        return dict(step_error=(done.stderr or done.stdout)[-2000:])
    row = json.loads(out.read_text())["rows"][0]
    if "step_s" not in row:
        return dict(step_error=str(row.get("error", row))[-2000:])
    return dict(step_s=row["step_s"], step_peak_gib=row.get("peak_gib"), step_wall_s=time.perf_counter() - start)


def summarize(side: str, ranks: list[dict], job: dict) -> dict:
    seconds = max(r["seconds"] for r in ranks)  # the step waits for the slowest rank
    tokens = sum(r["tokens"] for r in ranks)
    row = dict(side=side, tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds,
               start_s=max(r["start_s"] for r in ranks), ranks=ranks)
    if side == "hf_fsdp":
        per_forward = ranks[0]["allgather_bytes_per_forward"]
        forwards = job["new_tokens"]  # one forward pass per generated token: the prefill gives the first
        row.update(allgather_bytes_per_forward_per_rank=per_forward,
                   allgather_bytes_per_step_per_rank=per_forward * forwards,
                   # all ranks' received bytes over all ranks' generated tokens
                   allgather_bytes_per_token=per_forward * forwards * WORLD / tokens,
                   allgather_bytes_counted_per_rank=ranks[0]["allgather_bytes_counted"],
                   forwards_counted=ranks[0]["forwards"])
        # What was counted must be what the shapes say, warm-up's 2 forwards included.
        if ranks[0]["allgather_bytes_counted"] != per_forward * ranks[0]["forwards"]:
            row["allgather_count_mismatch"] = True
    else:
        row.update({key: max(r[key] for r in ranks) for key in ("first_sync_s", "sync_s")},
                   sync_bytes=ranks[0]["sync_bytes"], sync_tensor_bytes=ranks[0]["sync_tensor_bytes"])
    return row


def markdown_table(rows: list[dict], summary: dict) -> str:
    lines = [("| side | engines | tokens | s | tokens/s | vs hf_fsdp | start s | sync bytes | sync s "
              "(first) |"), "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    engines = {"hf_fsdp": "2 × HFEngine on FSDP2 shards", "vllm_processes": "2 × vLLM, one per rank",
               "vllm_trainer_ranks": "1 × vLLM, TP=2 over the ranks"}
    base = next((r["tokens_per_s"] for r in rows if r["side"] == "hf_fsdp"), None)
    for r in rows:
        sync = (f"{r['sync_bytes']:,} | {r['sync_s']:.3f} ({r['first_sync_s']:.2f})" if "sync_bytes" in r
                else "– | –")
        ratio = f"{r['tokens_per_s'] / base:.2f}" if base else "–"
        lines.append(f"| {r['side']} | {engines[r['side']]} | {r['tokens']:,} | {r['seconds']:.2f} "
                     f"| {r['tokens_per_s']:.1f} | {ratio} | {r['start_s']:.1f} | {sync} |")
    if "allgather_bytes_per_step_per_rank" in summary:
        lines += ["", ("| FSDP all-gathered per rank: per forward | per step | per generated token | sync bytes "
                       "per rank per step | all-gathered / sync |"), "|---:|---:|---:|---:|---:|",
                  f"| {summary['allgather_bytes_per_forward_per_rank']:,} "
                  f"| {summary['allgather_bytes_per_step_per_rank']:,} "
                  f"| {summary['allgather_bytes_per_token']:,.0f} | "
                  + (f"{summary['sync_bytes']:,} | {summary['allgather_over_sync']:.0f} |"
                     if "sync_bytes" in summary else "– | – |")]
    if "step_s" in summary:
        lines += ["", f"One LoGRA update step (sketch SGD, bench/memory.py, one process): {summary['step_s']:.1f} s."]
    elif "step_error" in summary:
        lines += ["", "The update step (bench/memory.py) failed: see `step_error` in the JSON."]
    return "\n".join(lines)


def plot(rows: list[dict], summary: dict, title: str, path: Path) -> None:
    plt = pyplot()
    fig, (speed, size) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"hf_fsdp": "tab:gray", "vllm_processes": "tab:blue", "vllm_trainer_ranks": "tab:cyan"}
    speed.bar([r["side"] for r in rows], [r["tokens_per_s"] for r in rows], color=[colors[r["side"]] for r in rows])
    speed.set_ylabel("generated tokens per second (2 ranks)")
    for i, r in enumerate(rows):
        speed.annotate(f"{r['tokens_per_s']:.1f}", (i, r["tokens_per_s"]), ha="center", va="bottom")
    bars = {k: summary[v] for k, v in (("FSDP all-gather\nper step", "allgather_bytes_per_step_per_rank"),
                                         ("weight sync\nper step", "sync_bytes")) if v in summary}
    size.bar(list(bars), [b / 2**20 for b in bars.values()], color=["tab:gray", "tab:blue"][: len(bars)])
    size.set_yscale("log")
    size.set_ylabel("MiB per rank per step (log)")
    if "allgather_over_sync" in summary:
        size.set_title(f"all-gathered / sync = {summary['allgather_over_sync']:.0f}×", fontsize=10)
    save_figure(fig, title, path)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        worker(args)
        return
    wall = time.perf_counter()
    gen = torch.Generator().manual_seed(args.seed)
    # (prompts, prompt_len) token ids; seeds: one per prompt, as the data module's prompt_seeds give
    prompts = torch.randint(PROMPT_VOCAB.start, PROMPT_VOCAB.stop, (args.prompts, args.prompt_len), generator=gen)
    with tempfile.TemporaryDirectory(prefix="bench_rollout_") as tmp:
        tmp = Path(tmp)
        model_dir, results = tmp / "model", tmp / "results"
        results.mkdir()
        print("saving the model folder ...", file=sys.stderr, flush=True)
        save_model(model_dir, args.tiny, args.max_model_len, args.seed)
        job = dict(model=str(model_dir), results=str(results), prompts=prompts.tolist(),
                   seeds=list(range(1000, 1000 + args.prompts)), samples=args.samples, new_tokens=args.new_tokens,
                   rank=args.rank, max_model_len=args.max_model_len,
                   shapes={n: list(s) for n, s in sketch_shapes(model_dir).items()})
        job_path = tmp / "job.json"
        job_path.write_text(json.dumps(job))
        rows, step, errors = [], None, {}
        for side in SIDES:  # one side at a time: each has the machine's 2 cores to itself
            if side in args.sides:
                print(f"running {side} ...", file=sys.stderr, flush=True)
                start = time.perf_counter()
                try:
                    rows.append(summarize(side, run_side(side, job_path, args, results), job))
                except (RuntimeError, OSError) as err:  # a side that fails leaves the others' numbers standing
                    errors[side] = str(err)
                    print(f"{side} failed: {err}", file=sys.stderr, flush=True)
                    continue
                rows[-1]["side_wall_s"] = time.perf_counter() - start
        if args.step:
            print("timing a sketch update step (bench/memory.py) ...", file=sys.stderr, flush=True)
            step = update_step(args, tmp)
    import vllm
    summary: dict = {}
    for row in rows:
        if row["side"] == "hf_fsdp":
            summary.update({k: v for k, v in row.items() if k.startswith("allgather")})
        elif "sync_bytes" not in summary:  # the per-rank engines' sync when they ran, else the tensor-parallel one's
            summary.update({k: row[k] for k in ("sync_bytes", "sync_tensor_bytes", "sync_s", "first_sync_s")},
                           sync_side=row["side"])
        summary[f"{row['side']}_tokens_per_s"] = row["tokens_per_s"]
    if step:
        summary.update(step)
    if "allgather_bytes_per_step_per_rank" in summary and "sync_bytes" in summary:
        # Per rank and per step, both: each rank receives this much while generating its rollouts under FSDP, and
        # sends its own engine one Update after the step.
        summary["allgather_over_sync"] = summary["allgather_bytes_per_step_per_rank"] / summary["sync_bytes"]
    for side in SIDES[1:]:
        if "hf_fsdp_tokens_per_s" in summary and f"{side}_tokens_per_s" in summary:
            summary[f"{side}_vs_hf_fsdp"] = summary[f"{side}_tokens_per_s"] / summary["hf_fsdp_tokens_per_s"]
    shape = "tiny_arith" if args.tiny else "Qwen2.5-0.5B shape"
    settings = dict(shape=shape, dtype="float32", world=WORLD, prompts=args.prompts, samples=args.samples,
                    new_tokens=args.new_tokens, prompt_len=args.prompt_len, rank=args.rank, memory=args.memory,
                    seed=args.seed, sides=args.sides, errors=errors, matrices=len(job["shapes"]), cpus=os.cpu_count(),
                    torch=torch.__version__, vllm=vllm.__version__, wall_s=time.perf_counter() - wall)
    table = markdown_table(rows, summary)
    print(table)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = "rollout_tiny" if args.tiny else "rollout"
    (args.out_dir / f"{name}.json").write_text(json.dumps(dict(rows=rows, summary=summary, settings=settings),
                                                          indent=2) + "\n")
    (args.out_dir / f"{name}.md").write_text(table + "\n")
    plot(rows, summary, f"{shape}, fp32, {args.prompts}×{args.samples}×{args.new_tokens} tokens, 2 ranks",
         args.out_dir / f"{name}.png")
    print(f"wrote {args.out_dir}/{name}.json, .md, .png ({settings['wall_s']:.0f} s)", file=sys.stderr)


if __name__ == "__main__":  # vLLM starts its engine in new processes, which import this file again
    main()
