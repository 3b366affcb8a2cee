"""Completion log-probs without the micro-batch's full-vocabulary logits.

A policy-gradient step needs, per completion token, log π(token | context) — one number — but the usual path builds
the logits of every token over the whole vocabulary first: at 4 × 2,048 tokens × 151,936 classes that is 4.6 GiB in
fp32, and the log-softmax and its gradient as much again. Here the decoder's last hidden states (n, C, h) are taken
instead, and the LM head, the temperature-scaled log-softmax and the chosen token's log-prob are computed a chunk of
tokens at a time; the backward pass recomputes each chunk's logits rather than keeping them. The transient is one
chunk × V, whatever the micro-batch (Liger-Kernel's fused linear cross-entropy does the same on GPUs; this is plain
PyTorch and runs anywhere).

The token entropy comes out of the same chunks, for free. Models whose head is not a plain linear map of the last
hidden state (logit soft-capping or scaling, a sketched or otherwise replaced `lm_head`) take the full-logits path.

Rows that share a prompt (a group's completions) share its forward pass (`shared_prompt_pass`): a GRPO batch repeats
each prompt num_generations times, and with prompts longer than completions (the shipped reasoning mix: 56-84 prompt
tokens, at most 16 new ones) that repetition was most of a step's compute and of its activations.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from lightning_logra.base.batch import positions

log = logging.getLogger(__name__)
_warned: list[str] = []  # the model whose cache could not be gathered, said once a process


def completion_logits(
    policy: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> torch.Tensor:
    """Logits (n, C, V) that predict each completion token, through the model's own head (`shared_prompt_pass`)."""
    # The head runs on the positions that predict a completion token only, never over the prompt.
    return shared_prompt_pass(policy, "logits", prompt_ids, prompt_mask, completion_ids, completion_mask)


