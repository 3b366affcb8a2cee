"""Sharded sketch training: PyTorch's FSDP2 (`fully_shard`) through Lightning's `ModelParallelStrategy`.

Every decoder layer, and the decoder around them (embeddings, final norm), is sharded by rows over the ranks: rank i
holds rows [i·c, (i+1)·c) of every matrix, c = ⌈d/world⌉ (torch.chunk's split, as FSDP2 shards dim 0). LoGRA's update
is row-local: rows [a, b) of W − F·A need rows [a, b) of F and the whole A, which every rank regenerates from the
seed. So one step is:

  forward/backward  FSDP all-gathers each layer's W for compute; `SketchedLinear` accumulates the whole d×r sketch
                    of the rank's samples into its carrier's .grad (the stride-0 carriers are `ignored_params`: FSDP
                    never shards or reduces them)
  sum_gradients     one reduce-scatter over ranks of all sketches, by rows: each rank receives only S[a:b] summed
                    over ranks (densely trained sharded parameters are summed by FSDP itself, its divide factor set
                    to 1 because the module normalizes the loss by the global batch)
  propose/apply     the sketch optimizer keeps state (a:b rows × r) and merges F[a:b]·A into the local shard only,
                    with the stochastic-rounding bits those rows have in the whole matrix
  KL control        the proposal's F is all-gathered (d×r per matrix) for the low-rank perturbation of the forward

The LM head stays whole on every rank (replicated, like DDP; its gradient is all-reduced when it is trained): the
chunked log-probs and the KL check use its weight outside its module's forward pass, where FSDP would hold only a
shard. With tied embeddings the embedding matrix is the head's and stays whole too.

Every forward pass all-gathers weights, so every rank runs the same number of them: the module runs every sample's
micro-batch (`lockstep`), and the in-process engine generates until every rank's rows have finished (`all_finished`).
"""

from __future__ import annotations

import logging
import math
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.model_parallel import _METADATA_FILENAME, _is_sharded_checkpoint
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard

from lightning_logra.sketch.config import SketchConfig
from lightning_logra.sketch.install import sketched_layers
from lightning_logra.sketch.update import LowRankDelta
from lightning_logra.train.checkpoint import replace_folder, temporary_path
from lightning_logra.train.digests import (
    DamagedCheckpoint,
    digests_of,
    folder_files,
    verify_sums,
    write_sums,
)
from lightning_logra.train.safe_load import load_file, load_sharded
from lightning_logra.train.strategies.base import StrategyCollectives

log = logging.getLogger(__name__)


def shard_rows(rows: int, rank: int, world: int) -> slice:
    """The rows of a (rows, ...) tensor that FSDP2 gives `rank` of `world`: torch.chunk's split (the last ranks may
    hold fewer, or none)."""
    chunk = math.ceil(rows / world)
    start = min(rank * chunk, rows)
    return slice(start, min(start + chunk, rows))


def shard_policy(policy: nn.Module, mesh: DeviceMesh) -> None:
    """FSDP2 over `mesh` (one dimension): `fully_shard` every decoder layer and the decoder, leaving the sketch carriers
    and the LM head whole; gradients summed over ranks, not averaged; each sketched layer's `rows` set to its shard's.
    Sketches must be installed first (their carriers are left out of the sharding)."""
    decoder = policy.get_decoder()
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"trainer.strategy: SketchFSDPStrategy shards a decoder's `layers`; "
                         f"{type(decoder).__name__} has none (use SketchDDPStrategy)")
    # Kept whole on every rank: the sketch carriers (a 4-byte stride-0 zero each, whose .grad is the sketch) and the
    # LM head (its weight is used outside its forward pass; see this module's docstring).
    keep = {layer.sketch_param for layer in sketched_layers(policy).values()}
    keep |= set(policy.get_output_embeddings().parameters())
    for layer in layers:
        fully_shard(layer, mesh=mesh, ignored_params=keep)
    # The root too is resharded after every forward (FSDP keeps a root's weights gathered by default): outside a
    # forward pass every parameter is then its sharded DTensor, which the optimizers and the KL check update.
    fully_shard(decoder, mesh=mesh, ignored_params=keep, reshard_after_forward=True)
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            # The module's loss is normalized by the global batch's counts: gradients are summed, not averaged,
            # with a plain SUM (a divide factor alone becomes a PREMUL_SUM, which gloo does not have).
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    rank, world = mesh.get_local_rank(), mesh.size()
    for name, layer in sketched_layers(policy).items():
        layer.rows = shard_rows(layer.out_features, rank, world)
        local = layer.local_weight().shape[0]
        if local != len(range(layer.out_features)[layer.rows]):
            raise RuntimeError(f"{name}: FSDP gave rank {rank} {local} rows, expected rows {layer.rows}")


