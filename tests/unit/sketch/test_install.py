import copy
import math

import pytest
import torch
from torch import nn

from conftest import SKETCH_TARGETS, make_tiny_qwen2
from lightning_logra.sketch import SketchedLinear, SketchSGD, install_sketches, sketched_layers


def test_installs_on_all_projection_matrices_of_a_causal_lm(tiny_qwen2):
    handles = install_sketches(tiny_qwen2, SKETCH_TARGETS, rank=8, seed=1)
    assert len(handles) == 7 * tiny_qwen2.config.num_hidden_layers
    assert list(handles) == list(sketched_layers(tiny_qwen2))
    for name, handle in handles.items():
        assert isinstance(handle, SketchedLinear) and tiny_qwen2.get_submodule(name) is handle
        assert handle.projection().shape == (8, handle.in_features)
        assert not handle.weight.requires_grad
    # the model's state_dict is unchanged in names, so transformers checkpoints load into it and out of it
    assert set(tiny_qwen2.state_dict()) == set(make_tiny_qwen2().state_dict())


def test_one_update_changes_exactly_the_sketched_weights(tiny_qwen2):
    for p in tiny_qwen2.parameters():
        p.requires_grad_(False)  # non-target parameters frozen, as the trainer does by default
    handles = install_sketches(tiny_qwen2, SKETCH_TARGETS, rank=8)
    before = {n: p.detach().clone() for n, p in tiny_qwen2.named_parameters()}
    ids = torch.randint(0, 97, (2, 10))
    tiny_qwen2(input_ids=ids, labels=ids).loss.backward()
    SketchSGD(handles, lr=0.1).step()
    sketched = {f"{name}.weight" for name in handles}
    for name, param in tiny_qwen2.named_parameters():
        if name in sketched:
            assert not torch.equal(param, before[name]), name
        elif name in before:
            assert torch.equal(param, before[name]), name


def test_reconstruction_cosine_follows_sqrt_r_over_r_plus_k():
    # cos(G, S·A) with S = G·Aᵀ: <G, GAᵀA> = ‖GAᵀ‖² ≈ ‖G‖² and ‖GAᵀA‖² ≈ ‖G‖²·(r+k)/r for a random A, so the
    # cosine is about √(r/(r+k)) whatever the gradient's direction.
    rank = 8
    dense = make_tiny_qwen2(seed=3)
    sketched = copy.deepcopy(dense)
    handles = install_sketches(sketched, SKETCH_TARGETS, rank=rank, seed=5)
    ids = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(0))
    dense(input_ids=ids, labels=ids).loss.backward()
    sketched(input_ids=ids, labels=ids).loss.backward()
    ratios = []
    for name, handle in handles.items():
        g = dense.get_submodule(name).weight.grad.double()  # (d, k)
        approx = handle.sketch.double() @ handle.projection().double()  # (d, k) = S·A
        cosine = torch.nn.functional.cosine_similarity(g.flatten(), approx.flatten(), dim=0).item()
        ratios.append(cosine / math.sqrt(rank / (rank + handle.in_features)))
    assert sum(ratios) / len(ratios) == pytest.approx(1.0, abs=0.15)


def test_clear_errors_for_bad_targets(tiny_qwen2):
    with pytest.raises(ValueError, match=r"'qproj' matches no module.*q_proj"):
        install_sketches(tiny_qwen2, ["qproj"], rank=4)
    with pytest.raises(TypeError, match="not an nn.Linear"):
        install_sketches(tiny_qwen2, ["mlp"], rank=4)
    with pytest.raises(ValueError, match=r"rank: 64 must be smaller than in_features=64 of .*q_proj.*r < k"):
        install_sketches(tiny_qwen2, ["q_proj"], rank=64)
    with pytest.raises(ValueError, match="shared by"):
        install_sketches(tiny_qwen2, ["lm_head"], rank=4)
    with pytest.raises(ValueError, match="distribution"):
        install_sketches(tiny_qwen2, ["q_proj"], rank=4, distribution="sparse")
    install_sketches(tiny_qwen2, ["q_proj"], rank=4)
    with pytest.raises(ValueError, match="already sketched"):
        install_sketches(tiny_qwen2, ["q_proj"], rank=4)


def test_projection_can_be_regenerated_instead_of_cached():
    torch.manual_seed(0)
    cached = nn.Sequential(nn.Linear(32, 16))
    fresh = copy.deepcopy(cached)
    a = install_sketches(cached, ["0"], rank=4, seed=9)["0"]
    b = install_sketches(fresh, ["0"], rank=4, seed=9, cache_projection=False)["0"]
    assert b.cached_projection is None and torch.equal(a.projection(), b.projection())
    x = torch.randn(5, 32)
    cached(x).sum().backward()
    fresh(x).sum().backward()
    assert torch.equal(a.sketch, b.sketch)
