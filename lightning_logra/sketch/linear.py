"""A linear layer whose weight gradient is only ever held as a d×r sketch S = G·Aᵀ.

For y = x Wᵀ + b with W (d×k), the dense weight gradient is G = δᵀx (d×k). Its sketch factors as
S = G Aᵀ = δᵀ (x Aᵀ), so the forward pass keeps z = x Aᵀ (n×r) instead of x (n×k), and backward contracts δ
with z. G is never formed. Matrices that read the same input may share A (`sketch/shared.py`): then z is computed
once for all of them and every member's backward reads the same saved tensor.

S is held as the `.grad` of a d×r parameter `sketch_param` (B, always zero): S is exactly ∂L/∂B at B = 0 for
W_eff = W + B A. Holding it there means autograd accumulates micro-batches into it, and zero_grad, gradient
clipping and DDP's all-reduce treat it like any other gradient — at d×r instead of d×k. B itself is a stride-0
view of one zero, so it costs 4 bytes, not d×r×4; being identically zero it is left out of state_dicts, which
therefore look exactly like the original model's (checkpoints and `save_pretrained` exports need no filtering).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_logra.base.hashing import matrix_seed
from lightning_logra.sketch.projection import make_projection, storage_dtype
from lightning_logra.sketch.shared import SharedInput


def _profiled(label: str):
    """A range named `label` in a torch.profiler trace (bench/memory.py --profile), nothing when none is recording."""
    return torch.profiler.record_function(label) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


@torch.no_grad()
def _project(x: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    # x (..., k), projection A (r, k) in x's dtype → z = x·Aᵀ (n, r): all the weight side needs from x. A constant
    # of the backward pass, not a node of the graph (x's gradient flows through the layer's output alone).
    with _profiled("sketch: project x·Aᵀ"):
        return x.detach().reshape(-1, x.shape[-1]) @ projection.T


def sketch_product(delta: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """δᵀz (d, r) in fp32 from δ (n, d) and z (n, r): every product of two entries exact and summed in fp32. The
    sketch is fp32 whatever the compute dtype: it accumulates many micro-batches and feeds an optimizer, so it must
    not round to bf16 on every addition.

    On a GPU, bf16/fp16 inputs are multiplied on the tensor cores with fp32 accumulation and output (`out_dtype`):
    the same sums as casting both to fp32 first, without the n×d fp32 copy of δ and without an fp32 product, which
    runs at a small fraction of the tensor cores' rate. Elsewhere (the CPU has no such kernel) both are cast."""
    with _profiled("sketch: contract δᵀz"):
        if delta.is_cuda and delta.dtype in (torch.bfloat16, torch.float16) and z.dtype == delta.dtype:
            return torch.mm(delta.T, z, out_dtype=torch.float32)
        return delta.T.float() @ z.float()


class _SketchedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, sketch_param, z):  # noqa: ARG004 (sketch_param: grad carrier)
        # x (..., k), weight (d, k), bias (d,) or None, z = x·Aᵀ (n, r), possibly shared with other layers
        y = nn.functional.linear(x, weight, bias)  # (..., d)
        ctx.save_for_backward(z, weight)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, grad_y):
        z, weight = ctx.saved_tensors
        grad_x = grad_bias = grad_sketch = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_y @ weight  # (..., k), as a dense layer would return
        delta = grad_y.reshape(-1, grad_y.shape[-1])  # (n, d)
        if ctx.needs_input_grad[3]:
            grad_sketch = sketch_product(delta, z)  # (d, r) fp32
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = delta.sum(0)  # (d,)
        # weight: no gradient ever (None), z: constant.
        return grad_x, None, grad_bias, grad_sketch, None


