"""What the backward passes of a step measure besides the gradient: summed over its micro-batches (`add`), then over
the ranks (`reduce`), then turned into the step's metrics by the module."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_logra.algo.losses import Mismatch

Reduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class BackwardStats:
    loss: torch.Tensor  # () the loss, normalized by the global batch's counts: the ranks' sum is the global loss
    clipped: torch.Tensor  # () tokens where the loss's own clip binds (gspo, cispo)
    entropy: torch.Tensor  # () Σ the policy's token entropy over the tokens trained on
    tokens: torch.Tensor  # () the tokens trained on
    kl: torch.Tensor  # () Σ k3 estimate of KL(π_θ ‖ π_0) over the same tokens (model.loss.beta > 0; else 0)
    mismatch: Mismatch  # the sampler's log-probs against the trainer's, and the correction's weights

    @classmethod
    def zeros(cls, device: torch.device | str) -> BackwardStats:
        zero = torch.zeros((), dtype=torch.float32, device=device)
        return cls(zero, zero, zero, zero, zero, Mismatch.empty(device))

    def add(self, other: BackwardStats) -> BackwardStats:
        return BackwardStats(self.loss + other.loss, self.clipped + other.clipped, self.entropy + other.entropy,
                             self.tokens + other.tokens, self.kl + other.kl, self.mismatch.add(other.mismatch))

    def reduce(self, sum_over_ranks: Reduce, max_over_ranks: Reduce) -> BackwardStats:
        """Over every rank's micro-batches: the sums in one collective, the mismatch's extremes in their own."""
        sums = sum_over_ranks(torch.stack([self.loss, self.clipped, self.entropy, self.tokens, self.kl]).float())
        return BackwardStats(*sums.unbind(), self.mismatch.reduce(sum_over_ranks, max_over_ranks))
