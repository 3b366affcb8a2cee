"""Low-precision merges: stochastic rounding is unbiased where rounding to nearest loses the update, its bits are a
pure function of (key, global row, global column), and every block of a matrix merges to what the whole would."""

import math

import pytest
import torch
from torch import nn

from lightning_logra.sketch import SketchAdam, SketchSGD, apply_low_rank_update_, install_sketches, make_projection
from lightning_logra.sketch.config import SketchConfig
from lightning_logra.sketch.rounding import rounding_bits, rounding_key
from lightning_logra.sketch.update import LowRankDelta

D, K, R = 48, 96, 8


def _qwen_like(dtype, seed=0):
    """W ~ N(0, 0.02²) as in Qwen checkpoints, and an update of about 1e-6 per entry (lr 1e-6, Adam-scaled U)."""
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(D, K, generator=g) * 0.02).to(dtype)
    factor = torch.randn(D, R, generator=g) * 1e-6  # F·A entries ~ 1e-6 · √R / √R
    return weight, factor, make_projection(seed + 1, R, K)


def _ulp(weight: torch.Tensor) -> torch.Tensor:
    """The larger of the gaps to each entry's two neighbours, in float64 (they differ at a power of two)."""
    up = torch.nextafter(weight, torch.full_like(weight, math.inf)).double() - weight.double()
    down = weight.double() - torch.nextafter(weight, torch.full_like(weight, -math.inf)).double()
    return torch.maximum(up, down)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_merge_is_unbiased_where_nearest_loses_the_update(dtype):
    weight, factor, a = _qwen_like(dtype)
    exact = weight.double() - factor.double() @ a.double()  # (D, K), the intended W − F·A
    gap = torch.maximum(_ulp(weight), _ulp(exact.to(dtype)))  # the spacing of representable values around exact
    draws = 400
    total = torch.zeros(D, K, dtype=torch.float64)
    for update in range(draws):
        w = weight.clone()
        apply_low_rank_update_(w, factor, a, rounding_key(1234, update))
        # every draw lands on one of the two neighbours of the exact value
        assert ((w.double() - exact).abs() <= gap * 1.01).all()
        total += w.double()
    mean = total / draws
    # each draw's error is bounded by the gap and has variance ≤ gap²/4: the mean's error per entry has a standard
    # deviation ≤ gap/(2·√draws); averaged over the D·K entries it is tiny.
    scale = gap / (2 * math.sqrt(draws))
    z = ((mean - exact) / scale).mean() * math.sqrt(D * K)
    assert abs(float(z)) < 5.0
    # the change that lands, projected on the intended change: 1 in expectation (stochastic) …
    intended = exact - weight.double()
    landed = float(((mean - weight.double()) * intended).sum() / (intended**2).sum())
    assert landed == pytest.approx(1.0, abs=0.1)
    # … and little when rounding to nearest (fp16 keeps 3 more bits than bf16, so it loses less)
    nearest = weight.clone()
    apply_low_rank_update_(nearest, factor, a)
    lost = float(((nearest.double() - weight.double()) * intended).sum() / (intended**2).sum())
    assert lost < (0.1 if dtype == torch.bfloat16 else 0.5)


def test_bits_are_a_function_of_the_element_alone():
    key = rounding_key(99, 3)
    whole = rounding_bits(key, range(0, 40), range(0, 70))
    assert whole.dtype == torch.int32 and int(whole.min()) >= 0 and int(whole.max()) < 2**16
    for rows, cols in ((range(5, 17), range(3, 70)), (range(0, 40), range(1, 2)), (range(39, 40), range(64, 70))):
        assert torch.equal(rounding_bits(key, rows, cols), whole[rows.start:rows.stop, cols.start:cols.stop])
    # about uniform, and another update or another matrix draws other bits
    assert abs(float(whole.double().mean()) / 2**16 - 0.5) < 0.02
    assert (rounding_bits(rounding_key(99, 4), range(40), range(70)) != whole).float().mean() > 0.99
    assert (rounding_bits(rounding_key(98, 3), range(40), range(70)) != whole).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_row_and_column_blocks_merge_bit_for_bit_like_the_whole_matrix(dtype):
    # A tensor-parallel shard or a fused q/k/v slice in the engine holds a block of rows or columns.
    weight, factor, _ = _qwen_like(dtype)
    delta = LowRankDelta(factor, seed=7, distribution="rademacher", in_features=K, rounding_key=rounding_key(7, 0))
    whole = weight.clone()
    delta.apply_(whole)
    assert not torch.equal(whole, weight)
    by_rows, by_cols = weight.clone(), weight.clone()
    for rows in (slice(0, 13), slice(13, 40), slice(40, D)):
        delta.apply_shard_(by_rows[rows], rows, slice(0, K))
    for cols in (slice(0, 5), slice(5, 50), slice(50, K)):
        delta.apply_shard_(by_cols[:, cols], slice(0, D), cols)
    assert torch.equal(by_rows, whole) and torch.equal(by_cols, whole)


def _sketched(dtype, rounding):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(K, D, bias=False)).to(dtype)
    with torch.no_grad():
        model[0].weight.copy_(torch.randn(D, K) * 0.02)
    handle = install_sketches(model, ["0"], rank=R, seed=0)["0"]
    # lr 1e-7 on these unit-scale inputs gives |F·A| ≈ 1e-6 per entry, the Qwen regime (|w| ≈ 0.02)
    return model, handle, SketchSGD({"0": handle}, lr=1e-7, rounding=rounding)


