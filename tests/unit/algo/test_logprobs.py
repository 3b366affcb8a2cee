"""Chunked completion log-probs: the same numbers and the same gradients as the full-logits path (float64), for
every chunk size, with and without a sketch, under a temperature; the transient is one chunk × V."""

import pytest
import torch

from conftest import SKETCH_TARGETS, make_tiny_qwen2
from lightning_logra.algo.logprobs import completion_logprobs, plain_head
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


def test_sketches_are_the_same_through_the_chunked_path():
    model = _model(dtype=torch.float64)
    for p in model.parameters():
        p.requires_grad_(False)
    handles = install_sketches(model, SKETCH_TARGETS, rank=4)
    batch = _batch()
    sketches = []
    for chunk in (None, 5):
        for h in handles.values():
            h.zero_sketch()
        logprobs, _ = completion_logprobs(model, *batch, temperature=0.9, chunk_tokens=chunk)
        (logprobs * batch[3]).sum().backward()
        sketches.append({name: h.sketch.clone() for name, h in handles.items()})
    for name in handles:
        torch.testing.assert_close(sketches[1][name], sketches[0][name], rtol=0, atol=1e-12, msg=name)
        assert sketches[0][name].abs().sum() > 0


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
