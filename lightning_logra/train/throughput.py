"""A step's throughput, as verl and prime-rl report it (`perf/*`): tokens per second generated and trained, the share
of the step each part took, and, on a GPU whose peak is known, the update's model FLOPs utilization.

    perf/generated_tokens_per_s  completion tokens of every rank / train/step_s
    perf/trained_tokens_per_s    prompt + completion tokens the update's passes took, every rank / train/step_s
    perf/share/<part>            the part's seconds / train/step_s: generation (train/wait_s), scoring
                                 (train/score_s), update (train/update_s less the predicted-KL check's
                                 kl/control_s), kl (the check and the realized KL: kl/seconds), sync (train/sync_s:
                                 the trainer's own time in the weight sync, which an overlapped run hands to the
                                 engine's thread) and other (the rest: logging, callbacks)
    perf/mfu                     6 · N · T / (train/update_s · peak), this device's: T its trained tokens, N the
                                 parameters a token's forward pass multiplies by (every weight but the input
                                 embedding's, whose rows are looked up; a tied head counts once), 6 · N · T the
                                 forward (2·N·T) and backward (4·N·T) passes' model FLOPs as PaLM counts them (the
                                 attention's own products and the predicted-KL check's passes left out), peak the
                                 device's dense rate for the weights' dtype (`PEAK_TFLOPS`)
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lightning_logra.base.batch import Rollout
from lightning_logra.train.backward_stats import Reduce

# Dense (no sparsity) peak TFLOP/s of the tensor cores by the weights' dtype, from the vendors' data sheets (SXM
# parts); fp32 weights run at the TF32 rate only when torch is allowed to use it.
PEAK_TFLOPS = {
    "H200": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
}


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's peak FLOP/s for matrix products in `dtype`; None on the CPU or a GPU not in `PEAK_TFLOPS`."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    rates = next((rates for model, rates in PEAK_TFLOPS.items() if model in name), None)
    if rates is None:
        return None
    if dtype in (torch.bfloat16, torch.float16):
        kind = "bf16"
    else:
        kind = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    return rates[kind] * 1e12


def matmul_parameters(policy: nn.Module) -> int:
    """N: the parameters a token's forward pass multiplies by: all but the input embedding's (a lookup), counted
    once when the LM head shares them. Under FSDP a parameter counts whole."""
    embedding = policy.get_input_embeddings()
    head = policy.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight
    total = sum(p.numel() for p in policy.parameters())  # a DTensor's numel is its whole tensor's
    return total if tied else total - embedding.weight.numel()


class Throughput:
    """`perf/*` of each step of a run on `device` (N and the device's peak found once)."""

    def __init__(self, policy: nn.Module, device: torch.device) -> None:
        self.parameters = matmul_parameters(policy)
        self.peak = peak_flops(device, next(policy.parameters()).dtype)

    def metrics(self, rollout: Rollout, sum_over_ranks: Reduce, step_s: float,
                seconds: dict[str, float]) -> tuple[dict[str, float], int]:
        """(`perf/*`, the prompt + completion tokens of every rank's samples: TRL's num_tokens of the step)."""
        completion = rollout.completion_lengths.sum().float()
        trained = rollout.prompt_mask.sum().float() + completion  # this rank's
        everyone = sum_over_ranks(torch.stack([trained, completion]))
        mfu = update_mfu(self.parameters, float(trained), seconds["train/update_s"], self.peak)
        return throughput_metrics(float(everyone[1]), float(everyone[0]), step_s, seconds, mfu), int(everyone[0])


def throughput_metrics(generated: float, trained: float, step_s: float, seconds: dict[str, float],
                       mfu: float | None) -> dict[str, float]:
    """`perf/*` of a step (see the module's docstring): `generated` and `trained` tokens of every rank, the step's
    `seconds` by the metric names above (a part that did not run is absent), `mfu` when it is known."""
    def part(key: str) -> float:  # 0 for a part that did not run (no KL check; a skipped update's NaN)
        value = float(seconds.get(key, 0.0))
        return 0.0 if math.isnan(value) else value

    # The predicted-KL check runs inside the update's time, the realized KL after the sync
    check, realized = part("kl/control_s"), part("kl/realized_s")
    parts = {"generation": part("train/wait_s"), "scoring": part("train/score_s"),
             "update": part("train/update_s") - check, "kl": check + realized, "sync": part("train/sync_s")}
    parts["other"] = max(step_s - sum(parts.values()), 0.0)
    metrics = {"perf/generated_tokens_per_s": generated / step_s, "perf/trained_tokens_per_s": trained / step_s,
               **{f"perf/share/{part}": value / step_s for part, value in parts.items()}}
    if mfu is not None:
        metrics["perf/mfu"] = mfu
    return metrics


def update_mfu(parameters: int, tokens: float, update_s: float, peak: float | None) -> float | None:
    """6 · N · T / (update_s · peak) for this device's trained tokens T; None without a peak."""
    if peak is None or update_s <= 0:
        return None
    return 6 * parameters * tokens / (update_s * peak)
