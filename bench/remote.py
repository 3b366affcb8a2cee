"""Keeping an engine server in step over the network: bytes and seconds per step of the seed sync against a full
load and against the sparse bf16 delta other frameworks send, and a server that fell behind caught up by replaying
the update journal against a full load.

    python -m bench.remote                      # Qwen2.5-0.5B shape (full depth, random weights), bf16 and fp32
    python -m bench.remote --quick              # the shipped tiny model, fp32, served eager: about 40 s

One invocation starts one `lightning-logra serve` per dtype on 127.0.0.1 (vLLM's CPU backend here) and keeps it in
step with `RemoteEngine`, the trainer's side, over loopback TCP:

- **seed sync** (`RemoteEngine.apply_update`): per sketched matrix (q, k, v, o, gate, up, down of every layer) the
  factor F (d×r, float32 as the GPU configs send it) and A's seed, at rank 64 and 256; the time runs from the
  trainer's tensors to the server's merged, re-packed weights (serialization, HTTP, the checksum, vLLM's
  collective_rpc into the worker, the merge W −= F·A).
- **full load** (`RemoteEngine.load_weights`): every tensor of the model, in the server's dtype, in 512 MiB chunks.
- **sparse bf16 delta** (verl's and NeMo-RL's way of shipping a step's change of bf16 weights: the entries that
  changed, an int32 index and a bf16 value each): counted, not sent. The same merge as the trainer's (stochastic
  rounding with the step's key) applied to bf16 copies of the sketched matrices, with F = α·η·U at the GPU configs'
  learning rate (η = 1e-6, SketchAdam's U of unit entries, α = α_max = 1: the largest step their KL budget admits);
  the entries it changed, ×6 bytes. The figure depends on the weights' scale: random weights here have Qwen2's
  initializer std 0.02, about the scale of a trained Qwen's projections.
- **catch-up**: the server 1, 10 and 100 updates behind (rank 64, the last dtype): replaying them (each posted as
  the journal would) against one full load, bytes and seconds; `RemoteEngine` picks the fewer bytes.

The server compiles its model (torch.compile) at the start unless `--enforce-eager` (on with `--quick`) passes vLLM's
own option: nothing here generates, so only the start-up differs (compiling the tiny model took 35 s of its minute).

The 7B and 32B rows are computed from the published shapes (no model is built): the seed sync's bytes Σ d·r·4 over
the sketched matrices plus each matrix's header (as measured at 0.5B), the full load's Σ numel·2 (bf16), and the
sparse delta's changed fraction as measured at 0.5B × the sketched entries × 6 bytes.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import argparse  # noqa: E402
import json  # noqa: E402
import secrets  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from bench.lib.payloads import make_payload, read_tensors, target_names  # noqa: E402
from bench.lib.plotting import pyplot, save_figure  # noqa: E402
from bench.lib.shapes import TINY_MODEL, qwen2_model  # noqa: E402
from lightning_logra.sketch.update import LowRankDelta  # noqa: E402

LR, ALPHA = 1e-6, 1.0  # the GPU configs' SketchAdam lr and α_max
# Published configurations (hidden, intermediate, layers, attention heads, kv heads, vocab, tied embeddings).
PUBLISHED = {
    "7b": (3584, 18944, 28, 28, 4, 152064, False),
    "32b": (5120, 27648, 64, 40, 8, 152064, False),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="the shipped tiny model (fp32, rank 16), served eager: about 40 s")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="serve without torch.compile (vLLM's --enforce-eager): a faster start, the same syncs")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--ranks", default="64,256")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per method (the median is reported)")
    parser.add_argument("--behind", default="1,10,100", help="updates a server is behind, for the catch-up rows")
    parser.add_argument("--memory", type=float, default=0.22, help="the server's share of host memory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=Path("bench/out/remote"))
    args = parser.parse_args(argv)
    if args.quick:
        args.dtypes, args.ranks, args.behind, args.memory, args.repeats = "float32", "16", "1,10", 0.1, 2
        args.enforce_eager = True
    args.dtypes, args.ranks = args.dtypes.split(","), [int(r) for r in args.ranks.split(",")]
    args.behind = [int(n) for n in args.behind.split(",")]
    return args


def save_model(directory: Path, quick: bool, dtype: torch.dtype, seed: int) -> None:
    if quick:
        shutil.copytree(TINY_MODEL, directory, dirs_exist_ok=True)
        return
    torch.manual_seed(seed)
    model = qwen2_model("0.5b", dtype, 256)
    model.save_pretrained(directory)
    del model
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_MODEL / name, directory / name)


def serve(model_dir: Path, dtype: str, memory: float, token: str, log_path: Path,
          eager: bool = False) -> tuple[subprocess.Popen, str]:
    """`lightning-logra serve` on a free port (`eager`: with vLLM's --enforce-eager); returns once it answers (or
    raises with the end of its log)."""
    import requests

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    positions = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    command = [sys.executable, "-m", "lightning_logra.rollout.server", "--model", str(model_dir), "--port", str(port),
               "--dtype", dtype, "--gpu-memory-utilization", str(memory), "--max-model-len", str(positions),
               "--max-body-mib", "4096"] + (["--", "--enforce-eager"] if eager else [])
    with open(log_path, "wb") as out:
        process = subprocess.Popen(command, env={**os.environ, "LOGRA_SERVER_TOKEN": token}, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    while process.poll() is None:
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except requests.RequestException:
            time.sleep(1)
    raise RuntimeError(f"the server exited with {process.returncode}: {log_path.read_text()[-2000:]}")


def timed(call, repeats: int) -> tuple[float, object]:
    seconds, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = call()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), result


def changed_entries(weights: dict[str, torch.Tensor], rank: int, seed: int) -> tuple[int, int]:
    """(entries a stochastic-rounding merge of one step changes, entries) over the sketched bf16 matrices."""
    changed = total = 0
    gen = torch.Generator().manual_seed(seed)
    for i, weight in enumerate(weights.values()):
        w = weight.to(torch.bfloat16).clone()
        factor = torch.randn(w.shape[0], rank, generator=gen) * (ALPHA * LR)
        LowRankDelta(factor, seed * 1_000_003 + i, "rademacher", w.shape[1], rounding_key=seed + i).apply_(w)
        changed += int((w != weight.to(torch.bfloat16)).sum())
        total += w.numel()
    return changed, total


def published_bytes(shape: tuple, rank: int, header_bytes: float, changed_fraction: float) -> dict:
    hidden, inter, layers, heads, kv, vocab, tied = shape
    head_dim = hidden // heads
    matrices = {"q": (hidden, hidden), "k": (kv * head_dim, hidden), "v": (kv * head_dim, hidden),
                "o": (hidden, hidden), "gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    sketched = layers * sum(d * k for d, k in matrices.values())
    seed_sync = layers * (sum(d for d, _ in matrices.values()) * rank * 4 + 7 * header_bytes)
    per_layer = sketched // layers + 2 * hidden + (hidden + 2 * kv * head_dim)  # norms and q/k/v biases
    total = layers * per_layer + vocab * hidden * (1 if tied else 2) + hidden
    return {"seed_sync": seed_sync, "full_bf16": total * 2, "sparse_bf16": changed_fraction * sketched * 6,
            "parameters": total}


def main(argv: list[str] | None = None) -> None:
    from lightning_logra.rollout import RemoteEngine

    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    os.environ["LOGRA_SERVER_TOKEN"] = token
    rows, catch_up, sparse = [], [], {}
    tmp = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    try:
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            model_dir = tmp / dtype_name
            save_model(model_dir, args.quick, dtype, args.seed)
            process, url = serve(model_dir, dtype_name, args.memory, token, args.out_dir / f"serve_{dtype_name}.log",
                                 args.enforce_eager)
            engine = RemoteEngine(urls=[url], start_timeout_s=900, request_timeout_s=1800, journal_steps=1)
            try:
                engine.start(str(model_dir), 0, [])
                names = target_names(model_dir)
                shapes = {n: tuple(t.shape) for n, t in read_tensors(model_dir, names).items()}
                everything = read_tensors(model_dir, _all_names(model_dir))
                full_s, full_bytes = timed(lambda e=engine, t=everything: e.load_weights(t), args.repeats)
                for rank in args.ranks:
                    payloads = [make_payload(shapes, rank, 1e-3, args.seed + i, torch.float32)
                                for i in range(args.repeats)]
                    engine.apply_update(payloads[0])  # untimed: the CPU backend recovers its packed weights once
                    seconds = []
                    for payload in payloads:
                        start = time.perf_counter()
                        sent = engine.apply_update(payload)
                        seconds.append(time.perf_counter() - start)
                    factors = sum(d * rank * 4 for d, _ in shapes.values())
                    rows.append({"dtype": dtype_name, "rank": rank, "seed_sync_bytes": sent,
                                 "seed_sync_s": statistics.median(seconds), "full_bytes": full_bytes,
                                 "full_s": full_s, "header_bytes_per_matrix": (sent - factors) / len(shapes)})
                    print(json.dumps(rows[-1]), flush=True)
                    if dtype == torch.bfloat16 and rank not in sparse:
                        changed, total = changed_entries(read_tensors(model_dir, names), rank, args.seed)
                        sparse[rank] = {"changed": changed, "entries": total, "fraction": changed / total,
                                        "bytes": changed * 6}
                        print(json.dumps({"sparse_bf16": sparse[rank]}), flush=True)
                if dtype_name == args.dtypes[-1]:
                    catch_up = measure_catch_up(engine, shapes, args, full_bytes, full_s)
            finally:
                engine.close()
                process.terminate()
                process.wait(timeout=60)
        computed = {}
        header = statistics.mean(r["header_bytes_per_matrix"] for r in rows)
        fraction = {rank: s["fraction"] for rank, s in sparse.items()}
        for shape in PUBLISHED:
            for rank in args.ranks:
                computed[f"{shape} r{rank}"] = published_bytes(PUBLISHED[shape], rank, header,
                                                               fraction.get(rank, float("nan")))
        result = {"settings": vars(args) | {"out_dir": str(args.out_dir)}, "rows": rows, "sparse_bf16": sparse,
                  "catch_up": catch_up, "published": computed}
        (args.out_dir / "remote.json").write_text(json.dumps(result, indent=2, default=str))
        table = markdown(result)
        (args.out_dir / "remote.md").write_text(table)
        print(table)
        plot(result, args.out_dir / "remote.png")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _all_names(model_dir: Path) -> list[str]:
    from safetensors import safe_open

    names = []
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names += list(f.keys())
    return names


def measure_catch_up(engine, shapes: dict, args, full_bytes: int, full_s: float) -> list[dict]:
    """The server n updates behind: the n updates posted in order (as `RemoteEngine` replays the journal) against
    the full load measured above."""
    from lightning_logra.rollout.protocol import Label

    rank = args.ranks[0]
    out = []
    for n in args.behind:
        server = engine.servers[0]
        updates = [make_payload(shapes, rank, 1e-3, 10_000 + i, torch.float32).to_bytes() for i in range(n)]
        start = time.perf_counter()
        for data in updates:
            engine.journal.record(data)
            server.update(data, Label(engine.journal.run, engine.journal.version))
        seconds = time.perf_counter() - start
        replay = sum(len(u) for u in updates)
        out.append({"behind": n, "rank": rank, "replay_bytes": replay, "replay_s": seconds,
                    "full_bytes": full_bytes, "full_s": full_s, "chosen": "replay" if replay <= full_bytes else "full"})
        print(json.dumps(out[-1]), flush=True)
    return out


def markdown(result: dict) -> str:
    lines = ["| dtype | rank | seed sync MB | seed sync s | full load MB | full load s | sparse bf16 delta MB | "
             "seed / full |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        sparse = result["sparse_bf16"].get(row["rank"]) if row["dtype"] == "bfloat16" else None
        delta = f"{sparse['bytes'] / 1e6:.1f} ({100 * sparse['fraction']:.2f}% changed)" if sparse else "—"
        lines.append(f"| {row['dtype']} | {row['rank']} | {row['seed_sync_bytes'] / 1e6:.1f} | "
                     f"{row['seed_sync_s']:.2f} | {row['full_bytes'] / 1e6:.0f} | {row['full_s']:.2f} | {delta} | "
                     f"{row['seed_sync_bytes'] / row['full_bytes']:.3f} |")
    lines += ["", "| behind | replay MB | replay s | full load MB | full load s | chosen |",
              "|---:|---:|---:|---:|---:|---|"]
    for row in result["catch_up"]:
        lines.append(f"| {row['behind']} | {row['replay_bytes'] / 1e6:.1f} | {row['replay_s']:.2f} | "
                     f"{row['full_bytes'] / 1e6:.0f} | {row['full_s']:.2f} | {row['chosen']} |")
    lines += ["", "| shape | seed sync MB/step | sparse bf16 delta MB/step | full bf16 load MB |",
              "|---|---:|---:|---:|"]
    for name, row in result["published"].items():
        lines.append(f"| {name} | {row['seed_sync'] / 1e6:.0f} | {row['sparse_bf16'] / 1e6:.0f} | "
                     f"{row['full_bf16'] / 1e6:.0f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    behind = [r["behind"] for r in result["catch_up"]]
    if behind:
        ax.plot(behind, [r["replay_s"] for r in result["catch_up"]], "o-", label="replay the journal")
        ax.plot(behind, [r["full_s"] for r in result["catch_up"]], "s--", label="full load")
        ax.set_xscale("log")
        ax.set_xlabel("updates behind")
        ax.set_ylabel("seconds to catch up")
        ax.legend()
    save_figure(fig, "A server behind: replaying the update journal vs a full load (loopback)", path)


if __name__ == "__main__":
    main()
