"""Memory and time of one RL update per method, side by side on the same model and the same rollouts.

    python bench/memory.py                                   # Qwen2.5-0.5B shape, fp32, all six methods
    python bench/memory.py --shape 1.5b --dtype bf16 --methods logra,lora --out bench/out/memory_1_5b.json

Generation is left out: every method trains on the same fixed prompts, completions and advantages, built from
`--seed`. The model is a `transformers` Qwen2 with random weights in the shape of the chosen Qwen2.5 size (the
memory and the time of a step do not depend on the weights' values). Each method runs in its own subprocess
(this script again, with `--worker`), so that memory one method held, or an allocator kept, never shows up in
another's numbers, and so that one that runs out of memory fails alone.

With `--dtype bf16` the methods that update weights with AdamW (dense AdamW on everything or on the targets, GaLore)
keep fp32 master weights and run the forward under bf16 autocast, as `precision: bf16-mixed` does: AdamW stepping
bf16 weights rounds each update to nearest and loses most of it at RL learning rates, so that would not be a fair
baseline. LoRA keeps the base weights in bf16 (peft holds its adapters in fp32) and LoGRA trains the bf16 weights
themselves (its merge rounds stochastically). The table's "weights" column says which.

A step is the forward, loss, backward over all micro-batches, the optimizer step and zero_grad. Memory is the
process's resident set size sampled during each step: the peak is the maximum over all steps (the first included,
where the optimizers allocate their state), the average and the median step time leave the first step out.

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
    python bench/memory.py --shape 7b --dtype bf16 --methods logra_adam,dense_adamw_meta --batch 2 --group 2 \
        --micro-batch 1 --completion-len 1024 --steps 1 --kl-check 1 --gradient-checkpointing

Every row of this script's own loop also gives `saved_bytes`: the bytes autograd saves for the backward pass during
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
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

import peers  # bench/peers.py (this script's folder is on sys.path)
from lightning_logra.algo.advantages import group_advantages
from lightning_logra.algo.kl import intended_kl, predicted_kl, realized_kl, step_scale
from lightning_logra.algo.logprobs import completion_logits, completion_logprobs, token_logprobs
from lightning_logra.algo.losses import token_weights
from lightning_logra.algo.update import Update
from lightning_logra.base.batch import Rollout
from lightning_logra.callbacks.memory import GIB, StepSampler, cuda_allocated_reader, process_rss_reader
from lightning_logra.sketch import SketchAdam, SketchOptimizer, SketchSGD, sketched_layers
from lightning_logra.sketch.config import DEFAULT_TARGETS, SketchConfig
from lightning_logra.sketch.memory import memory_breakdown, saved_activation_bytes
from lightning_logra.sketch.rounding import LOW_PRECISION
from plotting import pyplot, save_figure  # bench/plotting.py

METHODS = ("dense_adamw", "dense_adamw_targets", "lora", "galore", "logra", "logra_adam")
# The optimizers a user would pick instead (bench/peers.py: each at its paper's settings, on the target matrices),
# LoRA at ranks 16 and 1, and GaLore's layer-wise mode; `--methods peers` runs them beside dense AdamW and LoGRA.
PEER_METHODS = ("galore_layerwise", *[name for name in peers.PEERS if name != "galore"], "lora_r16", "lora_r1")
PEERS_RUN = ("dense_adamw", "dense_adamw_targets", "lora_r16", "lora_r1", "galore", *PEER_METHODS[:-2], "logra",
             "logra_adam")
# Not in the default run: `logra` again, but each step driven by a Lightning Trainer (SketchStrategy) and measured
# by lightning_logra.callbacks.MemoryProfiler instead of this script's loop: its numbers beside `logra`'s check the
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

# Qwen2.5 sizes (their config.json); tie_word_embeddings as they ship. "tiny" is for tests.
SHAPES = {
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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


# ---------------------------------------------------------------- worker: one method in this process


def qwen2_model(shape: str, dtype: torch.dtype, max_positions: int, device: str = "cpu",
                **overrides) -> torch.nn.Module:
    """A Qwen2 with random weights in the shape of a Qwen2.5 size (`SHAPES`), built directly in `dtype` on `device`:
    a 7B model built in fp32 first (30 GB) would not fit this machine, and one initialized on the CPU and then
    copied to a GPU would spend minutes drawing random numbers. `overrides` change config fields (fewer layers)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{**SHAPES[shape], **overrides}, max_position_embeddings=max_positions)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)


