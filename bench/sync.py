"""Bytes and seconds of one weight sync into a vLLM engine: the seed-based sync against a full-weight load.

    python -m bench.sync                                     # the shipped tiny model (fp32), rank 16
    python -m bench.sync --shape 1.5b --out bench/out/sync_1_5b.json --plot bench/out/sync_1_5b.png

Both methods update the same matrices of the same engine: the q, k, v, o, gate, up and down projections of every
layer. The seed sync (`VLLMEngine.apply_update`) sends, per matrix, a factor F (d×r) and the seed of A (r×k); the
engine regenerates A and merges W −= F·A in place. It is measured with F in float32 and in bfloat16. The full sync
(`VLLMEngine.load_weights`) sends the matrices themselves, in the checkpoint's dtype. "Bytes sent" is the length of
the bytes each call hands to vLLM's `collective_rpc` (tensors plus safetensors headers); "tensor bytes" is the
numbers alone: Σ d·r·bytes(F) for the seed sync, Σ d·k·bytes(W) for the full sync. A call's time runs from the
trainer's tensors to the engine's re-packed weights (serialization, transport to the engine's worker process, the
merge or copy, and on the CPU backend the re-packing of every touched layer for its GEMM kernels). The full sync is
measured twice: by bytes (`full`: safetensors, the path every engine can take) and by reference (`full_shared`,
`engine.full_load: shared`: one shared-memory handle per tensor, opened and copied from by the worker; on a GPU the
same worker code takes CUDA IPC handles to the trainer's tensors). Its tensors are the checkpoint's, negated, so
that the engine's copies must change.

`--shape tiny` is the shipped model (lightning_logra/data/tiny_arith, fp32). `--shape 1.5b` saves a Qwen2 with the
Qwen2.5-1.5B config and random bfloat16 weights to a temporary directory and serves that in bfloat16. No trainer
model is built: the factors are random (F ~ N(0, σ²), so that each entry of F·A has standard deviation σ =
`--update-scale`) and the full tensors are read from the saved checkpoint.

Each method first makes one checked, untimed call, after which the engine's copies of two matrices (a block of
the first layer's fused qkv_proj and one of the last layer's fused gate_up_proj) must equal, element by element
within the rounding of the engine's dtype, the same update merged here into an fp32 copy (`LowRankDelta.apply_`),
or the loaded tensors exactly; the script stops otherwise (`max_abs_diff` in the JSON settings). Then `--repeats`
timed calls; the median is reported. The very first seed sync also recovers the CPU backend's prepacked weights
(once per engine) and is timed apart as `first_sync_s`; `local_merge_s` is what regenerating every A and merging
F·A into a copy of every matrix takes in this process, the arithmetic of a seed sync without transport.

`--share-projection` gives the deltas of the matrices that read one input (q/k/v, gate/up of a layer) one seed, as
`sketch.share_projection` does: the engine then regenerates one A per fused weight and merges [F_q; F_k; F_v]·A
into `qkv_proj` (and [F_gate; F_up]·A into `gate_up_proj`) with one GEMM. The bytes are the same.
"""

from __future__ import annotations

import os

# Before vllm is imported (here and in the processes it spawns, which inherit the environment): its CPU backend
# logs a screenful of INFO lines at start-up.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from bench.lib.payloads import make_payload, read_tensors, target_names  # noqa: E402
from bench.lib.plotting import pyplot, save_figure  # noqa: E402
from bench.lib.shapes import TINY_MODEL, qwen2_model  # noqa: E402
from lightning_logra.sketch.optim import FACTOR_DTYPES  # noqa: E402 (the dtypes a factor F may travel in)

