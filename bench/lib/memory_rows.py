"""bench.memory's rows, each measured in a worker process of its own (`python -m bench.memory ... --method M
--worker`), so that memory one method held, or an allocator kept, never shows up in another's numbers, and so that
one that runs out of memory fails alone: bench.memory's parent and bench.gpu_check's tables call `run_method`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench.lib import peers
from bench.lib.runs import ROOT

METHODS = ("dense_adamw", "dense_adamw_targets", "lora", "galore", "logra", "logra_adam")
# The optimizers a user would pick instead (bench/lib/peers.py: each at its paper's settings, on the target matrices),
# LoRA at ranks 16 and 1, and GaLore's layer-wise mode; `--methods peers` runs them beside dense AdamW and LoGRA.
PEER_METHODS = ("galore_layerwise", *[name for name in peers.PEERS if name != "galore"], "lora_r16", "lora_r1")
PEERS_RUN = ("dense_adamw", "dense_adamw_targets", "lora_r16", "lora_r1", "galore", *PEER_METHODS[:-2], "logra",
             "logra_adam")
# Not in the default run: `logra` again, but each step driven by a Lightning Trainer (SketchStrategy) and measured
# by lightning_logra.callbacks.MemoryProfiler instead of bench.memory's loop: its numbers beside `logra`'s check the
# profiler. `logra_ddp` and `logra_fsdp` run it on `--processes` processes (SketchDDPStrategy: every rank holds the
# whole model; SketchFSDPStrategy: each rank holds its shards), with sketch Adam, every rank on the same fixed batch,
# and report the largest rank's memory.
LIGHTNING_METHODS = ("logra_lightning", "logra_ddp", "logra_fsdp")
# Also not in the default run: LoGRA with one projection per input (sketch.share_projection), to set beside
# `logra` / `logra_adam`; and `dense_adamw_meta`, dense AdamW's floor counted on the meta device (for shapes where it
# cannot run).
# `dense_adamw_bf16`: bf16 weights and bf16 AdamW moments, no fp32 master (what the paper's dense figures measure).
EXTRA_METHODS = (*LIGHTNING_METHODS, "logra_shared", "logra_adam_shared", "dense_adamw_meta", "dense_adamw_bf16",
                 *PEER_METHODS)
LOGRA_METHODS = ("logra", "logra_adam", "logra_shared", "logra_adam_shared")

# Methods whose optimizer steps the weights themselves (AdamW and the peers): in bf16 they keep fp32 master weights.
FP32_MASTER = ("dense_adamw", "dense_adamw_targets", "galore", *[m for m in PEER_METHODS if not m.startswith("lora")])


def weights_kind(method: str, dtype: str) -> str:
    """How a method holds its weights: 'fp32', 'bf16', or 'fp32 master + bf16 autocast' (bf16-mixed)."""
    if dtype == "bf16" and method in FP32_MASTER:
        return "fp32 master + bf16 autocast"
    return dtype


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    # glibc keeps freed heap memory for reuse instead of returning it, so RSS would stay at its high-water mark
    # and the step average would be the peak. Serving every allocation above 64 KiB with its own mmap (and its
    # free with munmap) makes RSS follow the live tensors, as the CUDA allocator's counters do on a GPU.
    env["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    return env


def run_method(method: str, argv: list[str], timeout_s: float | None = None) -> dict:
    """One method's row, measured in a worker subprocess; an `error` row if it fails or runs past `timeout_s`."""
    if reason := peers.missing(method):
        print(f"{method} not run: {reason}", file=sys.stderr, flush=True)
        return dict(method=method, error=f"not run here: {reason}")
    command = [sys.executable, "-m", "bench.memory", *argv, "--method", method, "--worker"]
    print(f"running {method} ...", file=sys.stderr, flush=True)
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=worker_env(), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"{method} stopped after {timeout_s:.0f} s", file=sys.stderr, flush=True)
        return dict(method=method, error=f"stopped after its time limit of {timeout_s:.0f} s")
    if result.returncode != 0:
        # A MemoryError or an allocator error ends the worker with a traceback; the kernel's OOM killer with -9.
        lines = result.stderr.strip().splitlines()
        reason = lines[-1] if lines else ""
        if result.returncode == -9:
            reason = "killed (SIGKILL), most likely out of memory" + (f"; {reason}" if reason else "")
        print(f"{method} failed ({result.returncode}): {reason}", file=sys.stderr, flush=True)
        return dict(method=method, error=f"exit code {result.returncode}: {reason}")
    return json.loads(result.stdout.strip().splitlines()[-1])
