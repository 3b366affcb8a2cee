"""Lightning wiring for sketch training: strategies that install the sketches when the Trainer sets up (one
device, or DDP over processes). All the math is in `lightning_logra.sketch`; Fabric users have `lightning_logra.fabric`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import nn

from lightning_logra.checkpoint import AtomicCheckpointIO
from lightning_logra.sketch.config import SketchConfig
from lightning_logra.sketch.install import sketch_carriers, sketched_layers
from lightning_logra.sketch.linear import SketchedLinear
from lightning_logra.sketch.update import LowRankDelta


class SketchTraining:
    """What both strategies share, and what the module relies on: install the sketches into the module's `policy`
    at fit set-up, build the sketch optimizer (plus AdamW for non-target parameters if `sketch.train_rest`) and
    their `sketch.lr_schedule` instead of the module's `configure_optimizers` (its dense baseline), and
    `sum_gradients` once per step."""

    config: SketchConfig
    handles: dict[str, SketchedLinear]
    # Whether each rank holds only shards of the weights. Then every forward pass all-gathers weights, a collective,
    # so every rank runs every micro-batch; and a rollout engine with weights of its own cannot follow them yet (its
    # full loads and the dense values of train_rest would need gathering first).
    shards_weights: bool = False

    @property
    def policy(self) -> nn.Module:
        return self.lightning_module.policy

    def _install(self, trainer: Trainer) -> None:
        # configure_model (which loads the policy) has run by now; the optimizers are built inside setup().
        if trainer.state.fn == TrainerFn.FITTING:
            self.handles = sketched_layers(self.policy) or self.config.install(self.policy)

    def setup_optimizers(self, trainer: Trainer) -> None:
        self.optimizers = self.config.build_optimizers(self.policy, self.handles)
        # Lightning checkpoints and restores these; under manual optimization the module steps them.
        self.lr_scheduler_configs = [LRSchedulerConfig(s) for s in self.config.build_schedulers(self.optimizers)]

    def sum_gradients(self, params: list[torch.Tensor]) -> None:
        """Sum the gradients of `params` over the ranks, once per step before clipping (one process: nothing)."""

    def gradient_sum_metrics(self) -> dict[str, float]:
        """What the last `sum_gradients` sent, for the logs (one process: nothing)."""
        return {}

    def gradient_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The total norm of the gradients of `params` as the optimizers will use them (after `sum_gradients`)."""
        return torch.nn.utils.get_total_norm([p.grad for p in params])

    def whole_factors(self, low_rank: dict[str, LowRankDelta]) -> dict[str, LowRankDelta]:
        """Low-rank deltas with all d rows of F (a sharded strategy gathers them; here they are whole already)."""
        return low_rank

    def whole_policy_state(self) -> dict[str, torch.Tensor] | None:
        """The policy's whole state dict for an export, gathered on rank 0 where the weights are sharded; None where
        every rank holds them whole (rank 0 saves its own). Every rank calls it."""
        return None


class SketchStrategy(SketchTraining, SingleDeviceStrategy):
    """Single-device training of the module's `policy` with LoGRA sketches. Checkpoints are written atomically."""

    strategy_name = "logra_sketch"

    def __init__(self, sketch: SketchConfig = SketchConfig(), device: str | None = None) -> None:
        """
        Args:
            sketch: which matrices are sketched, at what rank, and the sketch optimizer (`SketchConfig`).
            device: the device to train on, e.g. `cuda:1`; None takes the Trainer's (`trainer.accelerator` and
                `trainer.devices`).
        """
        super().__init__(checkpoint_io=AtomicCheckpointIO())
        # As in Lightning's parallel strategies: the Trainer's accelerator connector fills an empty `parallel_devices`
        # with the devices that `accelerator` and `devices` select, and one given here makes it check the accelerator
        # against it instead.
        self.parallel_devices = None if device is None else [torch.device(device)]
        self.config = sketch
        self.handles = {}

    @property
    def root_device(self) -> torch.device:
        # Before a Trainer has set it, the CPU: SingleDeviceStrategy's default.
        return self.parallel_devices[0] if self.parallel_devices else self._root_device

    def setup(self, trainer: Trainer) -> None:
        self._install(trainer)
        super().setup(trainer)


class SketchDDPStrategy(SketchTraining, DDPStrategy):
    """Data parallel sketch training: every rank holds the whole model and draws the same projections; the d×r
    sketches are summed over ranks explicitly, once per optimizer step, and no d×k gradient exists anywhere.

    There is no DDP wrapper: DDP syncs inside every backward pass, which would send each micro-batch's sketches
    (and hang if ranks ran different numbers of micro-batches, as they do when zero-advantage samples are left
    out); one explicit all-reduce per step sends the accumulated sketches once. The module normalizes its loss by
    the global batch's counts, so the summed sketches equal a single process's on the whole batch.
    """

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
        self.handles = {}
        self.last_allreduce_bytes = self.dense_allreduce_bytes = 0

    def setup(self, trainer: Trainer) -> None:
        self._install(trainer)
        super().setup(trainer)

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
        layer_of = {id(h.sketch_param): h for h in self.handles.values()}
        self.dense_allreduce_bytes = sum(
            layer_of[id(p)].weight.numel() * 4 if id(p) in layer_of else p.grad.numel() * p.grad.element_size()
            for p in params
        )

    def gradient_sum_metrics(self) -> dict[str, float]:
        return {"ddp/allreduce_bytes": float(self.last_allreduce_bytes),
                "ddp/dense_allreduce_bytes": float(self.dense_allreduce_bytes)}


__all__ = ["SketchConfig", "SketchDDPStrategy", "SketchStrategy"]
