"""KLFromStart: how far the policy has moved from where the run started, measured, at every validation.

The reward–KL frontier puts each method's reward against KL(π_t ‖ π_0), the distance from the starting policy. The
sum of per-step KLs (`kl/realized`) is not that distance: steps that point the same way compound (two steps of KL ε
along one direction are a step of 4ε), steps that undo each other cancel. So it is measured directly:

    KL(π_t ‖ π_0) = mean over the tokens of completions sampled from π_t of KL(π_t(·|ctx) ‖ π_0(·|ctx)),
                    full vocabulary, exact, at the sampling temperature

on the first `prompts` prompts of the held-out split (those each rank validates first), `samples` completions each,
drawn by the run's engine with seeds fixed across evaluations (the same noise every time: what changes between two
measurements is the policy). π_0 is a frozen copy loaded from the model's files (`load_reference`): one more copy of
the weights in the policy's dtype, in every process, for as long as the run (the KL penalty's, when `model.loss.beta` >
0).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_logra.algo.kl import mean_token_kl, next_tokens
from lightning_logra.base.batch import Rollout
from lightning_logra.base.settings import check_positive
from lightning_logra.train.policy import load_reference

KL_STEP = -2  # the step the measurement's prompts are seeded with: apart from training's (≥ 0) and evaluation's (-1)


class KLFromStart(Callback):
    """At the end of every validation, log `val/kl_from_start`: the mean per-token exact KL(π_t ‖ π_0) on completions
    sampled from the current policy (module docstring), over every process's share.

    Args:
        prompts: held-out prompts measured on, in all (each process takes its share of its first validation batches).
        samples: completions sampled per prompt, at the run's sampling temperature and top_p.
        chunk: sequences per forward pass of the measurement (the decoder's hidden states of `chunk` sequences
            exist at once, not those of all prompts × samples).
        start: the model π_0 is, as `model.model` takes it; None: the run's own `model.model`. A `validate` of a
            model trained elsewhere (a folder another trainer saved) measures its distance from the model it
            started from so.
    """

    def __init__(self, prompts: int = 256, samples: int = 4, chunk: int = 64, start: str | None = None) -> None:
        for key, value in (("prompts", prompts), ("samples", samples), ("chunk", chunk)):
            check_positive(f"KLFromStart: {key}", value, integer=True)
        self.prompts, self.samples, self.chunk, self.start = prompts, samples, chunk, start
        self.reference: torch.nn.Module | None = None
        self._batch: dict[str, list[Any]] = {}  # this process's share of the prompts, gathered during validation

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._batch = {}

    def on_validation_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: dict[str, list[Any]],
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        share = math.ceil(self.prompts / trainer.world_size)
        taken = len(self._batch.get("prompt", []))
        if taken >= share:
            return
        for key in ("prompt", "prompt_ids"):  # the ids when the data module tokenized the prompts
            if key in batch:
                self._batch.setdefault(key, []).extend(batch[key][: share - taken])

    @torch.no_grad()
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not self._batch:
            return
        if self.reference is None and self.start is not None:
            self.reference = load_reference(self.start, pl_module.weights_dtype(), pl_module.device)
        if self.reference is None:  # the KL penalty's π_0 when the run has one (model.loss.beta > 0): not a second copy
            self.reference = getattr(pl_module, "reference", None) or load_reference(
                pl_module.hparams.model, pl_module.weights_dtype(), pl_module.device)  # the policy's weights' dtype
        rollout = pl_module.generate(self._batch, self.samples, pl_module.sampling, KL_STEP)
        total, tokens = self.kl_sum(pl_module.policy, rollout, pl_module.sampling.temperature)
        total, tokens = (pl_module.trainer.strategy.reduce(torch.stack([total, tokens]).to(pl_module.device),
                                                           reduce_op="sum") if trainer.world_size > 1
                         else torch.stack([total, tokens]))
        pl_module.log("val/kl_from_start", float(total / tokens.clamp(min=1)), batch_size=int(tokens))

    @torch.no_grad()
    def kl_sum(self, policy: torch.nn.Module, rollout: Rollout, temperature: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ over completion tokens of KL(π_policy ‖ π_0), the number of tokens), float64, `chunk` sequences at a
        time."""
        total = torch.zeros((), dtype=torch.float64)
        tokens = torch.zeros((), dtype=torch.float64)
        for rows in torch.arange(rollout.completion_ids.shape[0]).split(self.chunk):
            part = rollout.select(rows.to(rollout.completion_ids.device))
            count = part.loss_mask.sum().double().cpu()
            # (no skipping an empty chunk: under FSDP every forward pass is a collective all ranks must run)
            kl = mean_token_kl(next_tokens(policy, part), next_tokens(self.reference, part), part.loss_mask,
                               temperature)
            total += kl.cpu() * count
            tokens += count
        return total, tokens
