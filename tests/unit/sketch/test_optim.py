import logging
import math

import pytest
import torch
from torch import nn

import lightning_logra.sketch.update as update_module
from lightning_logra.sketch import (
    SketchAdam,
    SketchSGD,
    apply_low_rank_update_,
    install_sketches,
    make_projection,
    matrix_seed,
)

D, K, R = 6, 10, 3


def _layer(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(K, D, bias=False))
    handle = install_sketches(model, ["0"], rank=R, seed=seed)["0"]
    return model, handle


def _accumulate(model, step):
    """Backward one micro-batch; return its float64 sketch δᵀ·x·Aᵀ computed densely."""
    g = torch.Generator().manual_seed(100 + step)
    x, grad_y = torch.randn(4, K, generator=g), torch.randn(4, D, generator=g)
    model(x).backward(grad_y)
    return grad_y.double().T @ x.double() @ model[0].projection().double().T  # (D, R)


def _run(optimizer_cls, steps=3, **kwargs):
    model, handle = _layer()
    w = handle.weight.detach().double().clone()
    optimizer = optimizer_cls({"0": handle}, **kwargs)
    sketches = []
    for step in range(steps):
        sketches.append(_accumulate(model, step))
        optimizer.step()
    return w, handle, sketches


def test_sgd_matches_float64_reference():
    w, handle, sketches = _run(SketchSGD, lr=0.05)
    a = handle.projection().double()
    for s in sketches:
        w -= 0.05 * s @ a  # W ← W − η·S·A
    torch.testing.assert_close(handle.weight.double(), w, rtol=0, atol=1e-6)


def test_momentum_matches_float64_reference():
    w, handle, sketches = _run(SketchSGD, lr=0.05, momentum=0.9)
    a, m = handle.projection().double(), torch.zeros(D, R, dtype=torch.float64)
    for s in sketches:
        m = 0.9 * m + s  # heavy ball, dampening 0
        w -= 0.05 * m @ a
    torch.testing.assert_close(handle.weight.double(), w, rtol=0, atol=1e-6)


def test_adam_matches_float64_reference():
    w, handle, sketches = _run(SketchAdam, lr=0.01, betas=(0.8, 0.9), eps=1e-6)
    a = handle.projection().double()
    m = v = torch.zeros(D, R, dtype=torch.float64)
    for t, s in enumerate(sketches, start=1):
        m = 0.8 * m + 0.2 * s
        v = 0.9 * v + 0.1 * s * s
        u = (m / (1 - 0.8**t)) / ((v / (1 - 0.9**t)).sqrt() + 1e-6)
        w -= 0.01 * u @ a
    torch.testing.assert_close(handle.weight.double(), w, rtol=0, atol=1e-6)