class SketchFSDPStrategy(StrategyCollectives, ModelParallelStrategy):
    """Sketch training with the weights sharded by FSDP2 over all processes (pure data parallelism: one mesh
    dimension). Per rank: 1/world of the weights, of the sketch optimizer's state and of any dense optimizer's state;
    each rank still accumulates the whole d×r sketch of its own samples before the reduction."""

    strategy_name = "logra_sketch_fsdp"
    shards_weights = True  # so every forward pass is a collective: every rank runs every micro-batch

    def __init__(self, sketch: SketchConfig = SketchConfig(), process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout) -> None:
        """
        Args:
            sketch: which matrices are sketched, at what rank, and the sketch optimizer (`SketchConfig`).
            process_group_backend: torch.distributed's backend (`gloo` on CPUs, `nccl` on GPUs); None picks it
                from the device.
            timeout: how long a collective may wait for the other ranks.

        Checkpoints are sharded: a folder in which each rank writes its shards (torch.distributed.checkpoint);
        `lightning-logra export` turns one into a transformers folder.
        """
        super().__init__(save_distributed_checkpoint=True, process_group_backend=process_group_backend,
                         timeout=timeout)
        self.config = sketch
        self.handles: dict = {}  # the sketched layers, once set up
        self.last_reduce_bytes = self.last_allreduce_bytes = 0

    def setup_environment(self) -> None:
        # All processes shard the weights (FSDP); ModelParallelStrategy's "auto" would make them a tensor-parallel
        # dimension instead.
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    def setup(self, trainer: Trainer) -> None:
        # The training mode installed the sketches when the module was configured (before this).
        policy = self.lightning_module.policy
        self.handles = sketched_layers(policy)
        if not any(isinstance(m, FSDPModule) for m in policy.modules()):
            shard_policy(policy, self.device_mesh["data_parallel"])
        super().setup(trainer)

    def all_finished(self, finished: torch.Tensor) -> bool:
        # Every generation step's forward pass all-gathers weights: every rank goes on until every rank is done.
        done = finished.all().to(torch.int32).reshape(1)
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return bool(done)

    # ---- the step's collectives -------------------------------------------------------------------------------------

    def sum_gradients(self, params: list[torch.Tensor]) -> None:
        """Sum the gradients of `params` over ranks: the sketches by one reduce-scatter over rows (each rank keeps
        S[rows] of every layer, the other rows of its .grad zeroed), replicated dense gradients (the head) by one
        all-reduce. Sharded dense gradients were summed by FSDP during backward."""
        layer_of = {layer.sketch_param: layer for layer in self.handles.values()}
        sketches = [p for p in params if p in layer_of]
        replicated = [p for p in params if p not in layer_of and p.grad is not None and not isinstance(p.grad, DTensor)]
        world = self.world_size
        # Rank-major: rank i's part is every layer's rows of shard i, each padded to ⌈d/world⌉ rows, so that the
        # parts have one size. (gloo implements the reduce-scatter with an all-reduce; NCCL sends 1/world of it.)
        parts = []
        for p in sketches:
            layer = layer_of[p]
            if p.grad is None:
                p.grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            chunk = math.ceil(layer.out_features / world)
            padded = p.grad.new_zeros(chunk * world, layer.rank)
            padded[: layer.out_features] = p.grad
            parts.append(padded.view(world, chunk * layer.rank))
        if parts:
            flat = torch.cat(parts, dim=1).reshape(-1)  # (world · Σ chunk·r,)
            mine = flat.new_empty(flat.numel() // world)
            dist.reduce_scatter_single(mine, flat, op=dist.ReduceOp.SUM)
            self.last_reduce_bytes = flat.numel() * flat.element_size()
            for p, part in zip(sketches, mine.split([x.shape[1] for x in parts])):
                layer = layer_of[p]
                rows = layer.rows
                count = len(range(layer.out_features)[rows])
                p.grad.zero_()
                p.grad[rows] = part.view(-1, layer.rank)[:count]
        if replicated:
            flat = torch.cat([p.grad.reshape(-1) for p in replicated])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            for p, reduced in zip(replicated, flat.split([p.grad.numel() for p in replicated])):
                p.grad.copy_(reduced.view_as(p.grad))
            self.last_allreduce_bytes = flat.numel() * flat.element_size()

    def reduction_metrics(self) -> dict[str, float]:
        return {"fsdp/sketch_reduce_scatter_bytes": float(self.last_reduce_bytes),
                "fsdp/replicated_allreduce_bytes": float(self.last_allreduce_bytes)}

    def gradient_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The norm over all ranks: each rank's sketch rows and dense shards once, replicated gradients once."""
        carriers = {layer.sketch_param for layer in self.handles.values()}
        squares = torch.zeros((), dtype=torch.float64, device=self.root_device)
        for p in params:
            grad = p.grad
            if isinstance(grad, DTensor):
                squares += grad.to_local().double().square().sum()
            elif p in carriers:
                squares += grad.double().square().sum()  # only its rows are nonzero after sum_gradients
            else:
                squares += grad.double().square().sum() / self.world_size  # the same on every rank
        dist.all_reduce(squares, op=dist.ReduceOp.SUM)
        return squares.sqrt().float()

    def whole_factors(self, low_rank: dict[str, LowRankDelta]) -> dict[str, LowRankDelta]:
        """Each rank's rows of every F, all-gathered into the whole (d, r) factors (one collective)."""
        if not low_rank:
            return low_rank
        layers = {f"{name}.weight": layer for name, layer in self.handles.items()}
        world = self.world_size
        dtype = next(iter(low_rank.values())).factor.dtype
        parts = []
        for name, delta in low_rank.items():
            layer = layers[name]
            chunk = math.ceil(layer.out_features / world)
            padded = delta.factor.new_zeros(chunk, layer.rank, dtype=dtype)
            padded[: delta.factor.shape[0]] = delta.factor
            parts.append(padded.reshape(-1))
        mine = torch.cat(parts)
        gathered = mine.new_empty(world * mine.numel())
        dist.all_gather_single(gathered, mine)
        gathered = gathered.view(world, -1)  # (world, Σ chunk·r)
        whole = {}
        for (name, delta), part in zip(low_rank.items(), gathered.split([p.numel() for p in parts], dim=1)):
            layer = layers[name]
            factor = part.reshape(-1, layer.rank)[: layer.out_features]  # (d, r): ranks' rows in order, unpadded
            whole[name] = LowRankDelta(factor, delta.seed, delta.distribution, delta.in_features, delta.rounding_key)
        return whole

    # ---- sharded checkpoints ----------------------------------------------------------------------------------------

    def _steps_sketches(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether `optimizer` is the one over the sketch carriers, whose state holds each rank's rows of (d, r)
        tensors (FSDP's own state handling is for the parameters it shards)."""
        carriers = {layer.sketch_param for layer in self.handles.values()}
        return any(p in carriers for group in optimizer.param_groups for p in group["params"])

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's
        if not self._steps_sketches(optimizer):
            return super().optimizer_state(optimizer)  # torch.distributed.checkpoint's, for sharded parameters
        return self._sharded_sketch_state(optimizer)

    def _sharded_sketch_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The sketch optimizer's state dict with each (rows, r) state tensor as the rank's shard of a (d, r) DTensor
        (the tensors themselves, not copies): saved, each rank writes its rows; loaded, each rank reads its rows into
        them in place. As plain tensors, every rank's would be taken for the same replicated value."""
        mesh = self.device_mesh["data_parallel"]
        layers = optimizer.layers

        def sharded(index: int, value: Any) -> Any:
            if not (torch.is_tensor(value) and value.dim() == 2):
                return value  # the step count, the refresh index
            rows, rank = value.shape  # (rows, r) of a (d, r) tensor
            return DTensor.from_local(value, mesh, [Shard(0)], run_check=False,
                                      shape=(layers[index].out_features, rank), stride=(rank, 1))

        state_dict = optimizer.state_dict()  # its per-layer dicts are the optimizer's own: new ones are made
        state_dict["state"] = {index: {key: sharded(index, value) for key, value in state.items()}
                               for index, state in state_dict["state"].items()}
        return state_dict

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path,
                        storage_options: Any | None = None) -> None:
        """Sharded (each rank writes its shards, torch.distributed.checkpoint), into a temporary folder beside the
        target that rank 0 moves into place once every rank has written its part (`replace_folder`): a crash during
        the save leaves the previous checkpoint as it was."""
        path = Path(self.broadcast(str(filepath)))
        tmp = Path(self.broadcast(str(temporary_path(path)) if self.global_rank == 0 else None))
        try:
            super().save_checkpoint(checkpoint, tmp, storage_options)
            self.barrier("sharded checkpoint written")
            # Every rank hashes a share of the files (its own shards are as many as any other's), rank 0 writes them
            # all into SHA256SUMS inside the folder before it is moved into place.
            names = folder_files(tmp)
            shares = self._gather(digests_of(tmp, names[self.global_rank :: self.world_size]))
            if self.global_rank == 0:
                write_sums(tmp, {name: digest for share in shares for name, digest in share.items()})
        except BaseException:
            if self.global_rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.barrier("sharded checkpoint hashed")
        if self.global_rank == 0:
            replace_folder(tmp, path)
        self.barrier("sharded checkpoint in place")

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if not _is_sharded_checkpoint(path):
            raise ValueError(f"--ckpt_path: {str(path)!r} is not a sharded checkpoint folder (SketchFSDPStrategy "
                             "writes and resumes those); train from an exported model folder instead")
        self._verify(path)
        # The sketch optimizer's state is read in place into state created for it (its shards of DTensors); the
        # model and any dense optimizer go through Lightning's torch.distributed.checkpoint loading.
        others = {}
        for index, optimizer in enumerate(self.optimizers):
            if self._steps_sketches(optimizer):
                optimizer.materialize_state()
                state = {f"optimizer_{index}": self._sharded_sketch_state(optimizer)}
                load_sharded(state, path)
                loaded = state[f"optimizer_{index}"]
                # torch.distributed.checkpoint loads the tensors in place under the parameter's index (an int) but
                # puts the other values (the step count, ...) under the index as a string: merge them.
                merged = {i: dict(layer_state) for i, layer_state in loaded["state"].items() if isinstance(i, int)}
                for i, layer_state in loaded["state"].items():
                    if isinstance(i, str):
                        merged[int(i)].update(layer_state)
                loaded["state"] = {i: {key: value.to_local() if isinstance(value, DTensor) else value
                                       for key, value in layer_state.items()} for i, layer_state in merged.items()}
                optimizer.load_state_dict(loaded)  # checks the sketch settings; the update counter comes back
            else:
                others[f"optimizer_{index}"] = optimizer
        # Lightning's loading of the model's and the dense optimizers' shards and of the rest of the checkpoint, through
        # the reader and planner that run no code from the folder (lightning_logra.train.safe_load).
        model_state = {"state_dict": get_model_state_dict(self.model)}
        load_sharded(model_state, path)
        self.model.load_state_dict(model_state["state_dict"], strict=self.lightning_module.strict_loading)
        for key, optimizer in others.items():
            optimizer_state = {key: get_optimizer_state_dict(self.model, optimizer)}
            load_sharded(optimizer_state, path)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=optimizer_state[key],
                                     options=StateDictOptions(cpu_offload=True))
        return load_file(path / _METADATA_FILENAME)

    def _verify(self, path: Path) -> None:
        """Check the folder against its SHA256SUMS, each rank a share of the files; all ranks raise if any finds
        damage (before any collective of the load begins)."""
        names = folder_files(path)
        try:
            verify_sums(path, names[self.global_rank :: self.world_size])
            problem = None
        except DamagedCheckpoint as err:
            problem = str(err)
        found = [p for p in self._gather(problem) if p is not None]
        if found:
            raise DamagedCheckpoint(found[0])

    def _gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (a small picklable one), on every rank."""
        if not (dist.is_available() and dist.is_initialized()):
            return [value]
        values = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def whole_policy_state(self) -> dict[str, torch.Tensor] | None:
        # Every rank takes part in the gathers; rank 0 receives the whole tensors (on the CPU), the others nothing.
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.lightning_module.policy, options=options)


__all__ = ["SketchFSDPStrategy", "shard_policy"]
