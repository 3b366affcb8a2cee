"""The in-process engine: samples from the policy being trained, with a KV cache, in plain PyTorch.

A loop of our own rather than `model.generate` so that sampling is a pure function of per-prompt seeds (resumed
and sharded runs draw exactly what an uninterrupted single-process run draws) and so that the sampler's log-probs
come out without a second pass. Each token is drawn by inverting the CDF at a counter-based uniform keyed by
(prompt seed, sample index, position), so no generator state is shared between rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightning_logra.algo.update import Update
from lightning_logra.base.batch import Rollout, left_pad, positions
from lightning_logra.base.hashing import counter_uniform, mix64
from lightning_logra.rollout.engine import RolloutEngine, SamplingParams
from lightning_logra.rollout.sync import fingerprint


def sample_next(
    logits: torch.Tensor, sampling: SamplingParams, keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from logits (N, V) and one int64 key per row (N,); returns (tokens (N,), their log-probs
    at the temperature (N,)).

    The log-probs are those of the tempered distribution *before* top-p truncation: that is the distribution the
    trainer's loss evaluates, so the two stay comparable for importance-sampling corrections.
    """
    logits = logits.float()
    if sampling.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    logprobs = torch.log_softmax(logits / sampling.temperature, -1)  # (N, V)
    probs = logprobs.exp()
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it already does.
        sorted_probs[(sorted_probs.cumsum(-1) - sorted_probs) >= sampling.top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    cdf = probs.double().cumsum(-1)  # (N, V), unnormalized after top-p
    target = counter_uniform(keys) * cdf[:, -1]  # (N,) uniform on [0, total mass)
    # The first token whose cumulative mass exceeds the target; a zero-probability token never qualifies.
    tokens = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


class HFEngine(RolloutEngine):
    """Generates with a transformers causal LM in this process.

    The trainer builds it on the policy itself (the weights are shared: nothing to sync). Built on a separate copy
    it is a rollout engine with weights of its own, synced like vLLM's, all in plain PyTorch.
    """

    def __init__(self, model: nn.Module, eos_token_ids: list[int], pad_token_id: int,
                 all_finished: Callable[[torch.Tensor], bool] | None = None) -> None:
        """`all_finished(finished)`: whether generation may stop, given which rows have finished ((N,) bool); by
        default when every row has. Under FSDP every rank must run the same number of forward passes (each one
        all-gathers the layers' weights): the strategy's waits until every row of every rank has finished."""
        self.model = model
        self.eos_token_ids = torch.tensor(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.all_finished = all_finished or (lambda finished: bool(finished.all()))

    def samples_from(self, policy) -> bool:
        return self.model is policy

    def _tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.model.state_dict(keep_vars=True))

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, torch.Tensor]) -> int:
        own = self._tensors()
        for name, value in tensors.items():
            own[name].copy_(value)
        return sum(t.numel() * t.element_size() for t in tensors.values())

    @torch.no_grad()
    def apply_update(self, update: Update) -> int:
        own = self._tensors()
        for name, delta in update.low_rank.items():
            delta.apply_(own[name].data)
        for name, value in update.dense.items():
            own[name].copy_(value)
        return len(update.to_bytes())

    def fingerprints(self, names: list[str], seed: int) -> dict[str, torch.Tensor]:
        own = self._tensors()
        return {name: fingerprint(own[name], seed).cpu() for name in names}

    def weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        own = self._tensors()
        return {name: own[name].detach().cpu().clone() for name in names}

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingParams, seeds: list[int]) -> Rollout:
        device = next(self.model.parameters()).device
        prompt, prompt_mask = left_pad([p for p in prompt_ids for _ in range(n)], self.pad_token_id, device)  # (N, P)
        # One random stream per (prompt, sample): the key of row j·n + i mixes seeds[j] with i.
        seeds = torch.tensor(seeds, dtype=torch.int64, device=device).repeat_interleave(n)  # (N,)
        samples = torch.arange(n, device=device).repeat(len(prompt_ids))  # (N,)
        row_keys = mix64(seeds ^ mix64(samples))  # (N,)
        eos = self.eos_token_ids.to(device)
        rows = prompt.shape[0]
        tokens, logprobs = [], []
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        mask, position = prompt_mask, positions(prompt_mask)
        step_ids, cache = prompt, None
        for t in range(sampling.max_new_tokens):
            out = self.model(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=position,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,  # only the last position's logits are needed
            )
            cache = out.past_key_values
            token, logprob = sample_next(out.logits[:, -1], sampling, mix64(row_keys + t))  # (N,), (N,)
            token = torch.where(finished, self.pad_token_id, token)
            tokens.append(token)
            logprobs.append(torch.where(finished, 0.0, logprob))
            finished = finished | torch.isin(token, eos)
            if self.all_finished(finished):
                break
            step_ids = token[:, None]  # (N, 1)
            position = position[:, -1:] + 1
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        completion = torch.stack(tokens, dim=1)  # (N, C)
        # A token belongs to the completion if no stop token came before it (the stop token itself counts).
        stops = torch.isin(completion, eos).long()
        completion_mask = ((stops.cumsum(1) - stops) == 0).long()  # (N, C)
        return Rollout(
            prompt_ids=prompt,
            prompt_mask=prompt_mask,
            completion_ids=completion,
            completion_mask=completion_mask,
            sampler_logprobs=torch.stack(logprobs, dim=1) * completion_mask,
        )
