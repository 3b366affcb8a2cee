import copy
import math

import pytest
import torch

from conftest import SKETCH_TARGETS, make_tiny_qwen2
from lightning_logra.algo.kl import (
    NextTokens,
    intended_kl,
    low_rank_perturbation,
    mean_token_kl,
    next_tokens,
    predicted_kl,
    realized_kl,
    step_scale,
)
from lightning_logra.algo.logprobs import completion_logits
from lightning_logra.algo.update import Update
from lightning_logra.base.batch import Rollout
from lightning_logra.callbacks import PredictedKLBudget
from lightning_logra.sketch import SketchSGD, apply_low_rank_update_, install_sketches
from lightning_logra.sketch.update import LowRankDelta


def _responses(n=4, prompt=5, completion=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(n, completion, dtype=torch.long)
    mask[0, 4:] = 0  # one shorter completion
    return Rollout(torch.randint(0, 97, (n, prompt), generator=g), torch.ones(n, prompt, dtype=torch.long),
                   torch.randint(0, 97, (n, completion), generator=g), mask, torch.zeros(n, completion))


def _random_proposal(handles, scale, dtype=torch.float32, seed=1):
    """An update at α = 1 with F = η·U for η = 0.5 and random U."""
    g = torch.Generator().manual_seed(seed)
    return Update({f"{name}.weight": LowRankDelta(0.5 * torch.randn(h.out_features, h.rank, generator=g).to(dtype)
                                                  * scale, h.seed, h.distribution, h.in_features)
                   for name, h in handles.items()})


def _merge_into(model, proposal, alpha=1.0):
    for name, delta in proposal.low_rank.items():
        apply_low_rank_update_(model.get_parameter(name), alpha * delta.factor, delta.projection().to(delta.factor))


def test_low_rank_evaluation_equals_a_weight_copy_in_float64():
    model = make_tiny_qwen2(dtype=torch.float64)
    handles = install_sketches(model, SKETCH_TARGETS, rank=4)
    proposal = _random_proposal(handles, 0.1, torch.float64)
    responses = _responses()
    copied = copy.deepcopy(model)
    _merge_into(copied, proposal)
    args = (responses.prompt_ids, responses.prompt_mask, responses.completion_ids, responses.completion_mask)
    with torch.no_grad(), low_rank_perturbation(model, proposal):
        perturbed = completion_logits(model, *args)  # float64 logits of θ + Δ, weights untouched
    with torch.no_grad():
        merged = completion_logits(copied, *args)
        original = completion_logits(model, *args)  # hooks are gone again
    assert perturbed.dtype == torch.float64
    torch.testing.assert_close(perturbed, merged, rtol=0, atol=1e-12)
    assert not torch.allclose(perturbed, original, atol=1e-3)


def test_a_whole_proposal_sketched_and_dense_equals_a_weight_copy():
    model = make_tiny_qwen2(dtype=torch.float64)
    handles = install_sketches(model, SKETCH_TARGETS, rank=4)
    proposal = _random_proposal(handles, 0.1, torch.float64)
    norm = model.model.norm.weight
    proposal.dense["model.norm.weight"] = norm.detach() + torch.randn_like(norm) * 0.1  # the value at α = 1
    responses = _responses()
    for alpha in (1.0, 0.3):
        copied = copy.deepcopy(model)
        _merge_into(copied, proposal, alpha)
        with torch.no_grad():
            copied.model.norm.weight.lerp_(proposal.dense["model.norm.weight"], alpha)
        current = next_tokens(model, responses)
        exact = realized_kl(copied, responses, current)
        if alpha == 1.0:
            q, _ = predicted_kl(model, proposal, responses)
            assert float(q) == pytest.approx(float(exact), rel=1e-9)
        else:
            assert float(intended_kl(model, proposal, responses, current, alpha)) == pytest.approx(float(exact),
                                                                                                   rel=1e-9)
    # the dense part counts: without it the prediction differs
    sketched_only = predicted_kl(model, Update(proposal.low_rank), responses)[0]
    assert abs(float(sketched_only) - float(q)) > 1e-3 * float(q)
    assert torch.equal(model.model.norm.weight, norm)  # weights untouched


def test_kl_is_quadratic_in_the_step_for_small_steps():
    model = make_tiny_qwen2()
    handles = install_sketches(model, SKETCH_TARGETS, rank=4)
    proposal = _random_proposal(handles, 0.02)
    responses = _responses()
    with torch.no_grad():
        base = next_tokens(model, responses)
        kls = []
        for alpha in (0.1, 0.2):
            with low_rank_perturbation(model, proposal, alpha):
                kls.append(mean_token_kl(base, next_tokens(model, responses),
                                         responses.completion_mask).item())
    assert kls[1] / kls[0] == pytest.approx(4.0, rel=0.05)


def test_realized_kl_agrees_with_the_prediction_for_a_small_step():
    model = make_tiny_qwen2()
    for p in model.parameters():
        p.requires_grad_(False)
    handles = install_sketches(model, SKETCH_TARGETS, rank=8)
    # η small enough that the proposal at α = 1 is itself a small step: q is measured in the quadratic regime.
    # (At η = 1 on this random model, q = 0.027 lies far outside it and α = √(δ/q) then overshoots δ 15-fold.)
    optimizer = SketchSGD(handles, lr=0.01)
    responses = _responses()
    ids = torch.cat([responses.prompt_ids, responses.completion_ids], 1)
    model(input_ids=ids, labels=ids).loss.backward()
    assert optimizer.propose()
    q, before = predicted_kl(model, Update(optimizer.proposal()), responses)
    budget = 1e-4
    alpha = step_scale(float(q), budget, alpha_max=10.0)
    assert alpha**2 * float(q) == pytest.approx(budget)  # the budget binds: α < α_max
    optimizer.apply(alpha)
    realized = float(realized_kl(model, responses, before))
    assert realized == pytest.approx(budget, rel=0.10)


def test_step_scale_rule():
    delta = 2e-4
    assert step_scale(4 * delta, delta, alpha_max=1.0) == pytest.approx(0.5)
    assert step_scale(delta / 100, delta, alpha_max=3.0) == 3.0  # √100 = 10, capped at α_max
    assert step_scale(0.0, delta, alpha_max=2.0) == 2.0
    assert step_scale(float("nan"), delta, alpha_max=2.0) == 0.0
    for q in torch.logspace(-8, 2, 50).tolist():
        alpha = step_scale(q, delta, alpha_max=5.0)
        assert alpha**2 * q <= delta * (1 + 1e-12)
    with pytest.raises(ValueError, match="budget"):
        step_scale(1.0, 0.0, 1.0)
    for budget, alpha_max in ((math.nan, 1.0), (math.inf, 1.0), (1e-3, math.nan), (1e-3, math.inf)):
        with pytest.raises(ValueError, match="positive finite"):
            step_scale(0.0, budget, alpha_max)  # q ≤ 0 would otherwise return α_max itself


@pytest.mark.parametrize("schedule", ["linear", "cosine", "exponential"])
def test_schedules_run_from_budget_to_final_budget(schedule):
    control = PredictedKLBudget(2e-4, 2e-5, schedule, anneal_steps=100)
    assert control.budget_at(0) == pytest.approx(2e-4)
    assert control.budget_at(100) == pytest.approx(2e-5)
    assert control.budget_at(250) == pytest.approx(2e-5)
    values = [control.budget_at(s) for s in range(101)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    middle = {"linear": 1.1e-4, "cosine": 1.1e-4, "exponential": math.sqrt(2e-4 * 2e-5)}[schedule]
    assert control.budget_at(50) == pytest.approx(middle)
    assert PredictedKLBudget(3e-4).budget_at(77) == 3e-4


@pytest.mark.parametrize("key", ["budget", "final_budget", "alpha_max"])
@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_non_positive_or_non_finite_settings_name_the_key(key, value):
    # NaN slipped through a `<= 0` check and made every weight NaN; inf turned the control off.
    kwargs = {"budget": 2e-4, "final_budget": 2e-5, "schedule": "linear", "anneal_steps": 10, key: value}
    with pytest.raises(ValueError, match=f"PredictedKLBudget: {key} must be a positive finite number"):
        PredictedKLBudget(**kwargs)


def test_bad_budget_settings_fail_fast():
    with pytest.raises(ValueError, match="anneal_steps"):
        PredictedKLBudget(2e-4, 2e-5, "linear")
    with pytest.raises(ValueError, match="subset"):
        PredictedKLBudget(subset=1.5)


@pytest.mark.parametrize("subset", [16, 0.25, 1.0, 40, 2])
@pytest.mark.parametrize("split", [[16, 16], [8, 8, 8, 8], [20, 12], [3, 29], [1, 10, 20, 1]])
def test_the_subset_is_drawn_from_the_global_batch_whatever_the_number_of_processes(subset, split):
    # Each rank used to draw `subset` of its own rows: 1 and 2 processes measured q on different responses and took
    # different steps (α 0.174 against 0.196 with subset 16). The ranks' rows together must be one process's, also
    # when the ranks hold different numbers of rows (dynamic sampling keeps the groups where they were drawn).
    from lightning_logra.algo.step_size import StepContext
    from lightning_logra.base.batch import Rollout

    total, width = 32, 3
    ids = torch.arange(total)[:, None].repeat(1, width)  # each row's tokens say which global row it is
    ones = torch.ones(total, width, dtype=torch.long)
    whole = Rollout(ids, ones, ids, ones, torch.zeros(total, width))
    control = PredictedKLBudget(subset=subset, seed=3)
    one = control._select(whole, StepContext(None, 1.0, 7, 0, 1, lambda t: t))
    drawn = one.completion_ids[:, 0].tolist()
    size = subset if isinstance(subset, int) else round(subset * total)
    assert len(drawn) == min(size, total) and drawn == sorted(set(drawn))
    assert drawn != list(range(len(drawn))) or size >= total  # a draw, not the first rows
    counts_of_all = torch.tensor(split, dtype=torch.float64)  # what the ranks' sum of one-hot counts gives
    counted, first = [], 0
    for rank, n in enumerate(split):
        rows = slice(first, first + n)
        first += n
        context = StepContext(None, 1.0, 7, rank, len(split), lambda t: counts_of_all.clone())
        part = control._select(Rollout(ids[rows], ones[rows], ids[rows], ones[rows], torch.zeros(n, width)), context)
        counts = part.completion_mask.sum(1)
        # a rank none of whose rows were drawn runs the passes on one row whose tokens count zero
        assert (counts == width).all() or (len(counts) == 1 and counts.item() == 0)
        counted += part.completion_ids[counts > 0, 0].tolist()
    assert counted == drawn


@pytest.mark.parametrize("subset", [6, 0.25, 2])
def test_the_subset_is_drawn_by_where_one_process_holds_the_rows(subset):
    # Dynamic sampling keeps groups where they were drawn, round by round: rank 0 may hold one process's rows 0-3 and
    # 8-11, rank 1 rows 4-7 and 12-15, and rank 2 none (it trains one row whose tokens count zero). Numbered
    # rank-major, the same index named different responses on 1 and 3 processes (kl/q 0.012 against 0.024).
    from lightning_logra.algo.step_size import StepContext
    from lightning_logra.base.batch import Rollout

    total, width = 16, 3
    ids = torch.arange(total)[:, None].repeat(1, width)
    ones = torch.ones(total, width, dtype=torch.long)
    control = PredictedKLBudget(subset=subset, seed=5)
    one = control._select(Rollout(ids, ones, ids, ones, torch.zeros(total, width)),
                          StepContext(None, 1.0, 4, 0, 1, lambda t: t))
    drawn = one.completion_ids[:, 0].tolist()
    held = [torch.tensor([0, 1, 2, 3, 8, 9, 10, 11]), torch.tensor([4, 5, 6, 7, 12, 13, 14, 15]),
            torch.zeros(0, dtype=torch.long)]
    counts_of_all = torch.tensor([8.0, 8.0, 0.0], dtype=torch.float64)
    counted = []
    for rank, positions in enumerate(held):
        rows = positions if positions.numel() else torch.zeros(1, dtype=torch.long)  # the idle rank's one row
        context = StepContext(None, 1.0, 4, rank, 3, lambda t: counts_of_all.clone(), positions)
        part = control._select(Rollout(ids[rows], ones[rows], ids[rows], ones[rows], torch.zeros(len(rows), width)),
                               context)
        counts = part.completion_mask.sum(1)
        assert (counts == width).all() or (len(counts) == 1 and counts.item() == 0)
        counted += part.completion_ids[counts > 0, 0].tolist()
    assert sorted(counted) == drawn and 0 < len(drawn) < total


def test_bf16_weights_predict_the_kl_of_the_proposal_not_rounding_noise():
    # A step whose entries are about 1e-4 (η·U·A at lr 1e-4): a bf16 forward pass cannot hold it (8 significant bits)
    # and reads several times its KL, so the check evaluates the bf16 weights in fp32, which gives the float64 truth
    # to fp32's own rounding: that of Σ p·(log p − log q) is about 2e-8 on this model, a quarter of this q (a step
    # ten times smaller would be rounding in fp32 too; the runs' budgets, 1e-4 and more, are far above it).
    model = make_tiny_qwen2(dtype=torch.bfloat16)
    reference = copy.deepcopy(model).double()  # the same (bf16-valued) weights, held in float64
    handles = install_sketches(model, SKETCH_TARGETS, rank=4)
    reference_handles = install_sketches(reference, SKETCH_TARGETS, rank=4)  # the same seeds: the proposal fits both
    # rank 4 (±1/2, exact in bf16): the bf16 layers keep A in bf16, and the check casts it to fp32 as each runs
    assert all(h.cached_projection.dtype == torch.bfloat16 for h in handles.values())
    proposal = _random_proposal(handles, 1e-4)
    responses = _responses()
    q, current = predicted_kl(model, proposal, responses)
    q_ref, current_ref = predicted_kl(reference, _random_proposal(reference_handles, 1e-4, torch.float64), responses)
    assert current.hidden.dtype == torch.float32 and float(q_ref) > 5e-8
    # The regime where it matters: the same two passes in bf16 read several times more (bf16 rounding, not the step).
    ids = (responses.prompt_ids, responses.prompt_mask, responses.completion_ids, responses.completion_mask)
    with torch.no_grad():
        before = completion_logits(model, *ids).float()  # (n, C, V)
        with low_rank_perturbation(model, proposal):
            after = completion_logits(model, *ids).float()
    vocab = before.shape[-1]
    in_bf16 = mean_token_kl(NextTokens(logits=before.reshape(-1, vocab)), NextTokens(logits=after.reshape(-1, vocab)),
                            responses.completion_mask)
    assert float(in_bf16) > 3 * float(q_ref)
    assert float(q) == pytest.approx(float(q_ref), rel=0.3)
    torch.testing.assert_close(current.hidden, current_ref.hidden.float(), rtol=0, atol=1e-5)
    # the parameters are bf16 again afterwards, and nothing else was left behind
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if "sketch_param" not in n)
    assert not any(hasattr(m, "_float32_saved") for m in model.modules())


def test_intended_kl_is_the_exact_kl_of_the_scaled_step():
    model = make_tiny_qwen2(dtype=torch.float64)
    handles = install_sketches(model, SKETCH_TARGETS, rank=4)
    proposal = _random_proposal(handles, 0.01, torch.float64)
    responses = _responses()
    q, current = predicted_kl(model, proposal, responses)
    copied = copy.deepcopy(model)
    _merge_into(copied, proposal, 0.3)
    exact = realized_kl(copied, responses, current)
    assert float(intended_kl(model, proposal, responses, current, 0.3)) == pytest.approx(float(exact), rel=1e-9)
    assert float(exact) == pytest.approx(0.09 * float(q), rel=0.05)  # ≈ α²·q


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_the_kl_in_chunks_equals_the_kl_of_full_log_softmax_tensors(chunk):
    # float64: the chunked sum over the completion tokens is the masked mean of Σ_v p (log p − log q) over
    # (n, C, V) tensors built whole, for any chunk size; and a head that is not plain takes the full-logits path.
    model = make_tiny_qwen2(dtype=torch.float64)
    handles = install_sketches(model, SKETCH_TARGETS, rank=4)
    proposal = _random_proposal(handles, 0.1, torch.float64)
    responses = _responses()
    args = (responses.prompt_ids, responses.prompt_mask, responses.completion_ids, responses.completion_mask)
    with torch.no_grad():
        logp = torch.log_softmax(completion_logits(model, *args) / 0.7, -1)
        with low_rank_perturbation(model, proposal):
            logq = torch.log_softmax(completion_logits(model, *args) / 0.7, -1)
    mask = responses.completion_mask.double()
    expected = ((logp.exp() * (logp - logq)).sum(-1) * mask).sum() / mask.sum()
    before = next_tokens(model, responses)
    with torch.no_grad(), low_rank_perturbation(model, proposal):
        after = next_tokens(model, responses)
    assert before.logits is None and before.hidden.shape == (4 * 6, 64)  # hidden states, no (n, C, V) tensor
    got = mean_token_kl(before, after, responses.completion_mask, 0.7, chunk_tokens=chunk)
    assert float(got) == pytest.approx(float(expected), rel=1e-10)
    model.config.final_logit_softcapping = 30.0  # not a plain head (Qwen2 ignores it; the check does not)
    full = next_tokens(model, responses)
    assert full.hidden is None and full.logits.shape == (4 * 6, 97)
    assert float(mean_token_kl(full, after, responses.completion_mask, 0.7, chunk)) == pytest.approx(float(expected),
                                                                                                      rel=1e-10)


def test_the_kl_check_never_copies_the_embedding_or_the_head_to_fp32_whole():
    # A bf16 model with a large vocabulary (5,000 × 64 tied table): the fp32 forward looks up bf16 rows and casts
    # them, and the head is cast 100 rows at a time, so no fp32 tensor near V × h exists (at the 7B shape each copy
    # would be 2 GiB, the check's largest tensor). The KL equals the one computed through a whole fp32 head.
    model = make_tiny_qwen2(dtype=torch.bfloat16)
    model.resize_token_embeddings(5000)
    handles = install_sketches(model, SKETCH_TARGETS, rank=4)
    proposal, responses = _random_proposal(handles, 0.1), _responses()
    sizes = []

    class Float32Sizes(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    sizes.append(t.numel())
            return out

    with Float32Sizes(), torch.no_grad():
        before = next_tokens(model, responses)
        with low_rank_perturbation(model, proposal):
            after = next_tokens(model, responses)
        blocked = mean_token_kl(before, after, responses.completion_mask, chunk_tokens=2, vocab_block=100)
    assert max(sizes) <= 2 * 5000 < 5000 * 64  # a chunk of 2 tokens × V; a block of the head is 100 × 64
    whole = mean_token_kl(before, after, responses.completion_mask, chunk_tokens=2, vocab_block=5000)
    assert float(blocked) > 0 and float(blocked) == pytest.approx(float(whole), rel=1e-5)


def _counting_decoder_calls(model):
    calls = []
    model.get_decoder().register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("zero_advantage_rows", [[], [1, 6]], ids=["every row trained", "two rows left out"])
def test_the_checks_current_pass_is_kept_from_the_updates_forward_passes(zero_advantage_rows):
    """PolicyGradient hands each micro-batch's last hidden states to the controller's recorder; the check then runs
    the proposed policy only (and the current one on rows the update left out), and measures the q it measured with
    a pass of its own, to rounding (float64: 1e-9 relative)."""
    from lightning_logra.algo.step_size import StepContext
    from lightning_logra.train.objective import PolicyGradient
    from lightning_logra.train.settings import LossSettings, RolloutSettings, TrainingSettings

    model = make_tiny_qwen2(dtype=torch.float64)
    handles = install_sketches(model, SKETCH_TARGETS, rank=4)
    proposal = _random_proposal(handles, 0.05, torch.float64)
    n = 8
    rollout = _responses(n=n, prompt=5, completion=6, seed=3)
    rollout.prompt_ids[::2] = rollout.prompt_ids[0]  # rows that share a prompt, as a group's do
    advantages = torch.linspace(-1, 1, n, dtype=torch.float64)
    advantages[zero_advantage_rows] = 0.0
    objective = PolicyGradient(model, None, LossSettings(), TrainingSettings(micro_batch_size=3), RolloutSettings(),
                               1.0, 6, lambda loss: loss.backward(), lambda t: t, lambda t: t)

    def check(recorded):
        control = PredictedKLBudget(budget=1e-4, subset=5, seed=2)
        context = StepContext(model, 1.0, 3, 0, 1, lambda t: t, recorded=recorded)
        calls = _counting_decoder_calls(model)
        alpha = control.choose_alpha(proposal, rollout, context)
        hooks = model.get_decoder()._forward_hooks
        hooks.pop(list(hooks)[-1])
        return control._metrics["kl/q"], alpha, len(calls), control

    q, alpha, calls_alone, control = check(None)
    recorder = control.recorder(rollout, StepContext(model, 1.0, 3, 0, 1, lambda t: t))
    assert recorder is not None and len(recorder.rows) == 5
    objective.accumulate(rollout, advantages, recorder)
    left_out = [row for row in recorder.rows if row in zero_advantage_rows]
    assert sorted(recorder.states) == sorted(set(recorder.rows) - set(left_out))
    kept_q, kept_alpha, calls, _ = check(recorder)
    assert kept_q == pytest.approx(q, rel=1e-9) and kept_alpha == pytest.approx(alpha, rel=1e-9)
    # shared prompts: a pass is two calls of the decoder; one pass (two calls) saved, none where rows were left out
    assert calls_alone == 4 and calls == (4 if left_out else 2)


def test_the_current_pass_is_not_kept_where_the_check_computes_otherwise():
    """bf16 weights (the check computes in fp32) and a non-plain head take no recorder; a forward pass under
    autocast records nothing, and the check then runs its own current pass."""
    from lightning_logra.algo.kl import StateRecorder, recording

    assert recording(make_tiny_qwen2())
    assert not recording(make_tiny_qwen2(dtype=torch.bfloat16))
    capped = make_tiny_qwen2()
    capped.config.final_logit_softcapping = 30.0
    assert not recording(capped)

    model = make_tiny_qwen2()
    responses = _responses()
    recorder = StateRecorder(torch.arange(4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = torch.zeros(4, 6, 64)
        recorder.record(torch.arange(4), hidden)
    assert not recorder.active and not recorder.states
    with torch.no_grad():
        alone = next_tokens(model, responses)
        assert torch.equal(recorder.current(model, responses).hidden, alone.hidden)
        # a rank none of whose rows were drawn holds zeros for its placeholder row, and runs no pass
        empty = StateRecorder(torch.zeros(0, dtype=torch.long))
        empty.record(torch.zeros(0, dtype=torch.long), hidden[:1])
        calls = _counting_decoder_calls(model)
        placeholder = responses.select(torch.zeros(1, dtype=torch.long)).emptied()
        assert not empty.current(model, placeholder).hidden.any() and not calls