def _train(model, handle, optimizer, steps):
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, K, generator=g).to(handle.weight.dtype)
        model(x).backward(torch.randn(16, D, generator=g).to(handle.weight.dtype))
        optimizer.step()


def test_sketch_sgd_in_bf16_lands_its_updates_and_says_so():
    start = _sketched(torch.bfloat16, "stochastic")[1].weight.double().clone()
    results = {}
    for rounding in ("stochastic", "nearest"):
        model, handle, optimizer = _sketched(torch.bfloat16, rounding)
        intended = torch.zeros(D, K, dtype=torch.float64)
        fractions = []
        for _ in range(40):
            _train(model, handle, optimizer, 1)
            delta = optimizer.last_updates["0.weight"]
            intended -= delta.factor.double() @ delta.projection().double()
            fractions.append(optimizer.landed_fraction)
        change = handle.weight.double() - start
        results[rounding] = (float((change * intended).sum() / (intended**2).sum()), sum(fractions) / len(fractions))
    # over 40 steps the accumulated change projects onto the sum of the intended updates with ratio ~1 …
    assert results["stochastic"][0] == pytest.approx(1.0, abs=0.1)
    assert results["stochastic"][1] == pytest.approx(1.0, abs=0.25)  # the per-step estimate, on 1,024 entries
    # … and rounding to nearest loses nearly all of it, which the logged landed fraction shows
    assert results["nearest"][0] < 0.2 and results["nearest"][1] < 0.2


def test_nearest_rounding_warns_when_updates_do_not_land(caplog):
    model, handle, optimizer = _sketched(torch.bfloat16, "nearest")
    with caplog.at_level("WARNING"):
        _train(model, handle, optimizer, 25)
    assert "reached the weights" in caplog.text and "sketch.optimizer.rounding: stochastic" in caplog.text


def test_stochastic_rounding_is_a_no_op_for_fp32_weights():
    weights = []
    for rounding in ("stochastic", "nearest"):
        model, handle, optimizer = _sketched(torch.float32, rounding)
        _train(model, handle, optimizer, 3)
        assert optimizer.last_updates["0.weight"].rounding_key is None
        assert optimizer.landed_fraction == pytest.approx(1.0, abs=1e-2)
        weights.append(handle.weight.clone())
    assert torch.equal(*weights)


def test_update_counter_is_checkpointed_with_the_optimizer():
    model, handle, optimizer = _sketched(torch.bfloat16, "stochastic")
    _train(model, handle, optimizer, 3)
    state = optimizer.state_dict()
    assert state["updates"] == 3
    _, other_handle, other = _sketched(torch.bfloat16, "stochastic")
    other.load_state_dict(state)
    assert other.updates == 3


def test_factor_dtype_rounds_what_is_merged_and_sent():
    model, handle, optimizer = _sketched(torch.float32, "stochastic")
    optimizer = SketchAdam({"0": handle}, lr=1e-3, factor_dtype="bfloat16")
    before = handle.weight.double().clone()
    _train(model, handle, optimizer, 1)
    delta = optimizer.last_updates["0.weight"]
    assert delta.factor.dtype == torch.bfloat16
    expected = before - delta.factor.double() @ delta.projection().double()
    torch.testing.assert_close(handle.weight.double(), expected, rtol=0, atol=1e-7)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"rounding": "up"}, "rounding must be one of"),
    ({"factor_dtype": "float16"}, "factor_dtype must be one of"),
])
def test_bad_rounding_settings_name_the_key(kwargs, message):
    # (a config gets these refused when it is parsed: the constructor's Literal types; see test_cli)
    _, handle, _ = _sketched(torch.bfloat16, "stochastic")
    with pytest.raises(ValueError, match=message):
        SketchAdam({"0": handle}, **kwargs)


def test_dense_parameters_in_bf16_are_refused_with_the_fix():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(K, D), nn.Linear(D, D)).to(torch.bfloat16)
    config = SketchConfig(target_modules=["0"], rank=R, train_rest=True)
    handles = config.install(model)
    with pytest.raises(ValueError, match="sketch.train_rest.*bf16-mixed"):
        config.build_optimizers(model, handles)


@pytest.mark.parametrize("dtype, largest", [(torch.float32, 3.4e38), (torch.bfloat16, 3.38e38),
                                            (torch.float16, 65504.0)])
def test_a_merge_is_known_to_stay_finite_before_it_is_made(dtype, largest):
    # A finite factor of 3e38 was merged and left Inf in the weights. `merge_stays_finite` works the merge out
    # without writing: false where the result would pass the dtype's largest number, true for everything sane (and
    # near the limit, where the bound gives way to the exact merge).
    from lightning_logra.sketch.update import merge_stays_finite

    weight, factor, projection = _qwen_like(dtype)
    before = weight.clone()
    assert merge_stays_finite(weight, factor, projection)
    assert not merge_stays_finite(weight, torch.full_like(factor, largest), projection)
    assert torch.equal(weight, before)
    near = torch.zeros(D, K, dtype=dtype)
    near[0, 0] = torch.finfo(dtype).max * 0.75  # the bound is past half the limit: worked out, and it fits
    assert merge_stays_finite(near, factor, projection)
    near[1, 1] = math.nan  # a NaN already there is the weight's, not the merge's
    assert merge_stays_finite(near, factor, projection)