def test_propose_then_apply_with_alpha_returns_the_merged_factor():
    model, handle = _layer()
    optimizer = SketchSGD([handle], lr=0.5)
    s = _accumulate(model, 0)
    w = handle.weight.detach().double().clone()
    assert optimizer.propose()
    proposal, = optimizer.proposal().values()  # F = η·U at α = 1
    torch.testing.assert_close(proposal.factor.double(), 0.5 * s, rtol=1e-6, atol=1e-6)
    a = handle.projection()
    assert proposal.seed == handle.seed and torch.equal(proposal.projection(), a)
    merged = optimizer.apply(alpha=0.25)["0.weight"]
    torch.testing.assert_close(merged.factor.double(), 0.25 * 0.5 * s, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(handle.weight.double(), w - merged.factor.double() @ a.double(), rtol=0, atol=1e-6)
    assert handle.sketch_param.grad is None  # zeroed for the next accumulation
    with pytest.raises(RuntimeError, match="propose"):
        optimizer.apply()


def test_non_finite_sketch_skips_the_whole_step(caplog):
    model = nn.Sequential(nn.Linear(K, D), nn.Linear(D, D))
    handles = install_sketches(model, ["0", "1"], rank=R)
    optimizer = SketchAdam(handles, lr=0.1)
    model(torch.randn(2, K)).sum().backward()
    optimizer.step()  # one good step so that there is state to protect
    weights = [h.weight.detach().clone() for h in handles.values()]
    state = {k: v.clone() for k, v in optimizer.state[handles["0"].sketch_param].items() if torch.is_tensor(v)}
    x = torch.randn(2, K)
    grad_y = torch.randn(2, D)
    grad_y[0, 0] = float("nan")  # poisons only layer "1"'s sketch (its input is detached from layer "0")
    with caplog.at_level(logging.WARNING):
        torch.autograd.backward([model[0](x), model[1](torch.randn(2, D))], [torch.ones(2, D), grad_y])
        assert torch.isfinite(handles["0"].sketch).all() and not torch.isfinite(handles["1"].sketch).all()
        optimizer.step()
    assert optimizer.skipped_steps == 1 and "['1']" in caplog.text
    for h, w in zip(handles.values(), weights):
        assert torch.equal(h.weight, w)  # neither layer moved, not even the finite one
        assert h.sketch_param.grad is None
    for k, v in state.items():
        assert torch.equal(optimizer.state[handles["0"].sketch_param][k], v)
    model(x).sum().backward()
    optimizer.step()  # and training goes on
    assert not torch.equal(handles["0"].weight, weights[0])


@pytest.mark.parametrize("alpha", [math.nan, math.inf, -1.0, 1e40])
def test_a_non_finite_step_never_reaches_the_weights(alpha, caplog):
    # Whatever chose α (a controller's bug, a setting that slipped through), apply() is the last line of defence:
    # 1e40 is finite but overflows α·η·U in fp32.
    model, handle = _layer()
    optimizer = SketchAdam({"0": handle}, lr=0.1)
    before = handle.weight.detach().clone()
    _accumulate(model, 0)
    with caplog.at_level(logging.WARNING):
        optimizer.step(alpha=alpha)
    assert torch.equal(handle.weight, before) and optimizer.last_updates == {}
    assert optimizer.skipped_steps == 1 and optimizer.updates == 0 and "update skipped" in caplog.text
    assert handle.sketch_param.grad is None  # the step's sketch is dropped with it


def test_refresh_switches_seed_and_resets_state():
    model, handle = _layer()
    optimizer = SketchAdam([handle], lr=0.01, refresh_every=2)
    a0 = handle.projection().clone()
    for step in range(2):
        _accumulate(model, step)
        optimizer.step()
    state = optimizer.state[handle.sketch_param]
    assert handle.refresh_index == 1 and state == {"step": 0, "refresh_index": 1}
    assert torch.equal(handle.projection(), make_projection(matrix_seed(0, "0", 1), R, K))
    assert not torch.equal(handle.projection(), a0)
    # the next step is a fresh Adam's first step in the new coordinates: U = S/(|S| + ε) = sign(S) (up to ε)
    w = handle.weight.detach().double().clone()
    s = _accumulate(model, 2)
    optimizer.step()
    expected = w - 0.01 * (s / (s.abs() + 1e-8)) @ handle.projection().double()
    torch.testing.assert_close(handle.weight.double(), expected, rtol=0, atol=1e-6)

    # a checkpointed optimizer puts a freshly built layer on the same projection
    model2, handle2 = _layer()
    optimizer2 = SketchAdam([handle2], lr=0.01, refresh_every=2)
    optimizer2.load_state_dict(optimizer.state_dict())
    assert handle2.refresh_index == 1 and torch.equal(handle2.projection(), handle.projection())


@pytest.mark.parametrize("chunk", [10**9, 7 * K])  # one block; blocks of 7 rows
def test_low_precision_merge_rounds_once(monkeypatch, chunk):
    monkeypatch.setattr(update_module, "_CHUNK_ELEMENTS", chunk)
    torch.manual_seed(0)
    w = torch.randn(20, K).to(torch.bfloat16)
    factor, a = torch.randn(20, R) * 1e-2, make_projection(3, R, K)
    expected = (w.double() - factor.double() @ a.double()).to(torch.bfloat16)  # exact, then one rounding
    apply_low_rank_update_(w, factor, a)
    # fp32 accumulation can land on the other side of a rounding boundary: at most one bf16 step apart
    ulp = expected.double().abs() * 2**-7
    assert ((w.double() - expected.double()).abs() <= ulp).all()
    assert (w == expected).float().mean() > 0.95


def test_rejects_bad_settings():
    _, handle = _layer()
    with pytest.raises(ValueError, match="no sketched layers"):
        SketchSGD([], lr=0.1)
    with pytest.raises(ValueError, match="lr"):
        SketchSGD([handle], lr=0.0)
    with pytest.raises(ValueError, match="refresh_every"):
        SketchAdam([handle], lr=0.1, refresh_every=0)
    with pytest.raises(ValueError, match="momentum"):
        SketchSGD([handle], lr=0.1, momentum=1.0)