# Per shape: the engine's dtype, its share of (host) memory, its longest sequence, the default rank.
SHAPES = {
    "tiny": dict(dtype="float32", memory=0.1, max_model_len=32, rank=16),
    "1.5b": dict(dtype="bfloat16", memory=0.25, max_model_len=256, rank=64),
}
# Checked after each method's first call: a q/k/v block of the first layer's fused qkv_proj (v: the last block) and
# a gate/up block of the last layer's fused gate_up_proj (up: the second one).
CHECKED = ("model.layers.0.self_attn.v_proj.weight", "model.layers.{last}.mlp.up_proj.weight")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="tiny")
    # The seed sync's bytes are r/k of the full sync's: tiny's matrices have k = 128 or 384.
    parser.add_argument("--rank", type=int, help="r of every factor; default 64, 16 for tiny (its training config's)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per method, after one checked call")
    parser.add_argument("--update-scale", type=float, default=1e-3, help="standard deviation of F·A's entries")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--share-projection", action="store_true",
                        help="one A per input (q/k/v, gate/up), as sketch.share_projection: one GEMM per fused weight")
    parser.add_argument("--out", type=Path, default=Path("bench/out/sync.json"))
    parser.add_argument("--plot", type=Path, default=Path("bench/out/sync.png"))
    args = parser.parse_args(argv)
    args.rank = args.rank or SHAPES[args.shape]["rank"]
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.rank < 1:
        parser.error("--rank must be positive")
    return args


# ---------------------------------------------------------------- the model the engine serves


def save_random_1_5b(directory: Path, seed: int) -> None:
    """A Qwen2 in Qwen2.5-1.5B's shape with random bfloat16 weights, saved with the tiny model's tokenizer (the engine
    runs on token ids, but vLLM loads a tokenizer at start-up)."""
    torch.manual_seed(seed)
    model = qwen2_model("1.5b", torch.bfloat16, SHAPES["1.5b"]["max_model_len"])
    model.save_pretrained(directory)
    del model
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_MODEL / name, directory / name)


# ---------------------------------------------------------------- payloads, checks, timing


def bound(expected: torch.Tensor, engine_dtype: torch.dtype) -> torch.Tensor:
    """What the engine may differ from an fp32 merge by, per element: rounding into its dtype (half an ulp, bounded
    by eps·|x|) plus fp32 summation-order noise."""
    eps32 = torch.finfo(torch.float32).eps
    return torch.finfo(engine_dtype).eps * expected.abs() + 16 * eps32 * float(expected.abs().max())


def check_seed_sync(eng, payload, names: list[str], engine_dtype: torch.dtype) -> tuple[float, float]:
    """Apply `payload` to the engine once and compare `names` with the same update merged here in fp32; returns the
    largest difference to that merge and to that merge rounded to the engine's dtype."""
    before = {n: w.float() for n, w in eng.weights(names).items()}
    eng.apply_update(payload)
    after = eng.weights(names)
    worst = rounded = 0.0
    for name in names:
        expected = before[name].clone()
        payload.low_rank[name].apply_(expected)
        got = after[name].float()
        diff = (got - expected).abs()
        # A sync that did nothing must fail: the update itself has to stand out of the tolerance.
        if not bool((diff <= bound(expected, engine_dtype)).all()):
            raise AssertionError(f"seed sync: engine's {name} is off the local merge by up to {float(diff.max()):.3g}")
        moved = (expected - before[name]).abs() > bound(expected, engine_dtype)
        if float(moved.float().mean()) < 0.5:
            raise AssertionError(f"seed sync check is vacuous for {name}: the update is within rounding; raise "
                                 "--update-scale")
        worst = max(worst, float(diff.max()))
        # The engine merges in fp32 as well and rounds into its dtype once; on the same kind of device its result
        # should be bit-equal to the local merge rounded the same way (not asserted: kernels may sum differently).
        rounded = max(rounded, float((got - expected.to(after[name].dtype).float()).abs().max()))
    return worst, rounded


def check_full_sync(eng, tensors: dict[str, torch.Tensor], names: list[str]) -> tuple[int, float]:
    """Load the full tensors once; the engine's copies of `names` must then equal them exactly."""
    before = eng.weights(names)
    if all(torch.equal(before[n], tensors[n]) for n in names):
        raise AssertionError("full sync check is vacuous: the engine already holds the tensors to be loaded")
    sent = eng.load_weights(tensors)
    after = eng.weights(names)
    worst = 0.0
    for name in names:
        diff = float((after[name].float() - tensors[name].float()).abs().max())
        if after[name].dtype != tensors[name].dtype or diff != 0.0:
            raise AssertionError(f"full sync: engine's {name} ({after[name].dtype}) is off the loaded "
                                 f"{tensors[name].dtype} tensor by {diff:.3g}")
        worst = max(worst, diff)
    return sent, worst