# Methods whose optimizer steps the weights themselves (AdamW and the peers): in bf16 they keep fp32 master weights.
FP32_MASTER = ("dense_adamw", "dense_adamw_targets", "galore", *[m for m in PEER_METHODS if not m.startswith("lora")])


def weights_kind(method: str, dtype: str) -> str:
    """How a method holds its weights: 'fp32', 'bf16', or 'fp32 master + bf16 autocast' (bf16-mixed)."""
    if dtype == "bf16" and method in FP32_MASTER:
        return "fp32 master + bf16 autocast"
    return dtype


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(args.seed)
    dtype = torch.float32 if weights_kind(args.method or "", args.dtype).startswith("fp32") else DTYPES[args.dtype]
    layers = {} if args.layers is None else {"num_hidden_layers": args.layers}
    model = qwen2_model(args.shape, dtype, args.prompt_len + args.completion_len, args.device, **layers)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()  # as RLVRModule does for model.training.gradient_checkpointing
        model.config.use_cache = False
    return model


def fixed_batch(args: argparse.Namespace, vocab_size: int) -> dict[str, torch.Tensor]:
    """Rollouts as the trainer sees them, a pure function of the seed, so every worker trains on the same ones."""
    gen = torch.Generator().manual_seed(args.seed)
    n, p, c = args.batch, args.prompt_len, args.completion_len
    # Samples of one prompt are adjacent and share it, as in a GRPO batch.
    prompts = torch.randint(vocab_size, (n // args.group, p), generator=gen)
    prompt_ids = prompts.repeat_interleave(args.group, dim=0)  # (n, P)
    completion_ids = torch.randint(vocab_size, (n, c), generator=gen)  # (n, C)
    # Completions end at different lengths (right padding), so the dapo weights are not uniform.
    lengths = torch.randint(c // 2, c + 1, (n,), generator=gen)
    completion_mask = (torch.arange(c) < lengths[:, None]).long()  # (n, C)
    rewards = torch.randint(2, (n,), generator=gen).float()
    advantages = group_advantages(rewards, args.group)  # (n,)
    return dict(
        prompt_ids=prompt_ids,
        prompt_mask=torch.ones_like(prompt_ids),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        # Per-token weight times advantage (n, C): the loss of a micro-batch is −Σ coef·log π.
        coef=token_weights(completion_mask, "dapo", c) * advantages[:, None],
    )


def is_target(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in DEFAULT_TARGETS


def set_up(method: str, model: torch.nn.Module, args: argparse.Namespace):
    """Prepare `model` for `method`; returns (the module to run forward on, its optimizers)."""
    if method in ("dense_adamw", "dense_adamw_bf16"):  # the moments in the weights' dtype
        return model, [torch.optim.AdamW(model.parameters(), lr=args.lr)]
    if method in LOGRA_METHODS:
        optimizer = SketchAdam if method.startswith("logra_adam") else SketchSGD
        sketch = SketchConfig(rank=args.rank, optimizer=partial(optimizer, lr=args.lr),
                              share_projection=method.endswith("_shared"))
        return model, sketch.build_optimizers(model, sketch.install(model))
    if method.startswith("lora"):
        from peft import LoraConfig, get_peft_model

        # get_peft_model freezes everything but the adapters. lora_r16 / lora_r1: that rank, whatever --rank says.
        rank = int(method.removeprefix("lora_r")) if method != "lora" else args.rank
        lora = LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=list(DEFAULT_TARGETS))
        peft_model = get_peft_model(model, lora)
        trainable = [p for p in peft_model.parameters() if p.requires_grad]
        return peft_model, [torch.optim.AdamW(trainable, lr=args.lr)]
    # dense_adamw_targets and the peers: the target matrices only, everything else frozen.
    targets = []
    for name, param in model.named_parameters():
        param.requires_grad_(is_target(name))
        if is_target(name):
            targets.append(param)
    if method == "dense_adamw_targets":
        return model, [torch.optim.AdamW(targets, lr=args.lr)]
    # GaLore's projection is recomputed (an SVD) every 200 steps (update_proj_gap): within this benchmark once, in
    # the warm-up step; APOLLO's random projection likewise.
    return model, [peers.build(method, model, targets, args.rank, args.lr)]


def policy_loss(policy: torch.nn.Module, batch: dict[str, torch.Tensor], chunk_tokens: int = 0) -> torch.Tensor:
    """−Σ coef·log π over the batch's completion tokens (the logits are dropped before the caller's backward, as a
    trainer's micro-batch loop drops them when they go out of scope). `chunk_tokens` > 0: the trainer's chunked
    path (`lightning_logra.algo.logprobs`), whose logits exist that many tokens at a time."""
    if chunk_tokens > 0:
        logprobs, _ = completion_logprobs(policy, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                          batch["completion_mask"], chunk_tokens=chunk_tokens)
        return -(batch["coef"] * logprobs).sum()
    logits = completion_logits(
        policy, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"]
    )  # (m, C, V)
    return -(batch["coef"] * token_logprobs(logits, batch["completion_ids"])).sum()


class KLCheck:
    """The predicted-KL controller's work in one step, as `PredictedKLBudget` does it, on the first `count` responses
    of the batch: asked for α between the sketch optimizer's proposal and its merge, then the realized KL."""

    def __init__(self, policy: torch.nn.Module, batch: dict[str, torch.Tensor], count: int, budget: float) -> None:
        self.policy, self.budget = policy, budget
        keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
        mask = batch["completion_mask"][:count]
        self.responses = Rollout(*(batch[key][:count] for key in keys), sampler_logprobs=torch.zeros_like(mask).float())
        self.seconds = 0.0  # this step's, reset by the caller

    def alpha(self, optimizer: SketchOptimizer) -> float:
        start = time.perf_counter()
        proposal = Update(optimizer.proposal())
        q, self.before = predicted_kl(self.policy, proposal, self.responses)
        alpha = step_scale(float(q), self.budget, 1.0)
        if any(p.dtype in LOW_PRECISION for p in self.policy.parameters()):
            intended_kl(self.policy, proposal, self.responses, self.before, alpha)  # logged as kl/intended in bf16
        self.seconds += time.perf_counter() - start
        return alpha

    def realized(self) -> None:
        start = time.perf_counter()
        realized_kl(self.policy, self.responses, self.before)
        self.before = None
        self.seconds += time.perf_counter() - start


def train_step(policy: torch.nn.Module, optimizers: list, batch: dict[str, torch.Tensor], micro_batch: int,
               backward: Callable[[torch.Tensor], None] = torch.Tensor.backward, chunk_tokens: int = 0,
               kl: KLCheck | None = None, reduce: Callable[[], None] | None = None, mixed: bool = False) -> None:
    """Forward and backward over the micro-batches, `reduce` (the gradients' sum over processes), the steps (with
    `kl`: the sketch optimizer's asks the KL check for α). `mixed`: the forward alone under bf16 autocast, as
    `bf16-mixed` runs it; the optimizers step the fp32 weights outside it, so their states stay fp32 (inside it, a
    projecting optimizer's matmuls would return bf16 and its moments would be kept in bf16)."""
    device_type = next(policy.parameters()).device.type
    for start in range(0, batch["coef"].shape[0], micro_batch):
        micro = {key: value[start:start + micro_batch] for key, value in batch.items()}
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=mixed):
            loss = policy_loss(policy, micro, chunk_tokens)
        backward(loss)
    if reduce is not None:
        reduce()
    for optimizer in optimizers:
        if kl is not None and isinstance(optimizer, SketchOptimizer):
            optimizer.propose()
            optimizer.step(alpha=kl.alpha(optimizer))  # the proposal measured, then applied
            kl.realized()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def run_lightning_worker(args: argparse.Namespace) -> dict | None:
    """The `logra` steps inside a real Trainer (manual optimization), measured by MemoryProfiler: one process
    (SketchStrategy), or `--processes` of them (SketchDDPStrategy, SketchFSDPStrategy; the largest rank's figures,
    returned by rank 0 alone)."""
    from lightning.pytorch import Callback, LightningModule, Trainer

    from lightning_logra.callbacks.memory import MemoryProfiler
    from lightning_logra.train.strategies import SketchDDPStrategy, SketchStrategy
    from lightning_logra.train.strategies.fsdp import SketchFSDPStrategy

    class Replay(LightningModule):
        """Trains `policy` on the fixed batch at every step, as `train_step` does."""

        def __init__(self, policy: torch.nn.Module, batch: dict[str, torch.Tensor]) -> None:
            super().__init__()
            self.policy, self.batch = policy, batch
            self.automatic_optimization = False

        def configure_model(self):
            # The policy exists already; its sketches go in before the strategy sets it up (shards it under FSDP).
            if not sketched_layers(self.policy):
                sketch.install(self.policy)

        def training_step(self, _, batch_idx):
            optimizer = self.optimizers()
            params = [p for group in optimizer.param_groups for p in group["params"]]
            train_step(self.policy, [optimizer], self.batch, args.micro_batch, self.manual_backward,
                       args.logprob_chunk, reduce=lambda: self.trainer.strategy.sum_gradients(params))

        def train_dataloader(self):
            return torch.utils.data.DataLoader(range(args.steps), batch_size=1)

        def configure_optimizers(self):
            return sketch.build_optimizers(self.policy, sketched_layers(self.policy))

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_train_batch_start(self, *_):
            self._start = time.perf_counter()

        def on_train_batch_end(self, *_):
            self.seconds.append(time.perf_counter() - self._start)

    class LargestRank(Callback):
        """At the end: the largest peak, step average and model state (weights, their gradients, sketches,
        optimizer state: `memory_breakdown` without the cached projections) over the ranks."""

        def on_train_end(self, trainer, pl_module):
            breakdown = profiler.breakdown
            state = breakdown.total - breakdown.projections
            averages = [average for average, _ in profiler.steps]
            mine = torch.tensor([max(peak for _, peak in profiler.steps), statistics.mean(measured(averages)),
                                 state / GIB], dtype=torch.float64, device=pl_module.device)
            self.largest = trainer.strategy.reduce(mine, reduce_op="max").tolist()

    model = build_model(args)
    batch = {key: value.to(args.device) for key, value in fixed_batch(args, model.config.vocab_size).items()}
    profiler, timer, largest = MemoryProfiler(), StepTimer(), LargestRank()
    # The multi-process rows with sketch Adam, whose d×r state shows how it is split over the ranks.
    optimizer = SketchSGD if args.method == "logra_lightning" else SketchAdam
    sketch = SketchConfig(rank=args.rank, optimizer=partial(optimizer, lr=args.lr))
    backend = "nccl" if args.device == "cuda" else "gloo"
    processes = 1 if args.method == "logra_lightning" else args.processes
    if args.method == "logra_lightning":
        strategy = SketchStrategy(sketch, device="cuda:0" if args.device == "cuda" else "cpu")
    elif args.method == "logra_ddp":
        strategy = SketchDDPStrategy(sketch, process_group_backend=backend)
    else:
        strategy = SketchFSDPStrategy(sketch, process_group_backend=backend)
    trainer = Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu", devices=processes, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[timer, profiler, largest], strategy=strategy, use_distributed_sampler=False,
    )
    trainer.fit(Replay(model.train(), batch))
    if trainer.global_rank != 0:
        return None
    peak, average, state = largest.largest
    row = dict(method=args.method, weights=weights_kind(args.method, args.dtype), peak_gib=peak, avg_gib=average,
               step_s=statistics.median(measured(timer.seconds)))
    if processes > 1:
        row.update(processes=processes, state_gib=state)  # per rank: the largest rank's
    return row


def measured(values: list[float]) -> list[float]:
    """The steps after the warm-up (the only step, if there is one)."""
    return values[1:] or values


def meta_floor(args: argparse.Namespace) -> dict:
    """Dense AdamW's floor, counted on the meta device: 16 bytes per parameter (fp32 weights, or fp32 master weights
    under bf16 autocast; fp32 gradients; two fp32 moments), before activations, logits and the process itself."""
    layers = {} if args.layers is None else {"num_hidden_layers": args.layers}
    model = qwen2_model(args.shape, torch.float32, args.prompt_len + args.completion_len, "meta", **layers)
    floor = 16 * sum(p.numel() for p in model.parameters()) / GIB
    return dict(method=args.method, weights=weights_kind("dense_adamw", args.dtype) + " (meta: states only)",
                peak_gib=floor, avg_gib=floor)  # no step ran: no time, nothing saved for a backward


def run_worker(args: argparse.Namespace) -> dict | None:
    if args.method in LIGHTNING_METHODS:
        return run_lightning_worker(args)
    if args.method == "dense_adamw_meta":
        return meta_floor(args)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    model = build_model(args)
    batch = {key: value.to(device) for key, value in fixed_batch(args, model.config.vocab_size).items()}
    policy, optimizers = set_up(args.method, model, args)
    policy.train()
    mixed = weights_kind(args.method, args.dtype).startswith("fp32 master")
    kl = KLCheck(policy, batch, args.kl_check, args.kl_budget) if args.kl_check and "logra" in args.method else None
    sampler = StepSampler(cuda_allocated_reader(device) if cuda else process_rss_reader())
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)  # the model's construction is not a step
    averages, peaks, seconds, kl_seconds = [], [], [], []
    for _ in range(0 if args.saved_bytes_only else args.steps):
        sampler.start()
        start = time.perf_counter()
        if kl is not None:
            kl.seconds = 0.0
        train_step(policy, optimizers, batch, args.micro_batch, chunk_tokens=args.logprob_chunk, kl=kl, mixed=mixed)
        if cuda:
            torch.cuda.synchronize(device)  # kernels run asynchronously: the step ends when the GPU is done
        seconds.append(time.perf_counter() - start)
        average, peak = sampler.stop()
        if cuda:
            # The allocator's high-water mark since the reset: the peak over the steps so far, exactly.
            peak = torch.cuda.max_memory_allocated(device)
        averages.append(average)
        peaks.append(peak)
        kl_seconds.append(kl.seconds if kl else math.nan)
    profile = None
    if args.profile and not args.saved_bytes_only:
        profile = profiled_step(lambda: train_step(policy, optimizers, batch, args.micro_batch,
                                                   chunk_tokens=args.logprob_chunk, kl=kl, mixed=mixed), device)
    micro = {key: value[: args.micro_batch] for key, value in batch.items()}
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed):
        saved = saved_activation_bytes(lambda: policy_loss(policy, micro, args.logprob_chunk), policy.parameters())
    row = dict(method=args.method, weights=weights_kind(args.method, args.dtype))
    if not args.saved_bytes_only:
        # What the optimizers hold after the steps, counted from their tensors (a sketch optimizer's d×r moments,
        # projectors, 8-bit states and their scales).
        breakdown = memory_breakdown(policy, optimizers)
        row.update(peak_gib=max(peaks) / GIB, avg_gib=statistics.mean(measured(averages)) / GIB,
                   step_s=statistics.median(measured(seconds)),
                   state_mib=(breakdown.sketch_optimizer_state + breakdown.dense_optimizer_state) / 2**20)
    if kl is not None and not args.saved_bytes_only:
        shares = [k / s for k, s in zip(measured(kl_seconds), measured(seconds))]
        row.update(kl_s=statistics.median(measured(kl_seconds)), kl_share=statistics.median(shares))
    if profile is not None:
        row["profile"] = profile
    return {**row, "saved_bytes": saved}  # saved for the backward pass by one micro-batch, exactly