class SketchedLinear(nn.Linear):
    """A drop-in replacement for an `nn.Linear` that shares its weight and bias Parameters.

    It is also the *handle* `install_sketches` returns: `.weight` (W), `.projection()` (A), `.sketch` (S).
    """

    def __init__(
        self,
        linear: nn.Linear,
        name: str,
        rank: int,
        base_seed: int = 0,
        distribution: str = "rademacher",
        cache_projection: bool = True,
        shared: SharedInput | None = None,
    ) -> None:
        nn.Module.__init__(self)  # skip nn.Linear.__init__: it would allocate a fresh weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.weight.requires_grad_(False)  # sketched weights never get a .grad
        self.name = name
        # The layers that read this layer's input and share its A (None: a projection of its own).
        self.shared = shared
        self.rank = rank
        self.base_seed = base_seed
        self.distribution = distribution
        self.refresh_index = 0
        self.cache_projection = cache_projection
        # The rows of W this process merges updates into and keeps optimizer state for: all of them, or under FSDP
        # those of its shard (set by lightning_logra.train.strategies.fsdp; the sketch itself always covers all d rows).
        self.rows = slice(0, self.out_features)
        # B = 0 (d, r): never used numerically in the forward pass, only as the holder of S (fp32) in .grad.
        self.sketch_param = nn.Parameter(self._zero_carrier())
        # Not persistent: A is a pure function of the seed, so checkpoints carry the seed, not the matrix.
        self.register_buffer("cached_projection", None, persistent=False)
        if cache_projection:
            self.cached_projection = self._generate()

    def _zero_carrier(self) -> torch.Tensor:
        # One fp32 zero expanded to (d, r): autograd gives an expanded leaf a contiguous (d, r) fp32 .grad.
        zero = torch.zeros((), dtype=torch.float32, device=self.weight.device)
        return zero.expand(self.out_features, self.rank)

    def _apply(self, fn, recurse=True):
        # .to()/.half()/.cuda() would materialize B as d×r zeros and cast A; keep B a stride-0 fp32 zero and
        # regenerate A on the new device, in the dtype the new weights keep it in, instead.
        super()._apply(fn, recurse)
        self.sketch_param.data = self._zero_carrier()
        if self.cached_projection is not None:
            self.cached_projection = self._generate()
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # B ≡ 0 carries no information; leaving it out keeps checkpoints and exports in the original layout.
        sketch_param = self._parameters.pop("sketch_param")
        try:
            super()._save_to_state_dict(destination, prefix, keep_vars)
        finally:
            self._parameters["sketch_param"] = sketch_param

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        sketch_param = self._parameters.pop("sketch_param")
        try:
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        finally:
            self._parameters["sketch_param"] = sketch_param

    @property
    def projection_name(self) -> str:
        """What the projection's seed is named by: the layer, or the group of layers that share it."""
        return self.name if self.shared is None else self.shared.name

    @property
    def seed(self) -> int:
        """Seed of the current projection (changes when the projection is refreshed); shared within a group."""
        return matrix_seed(self.base_seed, self.projection_name, self.refresh_index)

    @property
    def own_seed(self) -> int:
        """This matrix's own seed, `seed` unless the projection is shared: keys its stochastic rounding, so that
        matrices sharing A do not also share rounding bits."""
        return matrix_seed(self.base_seed, self.name, self.refresh_index)

    def _generate(self) -> torch.Tensor:
        """A (r, k) as the cache keeps it: in the weight's bf16/fp16 when every entry is exact there (`storage_dtype`:
        half the bytes, and the forward pass multiplies by it without a cast), fp32 otherwise."""
        dtype = storage_dtype(self.rank, self.distribution, self.weight.dtype)
        if self.shared is not None:  # one A per group
            key = (self.seed, self.weight.device, dtype)
            return self.shared.projection(key, lambda: self._make_projection().to(dtype))
        return self._make_projection().to(dtype)

    def _make_projection(self) -> torch.Tensor:
        return make_projection(
            self.seed, self.rank, self.in_features, self.distribution, device=self.weight.device
        )  # (r, k) fp32

    def projection(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A (r, k) in `dtype` (its values are fp32's), on the weight's device: the cached tensor itself when it is
        kept in `dtype`."""
        a = self.cached_projection if self.cached_projection is not None else self._make_projection()
        return a.to(dtype)

    def set_refresh_index(self, index: int) -> None:
        """Switch to the projection of refresh `index` (the sketch must be empty: it was taken with the old A)."""
        self.refresh_index = index
        if self.cache_projection:
            self.cached_projection = self._generate()

    @property
    def sketch(self) -> torch.Tensor:
        """S (d, r) fp32, accumulated since the last zeroing (zeros if nothing was accumulated)."""
        if self.sketch_param.grad is None:
            return torch.zeros_like(self.sketch_param)
        return self.sketch_param.grad

    def sketch_rows(self) -> torch.Tensor:
        """S[rows] (rows, r) fp32: the part of the sketch this process updates its rows of W with; `sketch` itself
        when that is all of it (unsharded)."""
        if self.rows == slice(0, self.out_features):
            return self.sketch
        return self.sketch[self.rows]

    def local_weight(self) -> torch.Tensor:
        """W[rows] as a plain tensor to merge into in place: W itself, or under FSDP the local tensor of its sharded
        DTensor (a view of the storage FSDP all-gathers W from for the forward pass)."""
        return self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight

    def zero_sketch(self) -> None:
        self.sketch_param.grad = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and self.sketch_param.requires_grad):
            # Generation and KL evaluation need no sketch: skip the x·Aᵀ projection entirely.
            return nn.functional.linear(x, self.weight, self.bias)
        if self.shared is None:
            z = _project(x, self.projection(x.dtype))
        else:
            z = self.shared.project(self.name, x, lambda: _project(x, self.projection(x.dtype)))
        return _SketchedLinearFn.apply(x, self.weight, self.bias, self.sketch_param, z)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"rank={self.rank}, distribution={self.distribution}, refresh_index={self.refresh_index}"
            + ("" if self.shared is None else f", projection shared by {self.shared.name}")
        )