def local_merge_seconds(full: dict[str, torch.Tensor], payload) -> float:
    """Seconds this process takes to regenerate every A and merge F·A into a copy of every matrix (in the
    checkpoint's dtype): the arithmetic of a seed sync without its transport and the engine's re-packing."""
    total = 0.0
    for name, weight in full.items():
        weight = weight.clone()
        start = time.perf_counter()
        payload.low_rank[name].apply_(weight)
        total += time.perf_counter() - start
    return total


def timed(call, repeats: int) -> tuple[list[float], list[int]]:
    seconds, sent = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        sent.append(call())
        seconds.append(time.perf_counter() - start)
    return seconds, sent


# ---------------------------------------------------------------- the benchmark


def run(args: argparse.Namespace, model_dir: Path) -> tuple[list[dict], dict]:
    from lightning_logra.rollout import VLLMEngine

    shape = SHAPES[args.shape]
    engine_dtype = FACTOR_DTYPES[shape["dtype"]]
    names = target_names(model_dir)
    full = read_tensors(model_dir, names)  # the trainer side of a full sync: the checkpoint's own tensors
    shapes = {n: t.shape for n, t in full.items()}
    too_big = [n for n, (d, k) in shapes.items() if args.rank >= k]
    if too_big:
        raise SystemExit(f"--rank {args.rank} is not below in_features k of {too_big[0]} {tuple(shapes[too_big[0]])}")
    last = int(names[-1].split(".")[2])
    checked = [c.format(last=last) for c in CHECKED]
    original = {n: full[n].clone() for n in checked}
    local_merge_s = local_merge_seconds(
        full, make_payload(shapes, args.rank, args.update_scale, args.seed, torch.float32,
                                  args.share_projection))

    eng = VLLMEngine(dtype=shape["dtype"], gpu_memory_utilization=shape["memory"], separate_process=True,
                     max_model_len=shape["max_model_len"])
    settings: dict = {}
    rows = []
    try:
        start = time.perf_counter()
        eng.start(str(model_dir), pad_token_id=0, stop_token_ids=[1])
        settings["engine_start_s"] = time.perf_counter() - start
        # The engine serves the checkpoint exactly (on the CPU backend: recovered from its prepacked kernels).
        for name, w in eng.weights(checked).items():
            if not torch.equal(w, original[name]):
                raise AssertionError(f"engine's {name} differs from the checkpoint before any sync")

        diffs, diffs_rounded = {}, {}
        # Touching every layer once recovers the CPU backend's prepacked weights; time it apart from the rest.
        warm = make_payload(shapes, args.rank, args.update_scale, args.seed + 1, torch.float32, args.share_projection)
        start = time.perf_counter()
        eng.apply_update(warm)
        settings["first_sync_s"] = time.perf_counter() - start
        del warm
        for label, dtype in FACTOR_DTYPES.items():
            payload = make_payload(shapes, args.rank, args.update_scale, args.seed, dtype, args.share_projection)
            diffs[f"seed_{label}"], diffs_rounded[f"seed_{label}"] = check_seed_sync(
                eng, payload, checked, engine_dtype)
            seconds, sent = timed(lambda payload=payload: eng.apply_update(payload), args.repeats)
            rows.append(dict(method=f"seed_{label}", dtype=label, bytes_sent=sent[0],
                             tensor_bytes=payload.tensor_bytes, seconds=statistics.median(seconds),
                             min_seconds=min(seconds), seconds_all=seconds))
            assert len(set(sent)) == 1, sent
            del payload
        sent_once, diffs["full"] = check_full_sync(eng, full, checked)
        seconds, sent = timed(lambda: eng.load_weights(full), args.repeats)
        assert set(sent) == {sent_once}, (sent_once, sent)
        dtype = str(next(iter(full.values())).dtype).removeprefix("torch.")
        tensor_bytes = sum(t.numel() * t.element_size() for t in full.values())
        rows.append(dict(method="full", dtype=dtype, bytes_sent=sent[0], tensor_bytes=tensor_bytes,
                         seconds=statistics.median(seconds), min_seconds=min(seconds), seconds_all=seconds))
        eng.full_load = "shared"
        for tensor in full.values():
            tensor.neg_()  # exact in any dtype; in place, so that the 1.5B shape's 2.4 GiB is not held twice
        sent_once, diffs["full_shared"] = check_full_sync(eng, full, checked)
        assert eng.last_full_load == "shared"
        seconds, sent = timed(lambda: eng.load_weights(full), args.repeats)
        assert set(sent) == {sent_once}, (sent_once, sent)
        rows.append(dict(method="full_shared", dtype=dtype, bytes_sent=sent[0], tensor_bytes=tensor_bytes,
                         seconds=statistics.median(seconds), min_seconds=min(seconds), seconds_all=seconds))
    finally:
        eng.close()
    reference = next(row for row in rows if row["method"] == "full")
    for row in rows:
        row["bytes_vs_full"] = row["bytes_sent"] / reference["bytes_sent"]
        row["seconds_vs_full"] = row["seconds"] / reference["seconds"]
    settings.update(
        matrices=len(names),
        checked=checked,
        max_abs_diff=diffs,
        max_abs_diff_rounded=diffs_rounded,
        full_params=sum(t.numel() for t in full.values()),
        local_merge_s=local_merge_s,
    )
    return rows, settings


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| method | dtype sent | bytes sent | tensor bytes | median s | min s | bytes vs full | time vs full |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['method']} | {row['dtype']} | {row['bytes_sent']:,} | {row['tensor_bytes']:,} "
            f"| {row['seconds']:.3f} | {row['min_seconds']:.3f} | {row['bytes_vs_full']:.3f} "
            f"| {row['seconds_vs_full']:.3f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], title: str, path: Path) -> None:
    plt = pyplot()

    names = [row["method"] for row in rows]
    colors = ["tab:blue", "tab:cyan", "tab:gray", "tab:olive"][: len(rows)]
    fig, (size, speed) = plt.subplots(1, 2, figsize=(10, 4))
    size.bar(names, [row["bytes_sent"] / 2**20 for row in rows], color=colors)
    size.set_yscale("log")
    size.set_ylabel("bytes sent per sync, MiB (log)")
    speed.bar(names, [row["seconds"] for row in rows], color=colors)
    speed.set_ylabel("median seconds per sync")
    for axis, key in ((size, "bytes_vs_full"), (speed, "seconds_vs_full")):
        for i, row in enumerate(rows):
            axis.annotate(f"×{row[key]:.3f}", (i, axis.patches[i].get_height()), ha="center", va="bottom")
    save_figure(fig, title, path)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    wall = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_sync_") as tmp:
        if args.shape == "tiny":
            model_dir = TINY_MODEL
        else:
            print("saving a random Qwen2.5-1.5B-shaped model ...", file=sys.stderr, flush=True)
            model_dir = Path(tmp)
            save_random_1_5b(model_dir, args.seed)
        rows, measured = run(args, model_dir)
    import vllm

    settings = dict(shape=args.shape, engine_dtype=SHAPES[args.shape]["dtype"], rank=args.rank,
                    repeats=args.repeats, update_scale=args.update_scale, seed=args.seed,
                    share_projection=args.share_projection,
                    torch_threads=torch.get_num_threads(),
                    **{key: os.environ.get(key) for key in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")},
                    vllm=vllm.__version__, torch=torch.__version__,
                    **measured, wall_s=time.perf_counter() - wall)
    print(markdown_table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "settings": settings}, indent=2) + "\n")
    title = (f"{'tiny_arith' if args.shape == 'tiny' else 'Qwen2.5-1.5B shape'}, {settings['engine_dtype']} engine, "
             f"{settings['matrices']} matrices, rank {args.rank}")
    plot(rows, title, args.plot)
    print(f"wrote {args.out} and {args.plot}", file=sys.stderr)


if __name__ == "__main__":  # vLLM starts its engine in new processes, which import this file again
    main()
