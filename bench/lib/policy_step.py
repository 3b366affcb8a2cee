"""Fixed rollouts, and the trainer's own policy-gradient objective over them without a Trainer: what a benchmark's
step runs between the rollouts and the optimizer (bench.memory's steps, bench.rank_sweep's and bench.frontier's dense
gradients, bench.gpu_check's kl_control).

The objective is `lightning_logra.train.objective.PolicyGradient`, the one `RLVRModule.training_step` calls, in one
process: the reductions over ranks are the identity, and the sampler correction is off (`model.rollouts.is_cap:
null`), since the fixed rollouts have no sampler whose log-probs they could carry.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lightning_logra.algo.advantages import group_advantages
from lightning_logra.base.batch import Rollout
from lightning_logra.train.objective import PolicyGradient
from lightning_logra.train.settings import LossSettings, RolloutSettings, TrainingSettings


@dataclass
class Batch:
    """A step's rollouts and their advantages (N,), samples of one prompt adjacent as in a GRPO batch."""

    rollout: Rollout
    advantages: torch.Tensor

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.rollout.to(device), self.advantages.to(device))

    def __len__(self) -> int:
        return len(self.advantages)

    def head(self, count: int) -> Batch:
        """The first `count` samples, their columns as they are (not trimmed)."""
        rollout = self.rollout
        return Batch(Rollout(rollout.prompt_ids[:count], rollout.prompt_mask[:count],
                             rollout.completion_ids[:count], rollout.completion_mask[:count],
                             rollout.sampler_logprobs[:count]), self.advantages[:count])


def fixed_batch(args: argparse.Namespace, vocab_size: int, rewards: torch.Tensor | None = None,
                scale_rewards: bool | str = True) -> Batch:
    """Rollouts as the trainer sees them, a pure function of `args.seed`, so that every worker trains on the same
    ones: `args.batch` sequences of `args.prompt_len` prompt tokens (one prompt per `args.group` samples) and up to
    `args.completion_len` completion tokens, random ids, rewards 0/1 at random (or `rewards`, (N,)) made into group
    advantages by `scale_rewards` (`model.loss.scale_rewards`)."""
    gen = torch.Generator().manual_seed(args.seed)
    n, p, c = args.batch, args.prompt_len, args.completion_len
    prompts = torch.randint(vocab_size, (n // args.group, p), generator=gen)
    prompt_ids = prompts.repeat_interleave(args.group, dim=0)  # (n, P)
    completion_ids = torch.randint(vocab_size, (n, c), generator=gen)  # (n, C)
    # Completions end at different lengths (right padding), so the dapo weights are not uniform.
    lengths = torch.randint(c // 2, c + 1, (n,), generator=gen)
    completion_mask = (torch.arange(c) < lengths[:, None]).long()  # (n, C)
    drawn = torch.randint(2, (n,), generator=gen).float()
    advantages = group_advantages(drawn if rewards is None else rewards, args.group, scale_rewards)  # (n,)
    rollout = Rollout(prompt_ids, torch.ones_like(prompt_ids), completion_ids, completion_mask,
                      sampler_logprobs=torch.zeros(n, c))  # no sampler: the objective's correction is off
    return Batch(rollout, advantages)


def tensor_backward(loss: torch.Tensor) -> None:
    """`loss.backward()` outside any autocast region: under `bf16-mixed` only the forward runs in autocast."""
    with torch.autocast(loss.device.type, enabled=False):
        loss.backward()


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def objective(policy: nn.Module, training: TrainingSettings, longest: int, loss: LossSettings = LossSettings(),
              temperature: float = 1.0, every_row: bool = False,
              backward: Callable[[torch.Tensor], None] = tensor_backward) -> PolicyGradient:
    """The trainer's objective over `policy` in this process (`loss` as `model.loss`, `training` as `model.training`:
    its micro-batch and log-prob chunks). `longest`: the most completion tokens of a sample. `every_row`: every sample
    through the backward passes, as the trainer runs them in lockstep (DDP, FSDP) or with a KL penalty; otherwise a
    sample whose advantage is 0 is left out, as one process does. `backward`: `tensor_backward`, Lightning's
    `manual_backward`, or a no-op (a forward alone)."""
    if loss.beta > 0:
        raise ValueError("model.loss.beta > 0 needs the frozen reference model, which a benchmark's step does not load")
    return PolicyGradient(policy, None, loss, training, RolloutSettings(is_cap=None), temperature, longest, backward,
                          sum_over_ranks=_identity, max_over_ranks=_identity, lockstep=every_row)
