import pytest
import torch
from torch import nn

from lightning_logra.sketch import install_sketches, make_projection, memory_breakdown


def _sketched(d=12, k=20, r=5, bias=True, dtype=torch.float32, seed=0, train_bias=False):
    torch.manual_seed(seed)
    dense = nn.Linear(k, d, bias=bias).to(dtype)
    model = nn.Sequential(nn.Linear(k, d, bias=bias).to(dtype))
    model[0].load_state_dict(dense.state_dict())
    handle = install_sketches(model, ["0"], rank=r, seed=seed, train_bias=train_bias)["0"]
    return dense, model, handle


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7,), (3, 5)], ids=["2d", "3d"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("r", [8, 16])  # in bf16: A kept in fp32 (1/√8 is not exact there) and in bf16 (1/4 is)
def test_sketch_equals_dense_gradient_times_projection(dtype, shape, bias, r):
    d, k = 12, 20
    dense, model, handle = _sketched(d, k, r, bias, dtype)
    expected = torch.zeros(d, r, dtype=torch.float64)
    for _ in range(3):  # micro-batches accumulate into the same sketch
        x = torch.randn(*shape, k, dtype=dtype, requires_grad=True)
        x_dense = x.detach().clone().requires_grad_(True)
        grad_y = torch.randn(*shape, d, dtype=dtype)
        model(x).backward(grad_y)
        dense(x_dense).backward(grad_y)
        # float64 reference: G = δᵀx (d×k), S = G Aᵀ
        g = grad_y.reshape(-1, d).double().T @ x.detach().reshape(-1, k).double()
        expected += g @ handle.projection().double().T
        # the input gradient is the dense layer's, exactly as computed by the same kernel
        torch.testing.assert_close(x.grad, x_dense.grad, rtol=0, atol=0)
    assert handle.sketch.dtype == torch.float32 and handle.sketch.shape == (d, r)
    rel = (handle.sketch.double() - expected).norm() / expected.norm()
    # fp32: rounding only; bf16: x·Aᵀ is rounded to bf16 (2⁻⁹ relative per entry), the contraction is fp32
    assert rel < (1e-6 if dtype == torch.float32 else 1e-2)
    assert handle.weight.grad is None and model[0].weight.grad is None
    if bias:
        assert model[0].bias.grad is None  # frozen by default


def test_bias_can_be_trained_densely():
    dense, model, handle = _sketched(train_bias=True)
    x, grad_y = torch.randn(9, 20), torch.randn(9, 12)
    model(x).backward(grad_y)
    dense(x).backward(grad_y)
    torch.testing.assert_close(model[0].bias.grad, dense.bias.grad)
    assert model[0].weight.grad is None


def test_first_layer_input_without_grad_still_reaches_the_sketch():
    _, model, handle = _sketched()
    x = torch.randn(4, 20)  # e.g. frozen embeddings: no requires_grad anywhere upstream
    assert not x.requires_grad
    model(x).sum().backward()
    expected = torch.ones(4, 12).double().T @ x.double() @ handle.projection().double().T
    torch.testing.assert_close(handle.sketch.double(), expected, rtol=1e-6, atol=1e-6)


def _saved_bytes(module, x):
    params = {p.data_ptr() for p in module.parameters()}
    saved = []

    def pack(t):
        # Parameters are referenced, not copied: only activations cost memory.
        if t.data_ptr() not in params:
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x).sum()
    return sum(saved)


def test_forward_keeps_projected_input_not_input():
    k, d, r, n = 256, 128, 16, 64
    dense, model, _ = _sketched(d, k, r, bias=False)
    dense.weight.requires_grad_(True)
    x = torch.randn(n, k)
    dense_bytes = _saved_bytes(dense, x)  # x: n×k fp32
    sketched_bytes = _saved_bytes(model, x)  # z = x·Aᵀ: n×r fp32
    assert dense_bytes == n * k * 4
    assert sketched_bytes == n * r * 4
    assert sketched_bytes / dense_bytes == pytest.approx(r / k)


