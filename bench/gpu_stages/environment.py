"""environment: torch / CUDA versions, the GPU, which optional packages are importable, the commit."""

from __future__ import annotations

import importlib
import platform
import subprocess

import torch

from bench.gpu_stages.plan import Plan, Progress
from bench.lib.runs import ROOT


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