def profiled_step(step: Callable[[], None], device: torch.device, top: int = 12) -> dict:
    """One step under torch.profiler: its seconds, the `top` ops by their own time on the device that computes
    (CUDA kernels' time on a GPU, the ops' CPU time on the CPU), and the total time inside the sketch's ranges
    (`sketch/linear.py` names them while a profiler records)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    events = prof.key_averages()
    own = "self_device_time_total" if cuda else "self_cpu_time_total"
    total = "device_time_total" if cuda else "cpu_time_total"
    ops = sorted((e for e in events if not e.key.startswith("sketch: ")), key=lambda e: getattr(e, own),
                 reverse=True)
    return dict(step_s=seconds, clock="device" if cuda else "cpu",
                top_ops=[dict(op=e.key, calls=e.count, self_s=getattr(e, own) / 1e6) for e in ops[:top]],
                sketch=[dict(range=e.key, calls=e.count, s=getattr(e, total) / 1e6)
                        for e in events if e.key.startswith("sketch: ")])


# ---------------------------------------------------------------- parent: one subprocess per method, then report


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
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--method", method, "--worker"]
    print(f"running {method} ...", file=sys.stderr, flush=True)
    try:
        result = subprocess.run(command, capture_output=True, text=True, env=worker_env(), timeout=timeout_s)
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
