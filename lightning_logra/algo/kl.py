"""Predicted-KL step control, in plain PyTorch: measure how far a proposed update would move the policy's
next-token distribution on a few responses, then scale the update to stay inside a budget δ.

For a proposal Δ (an `Update` at α = 1: per sketched matrix −η·U·A, plus the full step of densely trained
parameters) and a subset D of the batch's responses:

    q(D) = mean over completion tokens of KL(π_θ(·|ctx) ‖ π_{θ+Δ}(·|ctx)), full vocabulary, fp32, at temperature T
    α    = min(α_max, √(δ / q))          since locally KL(αΔ) ≈ α²·q

The proposed model is evaluated without modifying any weight: a sketched layer's output under Δ is
y − η·(x·Aᵀ)·Uᵀ, added by a forward hook, and densely trained parameters are swapped for their proposed values
(θ + α·Δ) for the pass.

Neither side's full-vocabulary log-probs are held: each pass keeps the decoder's last hidden states (n·C × h) and
the LM head, and the KL is accumulated a chunk of tokens at a time (`mean_token_kl`), so the check's transient is
a few chunk × V tensors, not 2 × n × C × V (about 5 GB at 2 responses × 2k tokens over a 152k vocabulary).

With bf16/fp16 weights both forward passes run in fp32 end to end (`float32_compute`): a perturbation of relative
size 1e-6 added into a bf16 residual stream (8 significant bits) would be lost in its rounding, and q would measure
rounding noise instead of the proposal (it read 14× the true value at η = 1e-6 on the tiny model). Two tables are
never copied to fp32 whole, because at a 152k vocabulary each copy would be the check's largest tensor (2 GiB at
the 7B shape): the embedding looks its rows up in bf16 and casts only those, and the LM head is cast a block of
vocabulary rows at a time (`head_logits`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from lightning_logra.algo.logprobs import (
    completion_logits,
    completion_states,
    compute_dtype,
    plain_head,
    vocab_logits,
)
from lightning_logra.algo.update import Update, swap_values
from lightning_logra.base.batch import Rollout
from lightning_logra.base.settings import check_positive
from lightning_logra.sketch.rounding import LOW_PRECISION


@contextmanager
def low_rank_perturbation(policy: nn.Module, proposal: Update, alpha: float = 1.0) -> Iterator[None]:
    """Within the block, each sketched layer computes y − α·(x·Aᵀ)·Fᵀ (F = η·U): the model θ + αΔ, weights
    untouched. The sketched layers' own (cached) projections are used: the proposal's seeds are theirs."""

    def hook_for(factor: torch.Tensor):  # (d, r)
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
            x = inputs[0]  # (..., k)
            # A (r, k) in x's dtype, made when the layer runs: no layer's cast outlives its own hook
            return output - alpha * (x @ module.projection(x.dtype).T) @ factor.T.to(x.dtype)  # (..., d)

        return hook

    handles = []
    for name, delta in proposal.low_rank.items():
        layer = policy.get_submodule(name.removesuffix(".weight"))
        handles.append(layer.register_forward_hook(hook_for(delta.factor)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def float32_compute(model: nn.Module) -> Iterator[None]:
    """Within the block, every module computes from fp32 copies of its own bf16/fp16 parameters and buffers, made
    just before it runs and dropped just after: the forward pass is fp32 end to end (from the embedding on, every
    activation is fp32), while at most one module's weights exist in fp32 at a time — no fp32 copy of the model."""

    def cast(module: nn.Module, _inputs) -> None:
        if exact_rows(module):
            return  # its output is cast instead (`rows_to_float32`)
        saved = {}
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None and tensor.dtype in LOW_PRECISION:
                    saved[(id(table), name)] = (table, tensor)
                    fp32 = tensor.detach().float()
                    table[name] = nn.Parameter(fp32, requires_grad=False) if table is module._parameters else fp32
        module._float32_saved = saved

    def restore(module: nn.Module, *_) -> None:
        for (_, name), (table, tensor) in module.__dict__.pop("_float32_saved", {}).items():
            table[name] = tensor

    def rows_to_float32(module: nn.Module, _inputs, output: torch.Tensor) -> torch.Tensor:
        return output.float()

    low = [m for m in model.modules()
           if any(t.dtype in LOW_PRECISION for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))]
    handles = [h for m in low for h in (m.register_forward_pre_hook(cast), m.register_forward_hook(restore))]
    handles += [m.register_forward_hook(rows_to_float32) for m in low if exact_rows(m)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module in low:  # a forward that raised skipped its restore hooks
            restore(module)


def exact_rows(module: nn.Module) -> bool:
    """An embedding whose lookup in bf16 followed by a cast of the looked-up rows equals the lookup in the cast
    table (no renormalization of rows): V × h never exists in fp32, only the tokens' rows."""
    return type(module) is nn.Embedding and module.max_norm is None


@contextmanager
def dense_values(policy: nn.Module, dense: Mapping[str, torch.Tensor], alpha: float = 1.0) -> Iterator[None]:
    """Within the block, each named parameter holds θ + α·(value − θ) (`dense` gives the values at α = 1); the
    parameters' own tensors are swapped back afterwards, untouched (no arithmetic on them)."""
    params = dict(policy.named_parameters())
    saved = {}
    try:
        for name, value in dense.items():
            param = params[name]
            # lerp is exact at α = 1: the optimizer's own step, not θ + (value − θ) rounded twice.
            saved[name] = swap_values(param, value if alpha == 1.0 else torch.lerp(param.data, value, alpha))
        yield
    finally:
        for name, data in saved.items():
            swap_values(params[name], data)


VOCAB_BLOCK = 16384  # head rows cast to fp32 at a time: 16k × h × 4 bytes (224 MiB at h = 3584)


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                vocab_block: int = VOCAB_BLOCK) -> torch.Tensor:
    """hidden (c, h) in the compute dtype through the head (V, h) → logits (c, V) in the hidden's dtype. A head of
    another dtype (bf16) is cast `vocab_block` rows at a time, so no compute-dtype copy of all V × h exists; casting
    is exact, so the logits are the same as through a whole copy."""
    dtype = hidden.dtype
    if weight.dtype == dtype:
        return vocab_logits(hidden, weight, None if bias is None else bias.to(dtype))
    logits = hidden.new_empty(hidden.shape[0], weight.shape[0])  # (c, V)
    for start in range(0, weight.shape[0], vocab_block):
        block = slice(start, start + vocab_block)
        logits[:, block] = vocab_logits(hidden, weight[block].to(dtype),
                                        None if bias is None else bias[block].to(dtype))
    return logits


