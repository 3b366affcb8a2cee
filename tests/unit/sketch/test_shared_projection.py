"""sketch.share_projection: q/k/v (and gate/up) of a layer share one A; x·Aᵀ is computed and saved once per input.

Every sketch still equals the float64 dense reference G·Aᵀ with the shared A; the r-wide products and the saved
bytes are counted exactly; a member fed another tensor falls back to its own product (still exact) and says so;
rounding keys stay per matrix; a resume keeps the setting; the engine's stacked merge equals per-matrix merges."""

import copy
import logging
from functools import partial

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import SKETCH_TARGETS, make_tiny_qwen2
from lightning_logra.sketch import SketchAdam, SketchSGD, install_sketches, memory_breakdown
from lightning_logra.sketch import update as update_module
from lightning_logra.sketch.config import SketchConfig
from lightning_logra.sketch.memory import saved_activation_bytes
from lightning_logra.sketch.update import RowBlock, apply_low_rank_update_, apply_stacked_update_

RANK = 8  # below every in_features of the tiny Qwen2 (64, 128) and equal to no out_features
LAYERS = 2


def _ids(seed: int, shape=(3, 10)) -> torch.Tensor:
    return torch.randint(0, 97, shape, generator=torch.Generator().manual_seed(seed))


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    return (logits * torch.randn(logits.shape, generator=torch.Generator().manual_seed(7))).mean()


class CountProjections(TorchDispatchMode):
    """Counts the products x·Aᵀ: matrix products whose right operand is one of the given projections, transposed."""

    def __init__(self, projections) -> None:
        super().__init__()
        self.pointers = {a.untyped_storage().data_ptr() for a in projections}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            right = args[-1]
            self.count += right.untyped_storage().data_ptr() in self.pointers
        return func(*args, **(kwargs or {}))


def test_groups_share_one_projection_and_the_default_keeps_one_per_matrix():
    shared = install_sketches(make_tiny_qwen2(), SKETCH_TARGETS, RANK, share_projection=True)
    per_matrix = install_sketches(make_tiny_qwen2(), SKETCH_TARGETS, RANK)
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        qkv = [shared[f"{prefix}self_attn.{m}_proj"] for m in "qkv"]
        mlp = [shared[f"{prefix}mlp.{m}_proj"] for m in ("gate", "up")]
        for group in (qkv, mlp):
            assert len({h.seed for h in group}) == 1 and len({h.own_seed for h in group}) == len(group)
            assert all(h.projection() is group[0].projection() for h in group)  # one A in memory
        assert qkv[0].projection_name == f"{prefix}self_attn.q_proj+k_proj+v_proj"
        for alone in ("self_attn.o_proj", "mlp.down_proj"):
            assert shared[prefix + alone].shared is None
    seeds = [h.seed for h in shared.values()]
    assert len(set(seeds)) == LAYERS * 4  # qkv, gate/up, o, down per layer
    # the default: every matrix its own A, named by itself (the paper's setting, as before)
    assert all(h.shared is None and h.seed == h.own_seed for h in per_matrix.values())
    assert len({h.seed for h in per_matrix.values()}) == LAYERS * 7
    # one cached A per group: 4 per layer instead of 7
    r, h, m = RANK, 64, 128
    assert memory_breakdown(make_tiny_qwen2()).projections == 0
    model = make_tiny_qwen2()
    install_sketches(model, SKETCH_TARGETS, RANK, share_projection=True)
    assert memory_breakdown(model).projections == LAYERS * r * (3 * h + m) * 4


@pytest.mark.parametrize("refresh, checkpointing", [(False, False), (True, False), (False, True)],
                         ids=["fixed A", "refreshed A", "gradient checkpointing"])
