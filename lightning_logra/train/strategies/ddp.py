"""Data parallel sketch training: every rank holds the whole model and draws the same projections; the d×r sketches
are summed over the ranks explicitly, once per optimizer step, and no d×k gradient exists anywhere.

There is no DDP wrapper: DDP syncs inside every backward pass, which would send each micro-batch's sketches (and hang
if ranks ran different numbers of micro-batches, as they do when zero-advantage samples are left out); one explicit
all-reduce per step sends the accumulated sketches once. The module normalizes its loss by the global batch's counts,
so the summed sketches equal a single process's on the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies import DDPStrategy

from lightning_logra.sketch.config import SketchConfig
from lightning_logra.sketch.install import sketch_carriers, sketched_layers
from lightning_logra.train.checkpoint import AtomicCheckpointIO
from lightning_logra.train.dense import DenseConfig
from lightning_logra.train.strategies.base import StrategyCollectives


class SketchDDPStrategy(StrategyCollectives, DDPStrategy):
    strategy_name = "logra_sketch_ddp"

    def __init__(self, sketch: SketchConfig = SketchConfig(), process_group_backend: str | None = None,
                 **kwargs) -> None:
        """
        Args:
            sketch: which matrices are sketched, at what rank, and the sketch optimizer (`SketchConfig`).
            process_group_backend: torch.distributed's backend (`gloo` on CPUs, `nccl` on GPUs); None picks it
                from the device.
        """
        super().__init__(process_group_backend=process_group_backend, checkpoint_io=AtomicCheckpointIO(), **kwargs)
        self.config = sketch
        self.last_allreduce_bytes = self.dense_allreduce_bytes = 0

    def configure_ddp(self) -> None:
        # Instead of wrapping in DDP: start every rank from rank 0's weights (the stride-0 sketch carriers B = 0
        # are the same everywhere and cannot be broadcast into).
        carriers = sketch_carriers(self.model)
        self.model._ddp_params_and_buffers_to_ignore = [
            name for name, p in self.model.named_parameters() if id(p) in carriers
        ]
        _sync_module_states(self.model)

    def sum_gradients(self, params: list[torch.Tensor]) -> None:
        """Sum the gradients of `params` over ranks in one collective: sketches (d×r) and any dense gradients."""
        if self.world_size == 1:
            return
        # Every rank has the same parameters, so a rank whose sketch stayed empty (no active sample) sends zeros.
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros(p.shape, dtype=torch.float32 if p.stride() == (0, 0) else p.dtype,
                                     device=p.device)
        grads = [p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(reduced.view_as(g))
        self.last_allreduce_bytes = flat.numel() * flat.element_size()
        # What DDP would send for the same parameters with dense fp32 gradients of the sketched weights.
        layer_of = {id(h.sketch_param): h for h in sketched_layers(self.lightning_module.policy).values()}
        self.dense_allreduce_bytes = sum(
            layer_of[id(p)].weight.numel() * 4 if id(p) in layer_of else p.grad.numel() * p.grad.element_size()
            for p in params
        )

    def reduction_metrics(self) -> dict[str, float]:
        return {"ddp/allreduce_bytes": float(self.last_allreduce_bytes),
                "ddp/dense_allreduce_bytes": float(self.dense_allreduce_bytes)}


class DenseDDPStrategy(DDPStrategy):
    """Data parallel dense training through Lightning's DDP wrapper (it averages the gradients inside every backward
    pass; `LightningCollectives` scales the loss so that the average is the global batch's sum), with the run's
    `DenseConfig`."""

    strategy_name = "dense_ddp"

    def __init__(self, dense: DenseConfig = DenseConfig(), process_group_backend: str | None = None, **kwargs) -> None:
        """
        Args:
            dense: what is trained and by which optimizer (`DenseConfig`).
            process_group_backend: torch.distributed's backend (`gloo` on CPUs, `nccl` on GPUs); None picks it
                from the device.
        """
        super().__init__(process_group_backend=process_group_backend, checkpoint_io=AtomicCheckpointIO(), **kwargs)
        self.config = dense