@dataclass
class NextTokens:
    """What fixes π(· | ctx) at every completion position: the decoder's last hidden states and the LM head that maps
    them to logits, so that the log-softmax is computed a chunk of tokens at a time (a model whose head is not plain
    keeps its full logits instead). Never holds n × C × V numbers unless `logits` is set."""

    hidden: torch.Tensor | None = None  # (n·C, h) fp32
    weight: torch.Tensor | None = None  # (V, h) the head's weight, as it was when measured
    bias: torch.Tensor | None = None  # (V,)
    logits: torch.Tensor | None = None  # (n·C, V) fp32: the full path

    def log_softmax(self, rows: torch.Tensor, temperature: float, vocab_block: int = VOCAB_BLOCK) -> torch.Tensor:
        """log π(· | ctx) (len(rows), V) at the temperature, in the compute dtype (the logits are freed on return).
        torch's log-softmax, not x − logsumexp(x) in place: rounding the logsumexp at the logits' magnitude shifts
        every log-prob of a row by up to an ulp of it, which a KL of 1e-8 cannot afford."""
        if self.logits is not None:
            logits = self.logits[rows] / temperature
        else:
            logits = head_logits(self.hidden[rows], self.weight, self.bias, vocab_block)
            if temperature != 1.0:
                logits.div_(temperature)
        return torch.log_softmax(logits, dim=-1)


