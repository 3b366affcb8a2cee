"""Chunked completion log-probs: the same numbers and the same gradients as the full-logits path (float64), for
every chunk size, with and without a sketch, under a temperature; the transient is one chunk × V. Rows that share a
prompt run it once, and give what one pass over each row's prompt + completion gives."""

import pytest
import torch

from conftest import SKETCH_TARGETS, make_tiny_qwen2
from lightning_logra.algo.logprobs import completion_logprobs, completion_states, plain_head, vocab_logits
from lightning_logra.base.batch import positions
from lightning_logra.sketch import install_sketches


def _model(**kwargs):
    # sdpa, as the runs use: eager attention turns the fully masked rows of left padding into NaN
    model = make_tiny_qwen2(**kwargs)
    model.set_attn_implementation("sdpa")
    return model


def _batch(n=3, prompt=4, completion=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(n, prompt, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding
    completion_mask = torch.ones(n, completion, dtype=torch.long)
    completion_mask[1, 3:] = 0  # a shorter completion
    return (torch.randint(0, 97, (n, prompt), generator=g), prompt_mask,
            torch.randint(0, 97, (n, completion), generator=g), completion_mask)


def _grads(model, batch, temperature, chunk):
    model.zero_grad(set_to_none=True)
    logprobs, entropy = completion_logprobs(model, *batch, temperature=temperature, chunk_tokens=chunk)
    weights = torch.linspace(-1, 1, logprobs.numel(), dtype=logprobs.dtype).view_as(logprobs) * batch[3]
    (weights * logprobs).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), entropy, grads


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk", [1, 4, 7, 1000])
def test_chunks_equal_the_full_logits_path_in_float64(tied, chunk):
    model = _model(dtype=torch.float64)
    if not tied:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() + 0.01)
    batch = _batch()
    for temperature in (1.0, 0.7):
        full = _grads(model, batch, temperature, None)
        ours = _grads(model, batch, temperature, chunk)
        torch.testing.assert_close(ours[0], full[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(ours[1], full[1], rtol=0, atol=1e-12)
        assert ours[2].keys() == full[2].keys() and "lm_head.weight" in ours[2] or tied
        for name, grad in full[2].items():
            torch.testing.assert_close(ours[2][name], grad, rtol=0, atol=1e-12, msg=name)


def _sketched(model, handles, objective):
    """The sketches the backward pass of `objective()` (a scalar) accumulates from zero."""
    for h in handles.values():
        h.zero_sketch()
    objective().backward()
    return {name: h.sketch.clone() for name, h in handles.items()}


def _sketched_model():
    model = _model(dtype=torch.float64)
    for p in model.parameters():
        p.requires_grad_(False)
    return model, install_sketches(model, SKETCH_TARGETS, rank=4)


def test_sketches_are_the_same_through_the_chunked_path():
    model, handles = _sketched_model()
    batch = _batch()
    full, chunked = (_sketched(model, handles, lambda chunk=chunk: (completion_logprobs(
        model, *batch, temperature=0.9, chunk_tokens=chunk)[0] * batch[3]).sum()) for chunk in (None, 5))
    for name in handles:
        torch.testing.assert_close(chunked[name], full[name], rtol=0, atol=1e-12, msg=name)
        assert full[name].abs().sum() > 0


def test_a_head_that_is_not_plain_takes_the_full_path():
    model = _model()
    assert plain_head(model) is model.lm_head
    model.config.final_logit_softcapping = 30.0
    assert plain_head(model) is None
    model.config.final_logit_softcapping = None
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untied: it may be sketched
    install_sketches(model, ["lm_head"], rank=4)  # a sketched head is a SketchedLinear
    assert plain_head(model) is None


def test_only_one_chunk_of_logits_exists_at_a_time():
    # The largest tensor the chunked forward + backward allocate is one chunk × V (here 4 × 50,000), not n·C × V.
    model = _model()
    model.resize_token_embeddings(50_000)
    batch = (*_batch()[:2], torch.randint(0, 50_000, (3, 32)), torch.ones(3, 32, dtype=torch.long))
    largest = []

    class Largest(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    largest.append(t.numel())
            return out

    with Largest():
        logprobs, _ = completion_logprobs(model, *batch, chunk_tokens=4)
        logprobs.sum().backward()
    vocab_times_chunk = 4 * 50_000
    head = 50_000 * 64  # the head's own weight and its gradient
    assert max(n for n in largest if n != head) <= vocab_times_chunk < 3 * 32 * 50_000


@pytest.mark.parametrize("chunk", [None, 1, 5, 1000])
def test_the_entropy_bonus_gradient_equals_autograd_through_the_full_logits_in_float64(chunk):
    # model.loss.entropy_coef differentiates the token entropy; the chunked path's backward computes dH/dlogits itself
    # (−p·(log p + H)/T), which must equal autograd through a plain log-softmax of the full logits.
    model = _model(dtype=torch.float64)
    batch = _batch()
    for temperature in (1.0, 0.7):
        results = []
        for path in ("reference", chunk):
            model.zero_grad(set_to_none=True)
            if path == "reference":
                ids, mask = torch.cat([batch[0], batch[2]], 1), torch.cat([batch[1], batch[3]], 1)
                logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
                logp = torch.log_softmax(logits[:, -batch[2].shape[1] - 1 : -1] / temperature, -1)
                logprobs = logp.gather(-1, batch[2][..., None]).squeeze(-1)
                entropy = -(logp.exp() * logp).sum(-1)
            else:
                logprobs, entropy = completion_logprobs(model, *batch, temperature=temperature, chunk_tokens=path,
                                                        entropy_grad=True)
            w = torch.linspace(-1, 1, entropy.numel(), dtype=entropy.dtype).view_as(entropy) * batch[3]
            (0.3 * (w * logprobs).sum() - 0.01 * (w.flip(0) * entropy).sum()).backward()
            results.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        reference, ours = results
        assert reference.keys() == ours.keys()
        for name, grad in reference.items():
            torch.testing.assert_close(ours[name], grad, rtol=0, atol=1e-12, msg=name)
    # the entropy alone (no log-prob term) is differentiable too
    model.zero_grad(set_to_none=True)
    _, entropy = completion_logprobs(model, *batch, chunk_tokens=chunk, entropy_grad=True)
    entropy.sum().backward()
    assert model.lm_head.weight.grad.abs().sum() > 0


def _groups():
    """Six rows of three prompts (a group's rows as GRPO makes them, one of them padded with other ids), completions
    of other lengths: (prompt ids, prompt mask, completion ids, completion mask)."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, 97, (3, 7), generator=g)
    masks = torch.ones(3, 7, dtype=torch.long)
    masks[:, :1] = 0  # left padding that every prompt has (a longer prompt elsewhere in the batch), and more
    masks[0, :3] = 0
    rows = torch.tensor([0, 0, 1, 2, 2, 1])
    prompt_ids, prompt_mask = prompts[rows] * masks[rows], masks[rows]
    prompt_ids[1, :3] = 5  # padding under a 0 mask is no token: still prompt 0
    completion_mask = torch.ones(6, 5, dtype=torch.long)
    completion_mask[1, 2:] = 0
    completion_mask[4, 4:] = 0
    return prompt_ids, prompt_mask, torch.randint(1, 97, (6, 5), generator=g), completion_mask


def _one_pass(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).last_hidden_state
    return hidden[:, -completion_ids.shape[1] - 1 : -1]


def _close_at_scale(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """Equal to 1e-6 of the tensor's largest entry: fp32 rounding of sums whose terms are that large (an entry that
    is a small difference of large terms keeps their absolute error)."""
    assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max()), name


def _positions_run(model):
    """How many token positions the decoder runs (its embedding's inputs), counted into the returned list."""
    counted = [0]
    model.get_input_embeddings().register_forward_pre_hook(lambda _, args: counted.__setitem__(0, counted[0]
                                                                                              + args[0].numel()))
    return counted


def test_rows_of_one_prompt_run_it_once_and_equal_one_pass_over_each_row_in_float64():
    # The tolerance of the gradients: transformers' RMSNorm computes in fp32 even in a float64 model, so a sum taken
    # in another order (a prompt's gradient summed over its rows before the layers', not after) rounds at fp32.
    model = _model(dtype=torch.float64)
    batch = _groups()
    # the hidden state that predicts each real token: the prompt's last, then every real completion token but the last
    real = torch.cat([torch.ones(6, 1, dtype=torch.long), batch[3][:, :-1]], 1)[..., None]  # (n, C, 1)
    weights = torch.randn(6, 5, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * real
    results = []
    counted = _positions_run(model)
    for states in (_one_pass, completion_states):
        model.zero_grad(set_to_none=True)
        counted[0] = 0
        hidden = states(model, *batch)  # (n, C, h)
        (weights * hidden).sum().backward()
        results.append((hidden.detach() * real, {n: p.grad.clone() for n, p in model.named_parameters()},
                        counted[0]))
    (reference, reference_grads, one_pass), (shared, grads, two_passes) = results
    torch.testing.assert_close(shared, reference, rtol=0, atol=1e-12)
    for name, grad in reference_grads.items():
        _close_at_scale(grads[name], grad, name)
    # 3 prompts of 6 columns (the padding all of them share trimmed) and 6 completions of 5, not 6 rows of 12
    assert (one_pass, two_passes) == (6 * 12, 3 * 6 + 6 * 5)


def test_shared_prompts_give_the_same_sketches_and_log_probs():
    model, handles = _sketched_model()
    batch = _groups()

    def one_pass() -> torch.Tensor:  # (n, C) log π(token) at temperature 0.9 from one pass over prompt + completion
        logits = model.lm_head(_one_pass(model, *batch)) / 0.9
        return logits.log_softmax(-1).gather(-1, batch[2][..., None]).squeeze(-1)

    shared = completion_logprobs(model, *batch, temperature=0.9, chunk_tokens=4)[0]
    torch.testing.assert_close(shared.detach() * batch[3], one_pass().detach() * batch[3], rtol=0, atol=1e-12)
    reference = _sketched(model, handles, lambda: (one_pass() * batch[3]).sum())
    sketches = _sketched(model, handles, lambda: (completion_logprobs(model, *batch, temperature=0.9,
                                                                      chunk_tokens=4)[0] * batch[3]).sum())
    for name, sketch in reference.items():
        assert sketch.abs().sum() > 0
        _close_at_scale(sketches[name], sketch, name)


def test_a_decoder_that_recomputes_activations_takes_one_pass():
    # transformers keeps no cache under gradient checkpointing: the prompts cannot be shared there
    model = _model(dtype=torch.float64)
    model.gradient_checkpointing_enable()
    model.train()
    batch = _groups()
    counted = _positions_run(model)
    hidden = completion_states(model, *batch)
    assert counted[0] == 6 * 12
    model.eval()
    torch.testing.assert_close(hidden, _one_pass(model, *batch), rtol=0, atol=0)


def test_a_model_whose_cache_cannot_be_gathered_takes_one_pass_and_says_so(caplog, monkeypatch):
    monkeypatch.setattr("lightning_logra.algo.logprobs._warned", [])  # said once a process: this test's first
    model = _model(dtype=torch.float64)
    decoder = model.get_decoder()
    keeps_none = decoder.forward
    decoder.forward = lambda **kwargs: keeps_none(**{**kwargs, "use_cache": False})  # as a model without a cache
    batch = _groups()
    with caplog.at_level("WARNING", logger="lightning_logra.algo.logprobs"):
        hidden = completion_states(model, *batch)
    torch.testing.assert_close(hidden, _one_pass(model, *batch), rtol=0, atol=0)
    assert "keeps no key/value cache that can be gathered by row" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 37])
def test_a_heads_logits_on_the_cpu_equal_torchs_linear_to_rounding(dtype, rows):
    # vocab_logits computes hidden·Wᵀ as (W·hiddenᵀ)ᵀ on the CPU (MKL's x·Wᵀ packs the whole head per call): the same
    # products, summed in another order. Checked against float64 at the shapes the trainer and the engine use it at
    # (a decoding step's few rows, a chunk of tokens), with and without a bias; the result is a plain (c, V) tensor.
    generator = torch.Generator().manual_seed(rows)
    hidden = torch.randn(rows, 96, generator=generator, dtype=torch.float64)
    weight = torch.randn(3000, 96, generator=generator, dtype=torch.float64) * 0.05
    bias = torch.randn(3000, generator=generator, dtype=torch.float64)
    for b in (None, bias):
        exact = torch.nn.functional.linear(hidden, weight, b)  # float64
        args = (hidden.to(dtype), weight.to(dtype), None if b is None else b.to(dtype))
        logits = vocab_logits(*args)
        assert logits.shape == (rows, 3000) and logits.dtype == dtype and logits.is_contiguous()
        torch_linear = torch.nn.functional.linear(*args)
        # no further from float64 than torch's own linear in the same dtype (bf16: its rounding of each product)
        error, own = (logits.double() - exact).abs().max(), (torch_linear.double() - exact).abs().max()
        assert error <= max(2 * own, 1e-12), (error, own)