def completion_states(
    policy: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> torch.Tensor:
    """(n, C, h): the decoder's last hidden state at the position before each completion token (the one whose logits
    predict it), differentiable (`shared_prompt_pass`)."""
    return shared_prompt_pass(policy.get_decoder(), "last_hidden_state", prompt_ids, prompt_mask, completion_ids,
                              completion_mask)


def shared_prompt_pass(
    model: nn.Module,
    output: str,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> torch.Tensor:
    """(n, C, ...): `model`'s `output` (a causal LM's "logits", a decoder's "last_hidden_state") at the position
    before each completion token, the position that predicts it.

    Each distinct prompt runs once: the model takes the distinct prompts (the left padding all of them share trimmed),
    then every row's completion on its prompt's keys and values, gathered to the row (differentiable: the backward
    pass sums each prompt's gradient over its rows). With g distinct prompts of P tokens over n rows of C, the pass
    computes g·P + n·C positions instead of n·(P + C). It is the same function of the weights as one pass over prompt
    + completion; its sums run in other orders (a prompt in a batch of g, its gradient summed over its rows before
    the layers' backward, not after), so the numbers agree to rounding, not bit for bit.

    Always two calls of the model, also where no prompt repeats: under FSDP every rank must call it as often as the
    others. A model that recomputes activations (gradient checkpointing: transformers then keeps no cache), or whose
    cache cannot be gathered by row, takes one pass over prompt + completion instead."""
    width = completion_ids.shape[1]
    kept = {"logits_to_keep": width + 1} if output == "logits" else {}

    def one_pass() -> torch.Tensor:
        ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (n, P + C)
        mask = torch.cat([prompt_mask, completion_mask], dim=1)
        states = getattr(model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), **kept), output)
        return states[:, -width - 1 : -1]

    if getattr(model, "is_gradient_checkpointing", False):
        return one_pass()
    # (g, 2P) the distinct prompts, ids (their padding zeroed: two paddings of a prompt are one prompt) and mask;
    # (n,) each row's
    length = prompt_ids.shape[1]
    distinct, row_prompt = torch.unique(torch.cat([prompt_ids * prompt_mask, prompt_mask], dim=1), dim=0,
                                        return_inverse=True)
    first = int(distinct[:, length:].any(0).int().argmax())  # the first column some prompt uses
    ids, mask = distinct[:, first:length], distinct[:, length + first :]  # (g, P')
    prompts = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=True,
                    **({"logits_to_keep": 1} if kept else {}))
    cache = prompts.past_key_values
    if not hasattr(cache, "batch_select_indices"):  # no cache, or one of another kind: the prompts' pass is lost
        if not _warned:
            _warned.append(type(model).__name__)
            log.warning("%s keeps no key/value cache that can be gathered by row: every row's prompt runs in its own "
                        "pass (rows that share a prompt cost as much as rows that do not)", type(model).__name__)
        return one_pass()
    cache.batch_select_indices(row_prompt)  # every layer's keys and values (g, ..., P', d) → (n, ..., P', d)
    # All C completion tokens run, though the last predicts nothing: a micro-batch of one-token completions still
    # calls the model (FSDP's ranks call it alike).
    mask = torch.cat([mask[row_prompt], completion_mask], dim=1)  # (n, P' + C)
    rest = getattr(model(input_ids=completion_ids, attention_mask=mask, position_ids=positions(mask)[:, -width:],
                         past_key_values=cache), output)  # (n, C, ...)
    last = getattr(prompts, output)[:, -1][row_prompt]  # (n, ...): a prompt's last position predicts the first token
    return torch.cat([last[:, None], rest[:, : width - 1]], dim=1)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What log-probs are computed in: fp32 for bf16/fp16/fp32 logits, fp64 kept for float64 references."""
    return torch.promote_types(dtype, torch.float32)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log π(token) (n, C) from logits (n, C, V) at the sampling temperature, in fp32 (fp64 for fp64 logits).

    One sequence at a time: the fp32 copy of the logits then takes C·V·4 bytes, not n·C·V·4 (with a 152k vocabulary
    and 2k-token completions that is 1.2 GB instead of n times that).
    """
    rows = []
    for row_logits, row_tokens in zip(logits, tokens):
        row = row_logits.to(compute_dtype(row_logits.dtype)) / temperature  # (C, V) fp32/fp64
        rows.append(row.gather(-1, row_tokens[:, None]).squeeze(-1) - row.logsumexp(-1))
    return torch.stack(rows)  # (n, C)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """H(π(· | ctx)) (n, C) in nats over the full vocabulary at the sampling temperature, one sequence at a time (the
    fp32 transient is C·V, as in `token_logprobs`); differentiable when the logits are (the entropy bonus)."""
    rows = []
    for row_logits in logits:
        logp = torch.log_softmax(row_logits.to(compute_dtype(row_logits.dtype)) / temperature, dim=-1)  # (C, V)
        rows.append(-(logp.exp() * logp).sum(-1))
    return torch.stack(rows)  # (n, C)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """(hidden (N, h), head weight (V, h), head bias (V,) or None, tokens (N,)) → (log-probs (N,), entropy (N,)) at a
    temperature, `chunk` rows at a time; the entropy is differentiated only with `entropy_grad` (the entropy bonus)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature: float, chunk: int, entropy_grad: bool = False):
        logprobs = torch.empty(hidden.shape[0], dtype=compute_dtype(hidden.dtype), device=hidden.device)
        entropy = torch.empty_like(logprobs)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logp = head_log_softmax(hidden[rows], weight, bias, temperature)  # (c, V)
            logprobs[rows] = logp.gather(-1, tokens[rows, None]).squeeze(-1)
            entropy[rows] = -_rowwise_dot(logp.exp(), logp)
            del logp  # at most two (c, V) tensors at a time: the logits and their log-softmax, or that and p
        ctx.save_for_backward(hidden, weight, bias, tokens)
        ctx.temperature, ctx.chunk = temperature, chunk
        # Recompute in backward under the autocast the forward ran in (bf16-mixed), so both see the same logits.
        ctx.autocast = (hidden.device.type, torch.is_autocast_enabled(hidden.device.type),
                        torch.get_autocast_dtype(hidden.device.type))
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, tokens = ctx.saved_tensors
        if grad_logprobs is None:  # only the entropy was differentiated
            grad_logprobs = torch.zeros(hidden.shape[0], dtype=compute_dtype(hidden.dtype), device=hidden.device)
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=compute_dtype(weight.dtype)) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=compute_dtype(bias.dtype)) if need_bias else None
        device_type, autocast, autocast_dtype = ctx.autocast
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast):
                logits = _logits(hidden[rows], weight, bias, ctx.temperature)  # (c, V)
            # d log p(token) / d logits = (onehot(token) − p) / T, built in p's own storage
            grad_logits = torch.softmax(logits, dim=-1)
            entropy_term = None
            if grad_entropy is not None:  # dH / d logits = −p·(log p + H) / T
                logp = torch.log_softmax(logits, dim=-1)
                entropy = -_rowwise_dot(grad_logits, logp)  # (c,)
                scale_h = (grad_entropy[rows] / ctx.temperature)[:, None].to(logp.dtype)  # (c, 1)
                entropy_term = logp.add_(entropy[:, None]).mul_(grad_logits).mul_(-scale_h)  # (c, V), in logp's storage
            del logits
            scale = (grad_logprobs[rows] / ctx.temperature)[:, None].to(grad_logits.dtype)  # (c, 1)
            grad_logits.mul_(-scale).scatter_add_(-1, tokens[rows, None], scale)  # (c, V)
            if entropy_term is not None:
                grad_logits += entropy_term
                del entropy_term
            if need_hidden:
                grad_hidden[rows] = grad_logits.to(weight.dtype) @ weight  # (c, h)
            if need_weight:
                grad_weight += grad_logits.T @ hidden[rows].to(grad_logits.dtype)  # (V, h)
            if need_bias:
                grad_bias += grad_logits.sum(0)
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None)


