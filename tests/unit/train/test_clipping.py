"""max_grad_norm clips the sketches and the dense gradients together (`modes.clip_gradients`): their total norm ends at
most the limit, the norm returned is the one before, a norm that is not finite clips nothing, and None clips nothing.
That the optimizers then receive at most max_grad_norm through the command line is checked in test_cli.py."""

import logging

import pytest
import torch

from conftest import SKETCH_TARGETS, make_tiny_qwen2
from lightning_logra.sketch import install_sketches
from lightning_logra.train.modes import clip_gradients
from lightning_logra.train.strategies.base import Collectives


def _params_after_backward() -> list[torch.nn.Parameter]:
    """The sketch carriers of a tiny sketched Qwen2 and one dense parameter (the final norm), with the gradients of
    one backward pass: the sketches are the carriers' .grad."""
    model = make_tiny_qwen2()
    model.requires_grad_(False)
    handles = install_sketches(model, SKETCH_TARGETS, rank=8)
    dense = model.model.norm.weight
    dense.requires_grad_(True)
    ids = torch.randint(0, 97, (3, 10), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids).logits.pow(2).sum().backward()
    params = [handle.sketch_param for handle in handles.values()] + [dense]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    return params


def _grads(params) -> list[torch.Tensor]:
    return [p.grad.clone() for p in params]


def _total_norm(grads) -> float:
    return float(torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in grads])))


def test_the_sketches_and_the_dense_gradients_together_end_at_most_the_limit():
    params = _params_after_backward()
    before = _grads(params)
    limit = 1e-3
    norm = clip_gradients(params, limit, Collectives())
    # the norm before clipping, of the sketches and the dense gradient together: far above the limit
    assert float(norm) == pytest.approx(_total_norm(before), rel=1e-5)
    assert float(norm) > 1000 * limit
    after = _grads(params)
    assert _total_norm(after) <= limit * (1 + 1e-4)
    assert _total_norm(after[:-1]) > 0 and _total_norm(after[-1:]) > 0  # neither part was left out or zeroed
    scale = after[-1].double().norm() / before[-1].double().norm()  # one factor for every gradient, sketches included
    for old, new in zip(before, after):
        torch.testing.assert_close(new.double(), scale * old.double(), rtol=1e-5, atol=0)


def test_a_norm_that_is_not_finite_clips_nothing(caplog):
    params = _params_after_backward()
    params[0].grad[0, 0] = float("nan")  # one entry of the first sketch
    before = _grads(params)
    with caplog.at_level(logging.WARNING, logger="lightning_logra.train.modes"):
        norm = clip_gradients(params, 1e-3, Collectives())
    assert not torch.isfinite(norm)
    assert "non-finite gradient norm: the whole update is skipped" in caplog.text
    after = _grads(params)
    assert torch.isnan(after[0][0, 0])
    for old, new in zip(before, after):
        assert torch.equal(old.nan_to_num(), new.nan_to_num())  # nothing scaled (NaN compared as NaN)


def test_no_limit_leaves_the_gradients_and_returns_their_norm():
    params = _params_after_backward()
    before = _grads(params)
    norm = clip_gradients(params, None, Collectives())
    assert float(norm) == pytest.approx(_total_norm(before), rel=1e-5) and float(norm) > 1.0
    for old, new in zip(before, _grads(params)):
        assert torch.equal(old, new)
