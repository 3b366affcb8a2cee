"""One method's step in this process, the worker of bench.memory (`python -m bench.memory ... --method M --worker`):
the model, its optimizers, the trainer's policy-gradient objective over the fixed rollouts (`bench.lib.policy_step`),
the optimizer steps with an optional predicted-KL check, and what they held and took: the row the parent collects."""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from bench.lib import peers
from bench.lib.memory_rows import LIGHTNING_METHODS, LOGRA_METHODS, weights_kind
from bench.lib.policy_step import Batch, fixed_batch, objective, tensor_backward
from bench.lib.shapes import DTYPES, is_target, qwen2_model
from lightning_logra.algo.kl import intended_kl, predicted_kl, realized_kl, step_scale
from lightning_logra.algo.update import Update
from lightning_logra.callbacks.memory import GIB, StepSampler, cuda_allocated_reader, process_rss_reader
from lightning_logra.sketch import SketchAdam, SketchOptimizer, SketchSGD, sketched_layers
from lightning_logra.sketch.config import DEFAULT_TARGETS, SketchConfig
from lightning_logra.sketch.memory import memory_breakdown, saved_activation_bytes
from lightning_logra.sketch.rounding import LOW_PRECISION
from lightning_logra.train.objective import PolicyGradient
from lightning_logra.train.settings import TrainingSettings


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(args.seed)
    dtype = torch.float32 if weights_kind(args.method or "", args.dtype).startswith("fp32") else DTYPES[args.dtype]
    layers = {} if args.layers is None else {"num_hidden_layers": args.layers}
    model = qwen2_model(args.shape, dtype, args.prompt_len + args.completion_len, args.device, **layers)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()  # as RLVRModule does for model.training.gradient_checkpointing
        model.config.use_cache = False
    return model


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


class KLCheck:
    """The predicted-KL controller's work in one step, as `PredictedKLBudget` does it, on the first `count` responses
    of the batch: asked for α between the sketch optimizer's proposal and its merge, then the realized KL."""

    def __init__(self, policy: torch.nn.Module, batch: Batch, count: int, budget: float) -> None:
        self.policy, self.budget = policy, budget
        self.responses = batch.head(count).rollout
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


def step_objective(policy: torch.nn.Module, args: argparse.Namespace,
                   backward: Callable[[torch.Tensor], None] = tensor_backward) -> PolicyGradient:
    """The trainer's objective (`train.objective.PolicyGradient`, dapo at temperature 1) at the run's micro-batch and
    log-prob chunks (`--logprob-chunk 0`: the whole micro-batch's logits at once). Every sample goes through the
    backward passes, as in a batch whose every group is learnable: a step's cost, not which groups the random
    rewards left equal."""
    training = TrainingSettings(micro_batch_size=args.micro_batch, logprob_chunk_tokens=args.logprob_chunk or None,
                                gradient_checkpointing=args.gradient_checkpointing)
    return objective(policy, training, args.completion_len, every_row=True, backward=backward)


def train_step(step: PolicyGradient, optimizers: list, batch: Batch, kl: KLCheck | None = None,
               reduce: Callable[[], None] | None = None, mixed: bool = False) -> None:
    """Forward and backward over the micro-batches (`step.accumulate`, the training step's own), `reduce` (the
    gradients' sum over processes), the steps (with `kl`: the sketch optimizer's asks the KL check for α). `mixed`:
    the forward alone under bf16 autocast, as `bf16-mixed` runs it (the objective's backward leaves it:
    `tensor_backward`); the optimizers step the fp32 weights outside it, so their states stay fp32 (inside it, a
    projecting optimizer's matmuls would return bf16 and its moments would be kept in bf16)."""
    with torch.autocast(batch.advantages.device.type, dtype=torch.bfloat16, enabled=mixed):
        step.accumulate(batch.rollout, batch.advantages)
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

        def __init__(self, policy: torch.nn.Module, batch: Batch) -> None:
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
            step = step_objective(self.policy, args, self.manual_backward)
            train_step(step, [optimizer], self.batch, reduce=lambda: self.trainer.strategy.sum_gradients(params))

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
    batch = fixed_batch(args, model.config.vocab_size).to(args.device)
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
    batch = fixed_batch(args, model.config.vocab_size).to(device)
    policy, optimizers = set_up(args.method, model, args)
    policy.train()
    step = step_objective(policy, args)
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
        train_step(step, optimizers, batch, kl=kl, mixed=mixed)
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
        profile = profiled_step(lambda: train_step(step, optimizers, batch, kl=kl, mixed=mixed), device)
    # One micro-batch's forward and loss through the same objective, its backward pass left out (a no-op)
    forward = step_objective(policy, args, backward=lambda loss: None)
    micro = batch.head(args.micro_batch)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed):
        saved = saved_activation_bytes(lambda: forward.accumulate(micro.rollout, micro.advantages),
                                       policy.parameters())
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
