"""What the check's stages run (`Plan`: the GPU's, and the CPU dry run's), what they report through, and what they
share."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bench.lib.runs import ROOT

Progress = Callable[[dict], None]  # a stage hands its partial result to be written before it is done


class StageSkipped(Exception):
    """A stage that cannot run here (what it needs is missing): recorded as skipped, with the reason."""


@dataclass
class Plan:
    """What each stage runs: `gpu()` for the real check, `dry()` for the CPU run a test makes."""

    device: str
    # memory_table: per shape, bench.memory's options besides --shape/--methods/--device, and its methods
    memory: dict[str, list[str]]
    memory_methods: dict[str, tuple[str, ...]]
    peer_methods: tuple[str, ...]  # peer_table: at the first memory shape
    profile_methods: tuple[str, ...]  # profile: at the first memory shape, one profiled step each
    time_s: float  # no stage, and no row of a table, starts after this many seconds of the check
    method_timeout_s: float  # one bench.memory worker
    tests_timeout_s: float
    kl_shape: str
    kl_rank: int | None  # None: configs/qwen1_5b.yaml's rank
    kl_batch: dict[str, int]  # batch, group, micro_batch, prompt_len, completion_len
    kl_steps: int
    kl_budget_s: float  # no new step starts after this
    arith_steps: int
    arith_budget_s: float  # the Trainer's max_time
    full_load_shape: str
    full_load_repeats: int  # timed loads per path
    colocated_steps: int
    colocated_timeout_s: float
    fail_stage: str | None = field(default=None)  # a stage made to raise, to check that the others still run
    ends_at: float = math.inf  # time.monotonic() past which nothing new starts (set at the start: time_s)

    @classmethod
    def gpu(cls) -> Plan:
        # The paper's sequence shape (256-token prompts, 1024-token completions) with one group of 8 samples per
        # step: 8 sequences are enough for a step's memory (it is the micro-batch that sets the activations) and
        # keep all six memory workers near 2–3 minutes together; 3 steps: the first (optimizer state allocated)
        # and two more to average. The configs' micro-batches (4 for 1.5B, 2 for 7B) and gradient checkpointing.
        # Rank 256 as in configs/qwen1_5b.yaml and qwen7b.yaml: below every target's in_features (k_proj and
        # v_proj read the hidden size, 1536 and 3584), which a sketch needs.
        # Dense AdamW's fp32 master weights do not fit at 7B (out of memory on 139 GiB): its bf16 row stands there.
        common = ["--dtype", "bf16", "--rank", "256", "--batch", "8", "--group", "8", "--prompt-len", "256",
                  "--completion-len", "1024", "--steps", "3", "--gradient-checkpointing"]
        return cls(
            device="cuda",
            memory={"1.5b": [*common, "--micro-batch", "4"], "7b": [*common, "--micro-batch", "2"]},
            memory_methods={"1.5b": ("logra_adam", "dense_adamw", "dense_adamw_bf16", "lora", "logra"),
                            "7b": ("logra_adam", "lora", "dense_adamw_bf16")},
            peer_methods=("galore_layerwise", "apollo_mini", "adafactor", "adamw_8bit", "fira"),
            profile_methods=("logra_adam", "dense_adamw", "lora"),
            time_s=420,  # 7 minutes: with the stage under way, the check fits one 10-minute device call
            method_timeout_s=240, tests_timeout_s=300,
            kl_shape="1.5b", kl_rank=None,
            kl_batch=dict(batch=8, group=8, micro_batch=4, prompt_len=256, completion_len=1024),
            kl_steps=8, kl_budget_s=90,
            arith_steps=50, arith_budget_s=180,
            full_load_shape="7b", full_load_repeats=2,  # 15 GB per load: the case the handles are for
            colocated_steps=20, colocated_timeout_s=180,  # the engine's start (CUDA graphs) is most of it
        )

    @classmethod
    def dry(cls) -> Plan:
        # Tiny shapes and few steps: every code path of the real check, on the CPU, in about a minute.
        common = ["--dtype", "bf16", "--rank", "16", "--batch", "4", "--group", "4", "--micro-batch", "2",
                  "--prompt-len", "8", "--completion-len", "8", "--steps", "2", "--gradient-checkpointing"]
        return cls(
            device="cpu",
            memory={"tiny": common},
            # Each path of the real check once: every worker is a process start of a few seconds.
            memory_methods={"tiny": ("logra_adam", "dense_adamw_bf16", "lora")},
            peer_methods=("adafactor",),  # transformers' own: importable wherever the check runs
            profile_methods=("logra_adam",),
            time_s=3600,
            method_timeout_s=300, tests_timeout_s=300,
            kl_shape="tiny", kl_rank=16,
            kl_batch=dict(batch=4, group=4, micro_batch=2, prompt_len=8, completion_len=8),
            kl_steps=2, kl_budget_s=120,
            arith_steps=2, arith_budget_s=300,
            full_load_shape="tiny", full_load_repeats=2,
            colocated_steps=2, colocated_timeout_s=300,
        )


def synchronize(device: torch.device) -> None:
    """Waits for the GPU's queued kernels, so that a time read after it is the GPU's (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def through_cli(config: str, *overrides: str, fit: bool = False):
    """configs/`config` with `overrides` through the command line itself (`lightning_logra.cli.main`): parsed and its
    classes instantiated, nothing loaded (the module, the data module, the trainer and its callbacks as a run gets
    them), or with `fit` also trained. Returns the LightningCLI."""
    if importlib.util.find_spec("jsonargparse") is None:
        raise StageSkipped("jsonargparse is not installed (a dependency of lightning-logra, left out by an install "
                           "with --no-deps): the stage reads its config through the command line's parser")
    from lightning_logra.cli import main

    args = ["--config", str(ROOT / "configs" / config), *overrides]
    return main(["fit", *args] if fit else args, run=fit)