def next_tokens(policy: nn.Module, responses: Rollout) -> NextTokens:
    """The policy's `NextTokens` on `responses` (inside `low_rank_perturbation` / `dense_values`: the proposed
    policy's). bf16/fp16 models are evaluated in fp32 end to end (`float32_compute`)."""
    low_precision = any(p.dtype in LOW_PRECISION for p in policy.parameters())
    head = plain_head(policy)
    ids = (responses.prompt_ids, responses.prompt_mask, responses.completion_ids, responses.completion_mask)
    with float32_compute(policy) if low_precision else contextlib.nullcontext():
        if head is None:
            logits = completion_logits(policy, *ids)  # (n, C, V)
            return NextTokens(logits=logits.reshape(-1, logits.shape[-1]).to(compute_dtype(logits.dtype)))
        hidden = completion_states(policy, *ids)  # (n, C, h)
    return measured(hidden.reshape(-1, hidden.shape[-1]), head)


def measured(hidden: torch.Tensor, head: nn.Linear) -> NextTokens:
    """`NextTokens` of hidden states (n·C, h) through `head` as it is now. A head trained densely changes in place
    when the update is applied: the one measured here is kept (one that is not, as the sketched runs' head, is
    shared by both sides: no copy)."""
    weight = head.weight.detach().clone() if head.weight.requires_grad else head.weight.detach()
    bias = None if head.bias is None else head.bias.detach().clone()
    return NextTokens(hidden.to(compute_dtype(hidden.dtype)), weight, bias)


