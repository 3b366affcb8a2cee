import torch
from torch import nn

from conftest import SKETCH_TARGETS
from lightning_logra.sketch import SketchAdam, SketchSGD, install_sketches, memory_breakdown

MIB = 2**20


def test_4096_square_rank_64_sketch_is_1_mib_against_64_mib_dense():
    with torch.device("meta"):  # the accounting needs shapes only; no 64 MiB weight is allocated
        model = nn.Sequential(nn.Linear(4096, 4096, bias=False))
    handles = install_sketches(model, ["0"], rank=64, cache_projection=False)
    report = memory_breakdown(model, [SketchSGD(handles, lr=1.0)])
    assert report.sketches == 1 * MIB  # 4096 × 64 × 4 bytes
    assert report.dense_equivalent_gradients == 64 * MIB  # 4096 × 4096 × 4 bytes
    assert report.weights == 64 * MIB and report.projections == 0
    assert report.sketch_optimizer_state == 0 and report.dense_gradients == 0
    assert report.total == 65 * MIB


def test_categories_on_a_causal_lm(tiny_qwen2):
    for p in tiny_qwen2.parameters():
        p.requires_grad_(False)
    tiny_qwen2.model.norm.weight.requires_grad_(True)  # one dense trainable parameter (64 floats)
    handles = install_sketches(tiny_qwen2, SKETCH_TARGETS, rank=8)
    dense_opt = torch.optim.AdamW([tiny_qwen2.model.norm.weight], lr=1e-3)
    sketch_opt = SketchAdam(handles, lr=1e-3)
    ids = torch.randint(0, 97, (2, 8))
    tiny_qwen2(input_ids=ids, labels=ids).loss.backward()
    dense_opt.step()
    sketch_opt.step()
    report = memory_breakdown(tiny_qwen2, [dense_opt, sketch_opt])
    # per layer: d of q,k,v,o,gate,up,down = 64+32+32+64+128+128+64 = 512 rows; k = 64,64,64,64,64,64,128
    rows, layers, r = 512, 2, 8
    assert report.sketches == layers * rows * r * 4
    assert report.sketch_optimizer_state == 2 * report.sketches  # Adam: m and v
    assert report.projections == layers * r * (6 * 64 + 128) * 4
    assert report.dense_gradients == 64 * 4
    assert report.dense_optimizer_state == 2 * 64 * 4 + 4  # exp_avg, exp_avg_sq and a scalar step
    n_params = sum(p.numel() for p in tiny_qwen2.parameters() if p.stride() != (0, 0))
    assert report.weights == n_params * 4