def vocab_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """hidden (c, h) through an LM head's weight (V, h) → logits (c, V) = hidden·Wᵀ + b, contiguous.

    On the CPU computed as (W·hiddenᵀ)ᵀ: MKL's GEMM of x·Wᵀ (torch's `linear`) with a weight of many short rows, as a
    head's (V = 49k rows of 576 on SmolLM2), took 1.5-3× as long as W·xᵀ of the same products (alone on 2 AVX2 cores:
    124 against 76 ms at 120 rows, 30 against 10 ms at 2). The sums run in another order: equal to rounding."""
    if hidden.device.type != "cpu" or hidden.dim() != 2:
        return nn.functional.linear(hidden, weight, bias)
    logits = (weight @ hidden.T).T.contiguous()  # (c, V)
    return logits if bias is None else logits.add_(bias)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """(c, V) logits / T in fp32 (fp64 kept), computed in the head's dtype as the model's own head computes them."""
    logits = vocab_logits(hidden, weight, bias)
    logits = logits.to(compute_dtype(logits.dtype))  # a new tensor unless already fp32: in-place below is safe
    return logits.div_(temperature) if temperature != 1.0 else logits


def head_log_softmax(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     temperature: float) -> torch.Tensor:
    """log π(· | ctx) (c, V) from hidden states (c, h) through the head, at the temperature (the logits are freed on
    return)."""
    return torch.log_softmax(_logits(hidden, weight, bias, temperature), dim=-1)


def _rowwise_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_v a[i, v]·b[i, v] (c,) as a batched matrix product: no (c, V) product tensor."""
    return (a.unsqueeze(1) @ b.unsqueeze(2)).view(-1)


def plain_head(policy: nn.Module) -> nn.Linear | None:
    """The policy's LM head if logits are exactly `head(last hidden state)`; None if not (then: the full path)."""
    head = policy.get_output_embeddings() if hasattr(policy, "get_output_embeddings") else None
    config = getattr(policy, "config", None)
    scaled = any(getattr(config, key, None) not in (None, 1.0) for key in ("final_logit_softcapping", "logit_scale"))
    if type(head) is not nn.Linear or scaled or not hasattr(policy, "get_decoder"):
        return None
    return head


def completion_logprobs(
    policy: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int | None = 256,
    entropy_grad: bool = False,
    on_states: Callable[[torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π(token) (n, C), token entropy (n, C)) of each completion token at the temperature; the entropy carries
    a gradient only with `entropy_grad` (the entropy bonus, `model.loss.entropy_coef`).

    `chunk_tokens`: how many tokens' logits exist at a time (forward and backward); None builds the full (n, C, V)
    logits as one tensor (the path models with a non-plain head always take). `on_states` is handed the decoder's
    last hidden states (n, C, h) on the plain-head path (the KL check's `StateRecorder`)."""
    head = plain_head(policy) if chunk_tokens is not None else None
    if head is None:
        logits = completion_logits(policy, prompt_ids, prompt_mask, completion_ids, completion_mask)  # (n, C, V)
        return (token_logprobs(logits, completion_ids, temperature),
                token_entropy(logits if entropy_grad else logits.detach(), temperature))
    hidden = completion_states(policy, prompt_ids, prompt_mask, completion_ids, completion_mask)  # (n, C, h)
    if on_states is not None:
        on_states(hidden)
    n, width = completion_ids.shape
    logprobs, entropy = _ChunkedTokenLogprobs.apply(hidden.reshape(n * width, -1), head.weight, head.bias,
                                                    completion_ids.reshape(-1), temperature, chunk_tokens,
                                                    entropy_grad)
    return logprobs.view(n, width), entropy.view(n, width)
