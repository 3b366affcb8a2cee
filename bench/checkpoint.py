"""What the sha256 digests add to saving and loading a checkpoint, at a real shape.

    python -m bench.checkpoint                      # the Qwen2.5-1.5B shape, bf16 weights, sketch Adam at rank 256
    python -m bench.checkpoint --shape 0.5b --rank 64

One checkpoint as a LoGRA run of `configs/qwen1_5b.yaml` writes it (the policy's bf16 state dict and the sketch Adam
state: two fp32 d×r tensors per target matrix), saved and loaded through `AtomicCheckpointIO` (digests recorded,
then checked) and through the same atomic write without them (Lightning's `TorchCheckpointIO` load), alternately,
`--repeats` times each into one folder (`--dir`, default a temporary one: put it on the disk the checkpoints go to).
The median times, the time the hashing takes alone (a save's time is mostly the disk's, and varies by seconds from
one to the next) and its rate are printed as a table and written as JSON and a plot. The page cache holds a file
just written, so loads read memory, not the disk: the share is an upper bound of what the digests add to a load from
disk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from lightning.fabric.plugins import TorchCheckpointIO

from bench.lib.plotting import pyplot, save_figure
from bench.lib.shapes import SHAPES, qwen2_model
from lightning_logra.sketch.config import DEFAULT_TARGETS
from lightning_logra.train.checkpoint import AtomicCheckpointIO
from lightning_logra.train.digests import HASH_THREADS, content_digests, tensor_leaves


def checkpoint_of(shape: str, rank: int) -> dict:
    """The tensors a LoGRA checkpoint of `shape` holds: the policy's bf16 weights and sketch Adam's two d×r fp32
    moments per target matrix (random values: their bytes are what is hashed)."""
    policy = qwen2_model(shape, torch.bfloat16, max_positions=4096)
    targets = [m for name, m in policy.named_modules() if name.rsplit(".", 1)[-1] in DEFAULT_TARGETS]
    state = {i: {"step": 10, "exp_avg": torch.randn(m.out_features, rank),  # (d, r) each
                 "exp_avg_sq": torch.rand(m.out_features, rank)} for i, m in enumerate(targets)}
    return {"state_dict": {f"policy.{k}": v for k, v in policy.state_dict().items()}, "global_step": 10,
            "optimizer_states": [{"state": state, "param_groups": [{"lr": 1e-6, "params": list(state)}]}]}


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(set(SHAPES) - {"tiny"}), default="1.5b")
    parser.add_argument("--rank", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="where the checkpoints are written (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=Path("bench/out/checkpoint.json"))
    parser.add_argument("--plot", type=Path, default=Path("bench/out/checkpoint.png"))
    args = parser.parse_args()

    checkpoint = checkpoint_of(args.shape, args.rank)
    size = sum(t.numel() * t.element_size() for _, t in tensor_leaves(checkpoint))
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = Path(folder) / "last.ckpt"
        times: dict[str, list[float]] = {"save": [], "save, digests": [], "load": [], "load, digests": []}
        hashing = []
        for _ in range(args.repeats):
            times["save"].append(timed(lambda: _save_without_digests(checkpoint, path)))
            times["load"].append(timed(lambda: TorchCheckpointIO().load_checkpoint(path, weights_only=True)))
            times["save, digests"].append(timed(lambda: AtomicCheckpointIO().save_checkpoint(checkpoint, path)))
            times["load, digests"].append(timed(lambda: AtomicCheckpointIO().load_checkpoint(path)))
            hashing.append(timed(lambda: content_digests(checkpoint)))
    median = {key: statistics.median(values) for key, values in times.items()}
    report = {
        "shape": args.shape, "rank": args.rank, "gib": size / 2**30, "median_s": median, "times_s": times,
        "hash_gib_per_s": size / 2**30 / statistics.median(hashing),
        "hash_s": statistics.median(hashing),
    }
    hash_s = statistics.median(hashing)
    # A save's time is mostly the disk's (write and fsync) and varies by several seconds from one to the next; the
    # digests' own cost is the hashing, measured alone, reported against the save and the load without them.
    print(f"| {args.shape}, rank {args.rank}: {report['gib']:.2f} GiB | without digests, s | with digests, s | "
          f"the hashing, s | its share of one without |")
    print("|---|---:|---:|---:|---:|")
    for kind in ("save", "load"):
        print(f"| {kind} | {median[kind]:.2f} | {median[kind + ', digests']:.2f} | {hash_s:.2f} | "
              f"{hash_s / median[kind]:.0%} |")
    print(f"sha256 over the checkpoint's tensors: {report['hash_gib_per_s']:.2f} GiB/s on {HASH_THREADS} threads")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for offset, label in ((-0.2, "without digests"), (0.2, "with digests")):
        suffix = "" if label.startswith("without") else ", digests"
        values = [median[kind + suffix] for kind in ("save", "load")]
        ax.bar([i + offset for i in range(2)], values, width=0.4, label=label)
    ax.set_xticks(range(2), ["save", "load"])
    ax.set_ylabel("seconds (median)")
    ax.legend()
    save_figure(fig, f"checkpoint of the {args.shape} shape ({report['gib']:.1f} GiB)", args.plot)


def _save_without_digests(checkpoint: dict, path: Path) -> None:
    """AtomicCheckpointIO's write (temporary file, fsync, rename) without the digests: what a save cost before."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(checkpoint, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


if __name__ == "__main__":
    main()