def test_every_sketch_equals_the_float64_reference_with_the_shared_projection(refresh, checkpointing):
    dense, model = make_tiny_qwen2(), make_tiny_qwen2()
    handles = install_sketches(model, SKETCH_TARGETS, RANK, share_projection=True)
    if checkpointing:  # the layers' forward runs again in the backward pass: the groups must see it as new rounds
        model.train().gradient_checkpointing_enable()
    if refresh:  # a refreshed projection is shared by the group too
        optimizer = SketchSGD(handles, lr=1e-3, refresh_every=1)
        _loss(model, _ids(5)).backward()
        optimizer.step()
        dense.load_state_dict(model.state_dict())
        assert all(h.refresh_index == 1 for h in handles.values())
        assert len({handles[f"model.layers.0.self_attn.{m}_proj"].seed for m in "qkv"}) == 1
    for micro_batch in range(2):  # micro-batches accumulate into the same sketches
        _loss(model, _ids(micro_batch)).backward()
        _loss(dense, _ids(micro_batch)).backward()
    for name, handle in handles.items():
        gradient = dense.get_submodule(name).weight.grad.double()  # G (d, k)
        expected = gradient @ handle.projection().double().T  # S = G·Aᵀ with the group's A
        assert (handle.sketch.double() - expected).norm() <= 1e-6 * expected.norm(), name


def test_x_projection_is_computed_and_saved_once_per_group():
    counts, saved = {}, {}
    ids = _ids(0)
    for share in (False, True):
        model = make_tiny_qwen2()
        handles = install_sketches(model, SKETCH_TARGETS, RANK, share_projection=share)
        with CountProjections([h.projection() for h in handles.values()]) as counter:
            _loss(model, ids).backward()
        counts[share] = counter.count
        saved[share] = saved_activation_bytes(lambda model=model: _loss(model, ids), model.parameters())
    assert counts == {False: LAYERS * 7, True: LAYERS * 4}  # qkv once, gate/up once, o and down alone
    # Per layer, k and v no longer save their (n, r) fp32 z, nor does up: 3 tensors of n·r·4 bytes.
    n = ids.numel()
    assert saved[False] - saved[True] == LAYERS * 3 * n * RANK * 4