def test_no_sketch_work_without_grad_mode():
    _, model, handle = _sketched()
    with torch.no_grad():
        y = model(torch.randn(3, 20))
    assert not y.requires_grad and handle.sketch_param.grad is None


def test_state_dict_keeps_original_layout_and_dtype_moves_keep_sketch_fp32():
    dense, model, handle = _sketched()
    assert list(model.state_dict()) == ["0.weight", "0.bias"]
    model.load_state_dict({"0.weight": dense.weight.detach() * 2, "0.bias": dense.bias.detach()})
    torch.testing.assert_close(model[0].weight, dense.weight * 2)
    a = handle.projection().clone()
    model.to(torch.bfloat16)
    assert handle.weight.dtype == torch.bfloat16
    assert handle.sketch_param.stride() == (0, 0) and handle.sketch_param.dtype == torch.float32
    assert torch.equal(handle.projection(), a) and handle.projection().dtype == torch.float32
    model(torch.randn(2, 20, dtype=torch.bfloat16)).sum().backward()
    assert handle.sketch.dtype == torch.float32


def test_a_bf16_layer_keeps_a_in_bf16_where_it_is_exact_and_its_sketch_is_unchanged():
    # Rank 16: entries ±1/4, exact in bf16, so the layer keeps A there (half the bytes, no cast per forward pass);
    # the projection it hands out is fp32's, and the sketch is bit for bit the one an fp32-kept A gives.
    _, model, handle = _sketched(r=16, dtype=torch.bfloat16)
    assert handle.cached_projection.dtype == torch.bfloat16
    fp32 = make_projection(handle.seed, 16, 20)
    assert handle.projection().dtype == torch.float32 and torch.equal(handle.projection(), fp32)
    assert handle.projection(torch.bfloat16) is handle.cached_projection  # the forward pass's: no copy
    assert memory_breakdown(model).projections == 16 * 20 * 2
    x, grad_y = torch.randn(6, 20, dtype=torch.bfloat16), torch.randn(6, 12, dtype=torch.bfloat16)
    model(x).backward(grad_y)
    z = x @ fp32.to(torch.bfloat16).T  # what the layer computed when it kept A in fp32 and cast it every call
    assert torch.equal(handle.sketch, grad_y.float().T @ z.float())
    # Moved to fp32 weights, the layer keeps A in fp32 again; at rank 8 (1/√8 inexact in bf16) it always did.
    model.float()
    assert handle.cached_projection.dtype == torch.float32 and torch.equal(handle.projection(), fp32)
    assert _sketched(r=8, dtype=torch.bfloat16)[2].cached_projection.dtype == torch.float32


def _sketch_product_error(device: str, dtype: torch.dtype) -> float:
    """sketch_product's relative error against δᵀz in float64 from the same bf16/fp16 numbers (n = 4096 tokens)."""
    from lightning_logra.sketch.linear import sketch_product

    torch.manual_seed(0)
    delta = torch.randn(4096, 96, device=device).to(dtype)  # (n, d)
    z = torch.randn(4096, 16, device=device).to(dtype)  # (n, r)
    out = sketch_product(delta, z)
    expected = delta.double().T @ z.double()  # each product of two 8-bit significands is exact in fp32
    assert out.dtype == torch.float32 and out.shape == (96, 16)
    return float((out.double() - expected).norm() / expected.norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_sketch_contraction_sums_exact_products_in_fp32(dtype):
    assert _sketch_product_error("cpu", dtype) < 1e-6  # fp32 accumulation alone, not bf16's 2⁻⁹


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the tensor-core path (torch.mm out_dtype) is CUDA's")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_cuda_sketch_contraction_multiplies_low_precision_with_fp32_accumulation(dtype):
    assert _sketch_product_error("cuda", dtype) < 1e-6