class StateRecorder:
    """The current policy's `NextTokens` on the KL check's responses, kept from the update's own forward pass.

    The update's forward pass runs the policy at the step's starting point on every row it trains — the same
    function the check's first pass would compute on its subset. The objective hands this recorder each micro-batch's
    last hidden states (`record`); the recorder keeps the detached rows the check will measure. Rows the update
    skipped (zero advantage) run in a pass of their own (`current`). The numbers agree with the check's own pass to
    rounding (another batch composition), not bit for bit.

    Only where the check would compute exactly what the update computed: fp32 (or float64) weights with a plain head
    (`recording`), and a forward pass outside autocast (a bf16-mixed update's states are not the check's fp32 ones:
    those micro-batches are not kept)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows.tolist()  # the subset's rows of this rank's rollout, in the subset's order (may be none)
        self.states: dict[int, torch.Tensor] = {}  # row → (w, h) its hidden states, detached
        self.active = False  # whether the update's passes were recorded (outside autocast)

    def record(self, rows: torch.Tensor, hidden: torch.Tensor) -> None:
        """rows (m,): a micro-batch's rows of the rollout (none for a rank's idle pass); hidden (m, w, h): their
        last hidden states. Every rank's update makes the same calls, so `active` is the same on every rank."""
        if torch.is_autocast_enabled(hidden.device.type):
            return
        self.active = True
        wanted = set(self.rows)
        for position, row in enumerate(rows.tolist()):
            if row in wanted:
                # a copy of the row: a view would keep the whole micro-batch's (m, w, h) states alive until the check
                self.states[row] = hidden[position].detach().clone()

    def current(self, policy: nn.Module, responses: Rollout) -> NextTokens:
        """The current policy's `NextTokens` on `responses` (the subset, its rows `self.rows`; with none, an emptied
        placeholder row whose tokens count zero): the recorded rows, and one pass over any the update skipped.
        Without a recording, the check's own pass. Under FSDP no rank runs a pass here: every row was recorded
        (every row runs in the update), and a rank without rows takes zeros for its placeholder."""
        if not self.active:
            return next_tokens(policy, responses)
        n, width = responses.completion_ids.shape
        head = plain_head(policy)
        hidden = torch.zeros(n, width, head.in_features, dtype=compute_dtype(head.weight.dtype),
                             device=responses.completion_ids.device)  # (n, C, h); padding positions count zero
        for i, row in enumerate(self.rows):
            if row in self.states:
                kept = self.states[row][:width]  # (w', h): recorded at its micro-batch's width
                hidden[i, : kept.shape[0]] = kept
        missing = [i for i, row in enumerate(self.rows) if row not in self.states]
        if missing:  # rows the update left out (zero advantage): one process only, where no pass is a collective
            index = torch.tensor(missing, device=hidden.device)
            part = next_tokens(policy, responses.select(index)).hidden  # (m·C', h)
            hidden[index, : part.shape[0] // len(missing)] = part.view(len(missing), -1, hidden.shape[-1])
        return measured(hidden.view(n * width, -1), head)


def recording(policy: nn.Module) -> bool:
    """Whether the check's current-policy pass can be taken from the update's (`StateRecorder`): fp32 or float64
    weights (bf16's check runs in fp32, its update does not) and a plain head (the check keeps hidden states)."""
    return plain_head(policy) is not None and not any(p.dtype in LOW_PRECISION for p in policy.parameters())


def mean_token_kl(p: NextTokens, q: NextTokens, mask: torch.Tensor, temperature: float = 1.0,
                  chunk_tokens: int = 512, vocab_block: int = VOCAB_BLOCK) -> torch.Tensor:
    """Mean over the masked positions (mask (n, C)) of KL(p ‖ q) = Σ_v p_v (log p_v − log q_v), full vocabulary,
    accumulated `chunk_tokens` positions at a time; at most three (chunk, V) tensors exist at once (0.9 GiB at 512
    tokens × 152k), and two most of the time."""
    rows = mask.reshape(-1).nonzero().squeeze(-1)  # the completion tokens only
    total = torch.zeros((), dtype=torch.float64, device=mask.device)
    for chunk in rows.split(chunk_tokens):
        logp = p.log_softmax(chunk, temperature, vocab_block)  # (c, V)
        terms = q.log_softmax(chunk, temperature, vocab_block).neg_().add_(logp)  # log p − log q, in log q's storage
        total += terms.mul_(logp.exp_()).sum().double()  # p·(log p − log q), p in log p's storage
        del logp, terms
    return total / max(rows.numel(), 1)  # float64


@torch.no_grad()
def predicted_kl(
    policy: nn.Module, proposal: Update, responses: Rollout, temperature: float = 1.0,
    current: NextTokens | None = None,
) -> tuple[torch.Tensor, NextTokens]:
    """(q, the current policy's `NextTokens`): q is the KL of the whole proposal (sketched and dense parts) at
    α = 1 on `responses`. The current policy's state (`current`, measured here unless given: `StateRecorder`) is
    returned so that the realized KL after the update needs one forward pass, not two."""
    current = next_tokens(policy, responses) if current is None else current
    with low_rank_perturbation(policy, proposal), dense_values(policy, proposal.dense):
        proposed = next_tokens(policy, responses)
    return mean_token_kl(current, proposed, responses.loss_mask, temperature), current


@torch.no_grad()
def intended_kl(
    policy: nn.Module, proposal: Update, responses: Rollout, before: NextTokens, alpha: float,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The exact KL of the step α·Δ, before it is merged: what the realized KL would be without any rounding of
    the merge (with stochastic rounding into bf16 the realized KL adds the rounding noise on top)."""
    with low_rank_perturbation(policy, proposal, alpha), dense_values(policy, proposal.dense, alpha):
        stepped = next_tokens(policy, responses)
    return mean_token_kl(before, stepped, responses.loss_mask, temperature)


@torch.no_grad()
def realized_kl(policy: nn.Module, responses: Rollout, before: NextTokens, temperature: float = 1.0) -> torch.Tensor:
    """KL(π_before ‖ π_now) on the same responses, after the update was applied."""
    return mean_token_kl(before, next_tokens(policy, responses), responses.loss_mask, temperature)


def step_scale(q: float, budget: float, alpha_max: float) -> float:
    """α = min(α_max, √(δ/q)): the largest step whose predicted KL α²·q stays within the budget δ."""
    check_positive("the KL budget", budget, "finite number")
    check_positive("alpha_max", alpha_max, "finite number")
    if not math.isfinite(q):
        return 0.0  # a proposal whose effect cannot be measured is not taken
    if q <= 0:
        return alpha_max  # the proposal does not move the distribution (measurably): only α_max bounds it
    return min(alpha_max, math.sqrt(budget / q))