class TwoInputs(nn.Module):
    """q reads x; k and v read another tensor (cross-attention's shape): the name pattern does not hold here."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(16, 12) for _ in range(3))

    def forward(self, x, memory):
        return self.q_proj(x) + self.k_proj(memory) * self.v_proj(memory)


def test_a_member_fed_another_tensor_computes_its_own_product_and_says_so(caplog):
    torch.manual_seed(0)
    dense = TwoInputs()
    model = TwoInputs()
    model.load_state_dict(dense.state_dict())
    handles = install_sketches(model, ["q_proj", "k_proj", "v_proj"], 4, share_projection=True)
    group = handles["q_proj"].shared
    x, memory = torch.randn(5, 16), torch.randn(5, 16)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            model(x, memory).sum().backward()
            dense(x, memory).sum().backward()
    assert (group.computed, group.reused) == (4, 2)  # per call: q's and k's products, v reuses k's
    warnings = [r for r in caplog.records if "share_projection" in r.getMessage()]
    assert len(warnings) == 1 and "k_proj" in warnings[0].getMessage()  # once per group
    a = handles["q_proj"].projection().double()
    for name, handle in handles.items():  # still exact
        expected = dense.get_submodule(name).weight.grad.double() @ a.T
        torch.testing.assert_close(handle.sketch.double(), expected, rtol=1e-6, atol=1e-6)


def test_an_input_modified_in_place_is_projected_again():
    model = TwoInputs()
    handles = install_sketches(model, ["q_proj", "k_proj", "v_proj"], 4, share_projection=True)
    x = torch.randn(5, 16)
    z = handles["k_proj"].shared.project("q_proj", x, lambda: x @ handles["q_proj"].projection().T)
    x.add_(1.0)  # same object, new values: a stale z would be wrong
    again = handles["k_proj"].shared.project("k_proj", x, lambda: x @ handles["q_proj"].projection().T)
    assert not torch.equal(z, again)
    torch.testing.assert_close(again, x @ handles["q_proj"].projection().T)


def test_rounding_keys_stay_per_matrix_while_the_seed_is_shared():
    model = make_tiny_qwen2(dtype=torch.bfloat16)
    optimizer = SketchAdam(install_sketches(model, SKETCH_TARGETS, RANK, share_projection=True), lr=1e-4)
    _loss(model, _ids(0)).backward()
    optimizer.step()
    deltas = {name.split(".")[-2]: d for name, d in optimizer.last_updates.items() if ".layers.0." in name}
    assert deltas["q_proj"].seed == deltas["k_proj"].seed == deltas["v_proj"].seed != deltas["o_proj"].seed
    keys = [deltas[m].rounding_key for m in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")]
    assert None not in keys and len(set(keys)) == len(keys)


def _train(model, optimizer, steps):
    for step in steps:
        _loss(model, _ids(step)).backward()
        optimizer.step()


def test_a_resume_continues_exactly_and_refuses_the_other_setting():
    config = SketchConfig(SKETCH_TARGETS, RANK, optimizer=partial(SketchAdam, lr=1e-3, refresh_every=2),
                          share_projection=True)
    straight = make_tiny_qwen2()
    (optimizer,) = config.build_optimizers(straight, config.install(straight))
    _train(straight, optimizer, range(2))
    checkpoint = copy.deepcopy({"model": straight.state_dict(), "optimizer": optimizer.state_dict()})
    _train(straight, optimizer, range(2, 4))  # crosses a refresh after the checkpoint

    resumed = make_tiny_qwen2()
    (optimizer,) = config.build_optimizers(resumed, config.install(resumed))
    resumed.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    _train(resumed, optimizer, range(2, 4))
    for name, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name

    per_matrix = SketchConfig(SKETCH_TARGETS, RANK, optimizer=partial(SketchAdam, lr=1e-3, refresh_every=2))
    other = make_tiny_qwen2()
    (optimizer,) = per_matrix.build_optimizers(other, per_matrix.install(other))
    with pytest.raises(ValueError, match="sketch.share_projection: checkpoint true, this run false"):
        optimizer.load_state_dict(checkpoint["optimizer"])


def test_bad_settings_fail_naming_the_key():
    with pytest.raises(ValueError, match=r"trainer\.strategy\.init_args\.sketch\.share_projection must be true or"):
        SketchConfig(share_projection="yes")
    config = SketchConfig(["o_proj", "down_proj", "q_proj"], RANK, share_projection=True)
    with pytest.raises(ValueError, match=r"sketch\.share_projection is true, but no two of target_modules"):
        config.check_targets(make_tiny_qwen2())
    SketchConfig(["q_proj", "v_proj"], RANK, share_projection=True).check_targets(make_tiny_qwen2())  # two suffice


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_stacked_merge_equals_the_merges_of_its_blocks(dtype, monkeypatch):
    # The engine's [F_q; F_k; F_v]·A on a fused weight, against q, k and v merged one at a time.
    monkeypatch.setattr(update_module, "_CHUNK_ELEMENTS", 5 * 24)  # chunks of 5 rows: they straddle the blocks
    g = torch.Generator().manual_seed(0)
    sizes, k, r = (8, 4, 4), 24, 6
    fused = (torch.randn(sum(sizes), k, generator=g) * 0.05).to(dtype)
    factors = [torch.randn(d, r, generator=g) * 1e-3 for d in sizes]
    keys = [11, None, 13] if dtype == torch.bfloat16 else [None] * 3  # a block may round to nearest
    projection = torch.randn(r, k, generator=g)
    separate = fused.clone()
    start = 0
    for d, factor, key in zip(sizes, factors, keys):
        apply_low_rank_update_(separate[start : start + d, 8:], factor, projection[:, 8:], key, 2, 8)
        start += d
    stacked = fused.clone()
    blocks = [RowBlock(f, key, 2) for f, key in zip(factors, keys)]
    apply_stacked_update_(stacked[:, 8:], blocks, projection[:, 8:], 8)
    assert torch.equal(stacked, separate)
    assert not torch.equal(stacked, fused)
