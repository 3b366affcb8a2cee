"""The policy-gradient objective of one step: the gradient of the batch's loss (`model.loss`), micro-batch by
micro-batch (`model.training`), into the parameters' .grad (a sketched layer's: its d×r sketch).

`PolicyGradient.accumulate` is what a training step calls between the advantages and the update; the benchmarks
(`bench/lib/policy_step.py`) call the same to measure a step without a Trainer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import nn

from lightning_logra.algo.kl import StateRecorder
from lightning_logra.algo.logprobs import completion_logprobs
from lightning_logra.algo.losses import Clip, get_loss, importance_weights, reference_kl, token_weights
from lightning_logra.base.batch import Rollout
from lightning_logra.train.backward_stats import BackwardStats, Reduce
from lightning_logra.train.settings import LossSettings, RolloutSettings, TrainingSettings

log = logging.getLogger(__name__)


@dataclass
class PolicyGradient:
    """The step's objective over `policy` (and, with `loss.beta` > 0, the frozen `reference`).

    Args:
        loss, training, rollouts: the module's settings groups (the sampler correction is `rollouts`').
        temperature: the sampling temperature, at which the log-probs are taken.
        longest: the most completion tokens of a sample (dr_grpo's constant normalizer).
        backward: runs the backward pass of a loss (Lightning's `manual_backward`, or `Tensor.backward`).
        sum_over_ranks, max_over_ranks: reductions over the ranks (the identity in one process).
        lockstep: whether every forward pass is a collective (every rank must run as many).
        loss_scale: what the loss is multiplied by before each backward pass (`Collectives.loss_scale`).
    """

    policy: nn.Module
    reference: nn.Module | None
    loss: LossSettings
    training: TrainingSettings
    rollouts: RolloutSettings
    temperature: float
    longest: int
    backward: Callable[[torch.Tensor], None]
    sum_over_ranks: Reduce
    max_over_ranks: Reduce
    lockstep: bool = False
    loss_scale: float = 1.0

    def accumulate(self, rollout: Rollout, advantages: torch.Tensor, recorder: StateRecorder | None = None
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The gradient of the batch's policy-gradient loss (with loss.beta > 0, plus the KL penalty), micro-batch by
        micro-batch. Returns the global batch's loss, the sampler/trainer log-prob mismatch (`Mismatch.metrics`), and
        `train/entropy`, the policy's mean token entropy on the tokens trained on (NaN: none), with, when beta > 0,
        `train/kl`: the mean per-token k3 estimate of KL(π_θ ‖ π_0) over the batch's completion tokens.
        `recorder` is handed every pass's last hidden states (the KL check's rows are kept from them)."""
        loss, device = self.loss, advantages.device
        # Normalize by the global batch's counts, so that gradients summed over ranks are the global loss's.
        total_tokens = self.sum_over_ranks(rollout.loss_mask.sum().float())  # the sampled ones: what the loss counts
        total_sequences = int(self.sum_over_ranks(torch.tensor(float(len(advantages)), device=device)))
        weights = token_weights(rollout.loss_mask, loss.type, self.longest, total_tokens, total_sequences)  # (N, C)
        # A sample with zero advantage contributes exactly zero policy gradient: leave it out of the backward passes —
        # unless every pass is a collective (a DDP wrapper, FSDP), where all ranks must run the same number of them,
        # or a KL penalty acts, whose gradient β·Σ w·∂kl/∂θ every sample carries whatever its advantage.
        every_row = self.lockstep or loss.beta > 0 or loss.entropy_coef > 0
        active = torch.arange(len(advantages), device=device) if every_row else advantages.nonzero().squeeze(-1)
        micro = list(active.split(self.training.micro_batch_size)) if active.numel() else []
        passes = len(micro)
        if self.lockstep:  # as many passes on every rank, though ranks may hold more rows than others
            passes = int(self.max_over_ranks(torch.tensor([float(passes)]))[0])
        stats = BackwardStats.zeros(device)
        for index in range(passes):
            if index < len(micro):
                rows = micro[index]
                record = None if recorder is None else partial(recorder.record, rows)
                stats = stats.add(self.forward_backward(rollout.select(rows), weights[rows], advantages[rows],
                                                        record))
            else:  # this rank's rows ran out (dynamic sampling kept fewer here): a row whose tokens count zero
                idle = rollout.select(torch.zeros(1, dtype=torch.long, device=device)).emptied()  # (1, w ≥ 1)
                idle_rows = torch.zeros(0, dtype=torch.long)  # it is no row of the rollout: nothing to record
                record = None if recorder is None else partial(recorder.record, idle_rows)
                stats = stats.add(self.forward_backward(idle, torch.zeros_like(weights[:1]), advantages[:1] * 0,
                                                        record))
        stats = stats.reduce(self.sum_over_ranks, self.max_over_ranks)
        metrics = {"train/entropy": stats.entropy / stats.tokens}
        if get_loss(loss.type).own_ratio:
            # Over every completion token of the batch (a sample left out for its zero advantage has none binding)
            metrics["clip_ratio/region_mean"] = stats.clipped / total_tokens.clamp(min=1)
        if loss.beta > 0:
            metrics["train/kl"] = stats.kl / stats.tokens.clamp(min=1)  # 0 for a batch without completion tokens
        return stats.loss, stats.mismatch.metrics(), metrics

    def forward_backward(self, micro: Rollout, weights: torch.Tensor, advantages: torch.Tensor,
                         record: Callable[[torch.Tensor], None] | None = None) -> BackwardStats:
        """One micro-batch's forward and backward pass: its loss's gradient added into the parameters' .grad.
        `micro`: m rows, right padding trimmed to width w; `weights` (m, C): the loss's per-token weights of those
        rows in the global batch; `advantages` (m,); `record` is handed the policy's last hidden states (m, w, h)."""
        loss, chunk = self.loss, self.training.logprob_chunk_tokens
        objective, clip = get_loss(loss.type), Clip(loss.epsilon, loss.epsilon_high)
        # gspo and cispo take their ratio against the sampler themselves: no second correction on top
        is_cap = None if objective.own_ratio else self.rollouts.is_cap
        # (m, w) the tokens the policy reads (attention) and, of them, those it sampled (every token sum counts these)
        present, mask, width = micro.completion_mask, micro.loss_mask, micro.completion_ids.shape[1]
        if loss.beta > 0:
            # The reference's log-probs first: its forward pass's transients are gone before the policy's, whose
            # activations are kept for the backward pass, are built. Same tokens, temperature and chunking.
            with torch.no_grad():
                ref_logprobs, _ = completion_logprobs(self.reference, micro.prompt_ids, micro.prompt_mask,
                                                      micro.completion_ids, present, self.temperature, chunk)  # (m, w)
        # (m, w) each; the (m, w, V) logits exist a chunk of tokens at a time (lightning_logra/algo/logprobs.py)
        logprobs, token_entropy = completion_logprobs(self.policy, micro.prompt_ids, micro.prompt_mask,
                                                      micro.completion_ids, present, self.temperature, chunk,
                                                      entropy_grad=loss.entropy_coef > 0, on_states=record)
        is_weight, mismatch = importance_weights(logprobs.detach(), micro.sampler_logprobs, mask, is_cap,
                                                 self.rollouts.is_mode)  # (m, w)
        # (m, w) each: the loss's per-token objective (its gradient the policy gradient), where its clip binds
        surrogate, binds = objective.surrogate(logprobs, micro.sampler_logprobs, mask, advantages, clip)
        total = -(weights[:, :width] * is_weight * surrogate).sum()
        kl_sum = torch.zeros((), dtype=torch.float32, device=advantages.device)
        if loss.beta > 0:
            # (m, w), 0 on padding; differentiable through the policy's log-probs (the reference's have no graph)
            kl = reference_kl(logprobs, ref_logprobs, mask)
            # The same per-token weights as the policy-gradient term, but neither the advantage nor the importance
            # weight: the penalty is a distance to the reference, not a reward (TRL adds it the same way).
            total = total + loss.beta * (weights[:, :width] * kl).sum()
            kl_sum = kl.detach().sum()
        if loss.entropy_coef > 0:
            # verl's entropy bonus: the entropy weighed per token as the policy-gradient term, subtracted (raised)
            total = total - loss.entropy_coef * (weights[:, :width] * token_entropy).sum()
        self.backward(total * self.loss_scale)
        return BackwardStats(total.detach(), binds.sum().float(), (token_entropy.detach() * mask).sum(), mask.sum(),
                             kl_sum, mismatch)


class TruncationMask:
    """`model.loss.mask_truncated_completions`: completions cut at max_new_tokens (no stop token) have no token that
    counts in the loss (TRL's `mask_truncated_completions`); a step whose every completion was cut is warned about."""

    def __init__(self, enabled: bool, max_new_tokens: int) -> None:
        self.enabled, self.max_new_tokens = enabled, max_new_tokens
        self.all_cut = 0  # steps whose completions were all cut and masked

    def __call__(self, rollout: Rollout, stop_token_ids: list[int]) -> Rollout:
        """The rollout as the loss sees it."""
        if not self.enabled:
            return rollout
        kept = rollout.terminated(stop_token_ids)[:, None]  # (N, 1): ended with a stop token, not cut
        if not bool(kept.any()):
            self.all_cut += 1
            if self.all_cut in (1, 10) or self.all_cut % 100 == 0:  # said at once, then now and then
                log.warning("every completion of this step (and of %d steps so far) was cut at "
                            "model.sampling.max_new_tokens=%d, and model.loss.mask_truncated_completions leaves none "
                            "to train on: raise model.sampling.max_new_tokens, or set "
                            "model.loss.mask_truncated_completions: false", self.all_cut, self.max_new_tokens)
        sampled = None if rollout.sampled_mask is None else rollout.sampled_mask * kept
        return replace(rollout, completion_mask=rollout.completion_mask * kept, sampled_mask=sampled)
