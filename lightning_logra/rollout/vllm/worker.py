"""Runs inside each vLLM worker (`worker_extension_cls`): applies `Update`s to the worker's copy of the weights.

vLLM's layout differs from the trainer's (transformers) in two ways this file undoes:
- fused layers: q/k/v are row blocks of one `qkv_proj`, gate/up row blocks of one `gate_up_proj`
  (`model.packed_modules_mapping` says which, `output_partition_sizes` how many rows each);
- tensor parallelism: a column-parallel layer holds a block of rows of the full matrix on each rank (its rows of
  F·A are F[rows]·A), a row-parallel layer a block of columns (F·A[:, cols]).
A weight is therefore a *slot*: the local tensor and which rows and columns of the full matrix it holds.

On the CPU backend vLLM prepacks every linear weight for its GEMM kernels and leaves `layer.weight` empty. An engine
in a process of its own recovers a layer's weight exactly from the packed kernel (Wᵀ = linear(I)) the first time
it is touched, keeps it, and re-packs the layer after every change: one more copy of the linear weights in host
memory, which is what an in-place update on that backend needs. The embedding keeps its weight but is packed too
(for the logits of an LM head tied to it, packed apart): it is re-packed after a change as well. An engine in the
trainer's process holds no copy of what the trainer holds: each linear layer computes from the trainer's own tensors
(`SharedLinear`, handed over by reference), which the trainer merges its updates into in place, so a sync has
nothing to merge or pack; the embedding's logits GEMM reads its weight (`vocab_logits`, no packed copy). A layer given
other values by a load packs a kernel of its own until the next update points it at the trainer's tensors again.
On GPUs the weight is updated where it lies.

Methods are called through `LLM.collective_rpc("logra_…")`; arguments and answers are bytes (tensors do not cross
that boundary), built with `lightning_logra.rollout.sync`, or for a full load by reference with
`lightning_logra.rollout.handles` (in the trainer's process, where there is no boundary, the trainer's tensors
themselves). With CUDA graphs every change must be in place: a captured graph reads the weights
at the addresses they had at capture (every write here is a copy into, or a merge into, the existing tensor).
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lightning_logra.algo.logprobs import vocab_logits
from lightning_logra.algo.update import Update
from lightning_logra.rollout.handles import device_id, open_tensors
from lightning_logra.rollout.payload import tensors_problems, update_problems
from lightning_logra.rollout.sync import fingerprint
from lightning_logra.rollout.tensor_bytes import pack_tensors, unpack_tensors
from lightning_logra.rollout.vllm.compat import missing_layer_attributes
from lightning_logra.sketch.update import LowRankDelta, RowBlock, apply_stacked_update_, merge_stays_finite


@dataclass
class Slot:
    tensor: torch.Tensor  # the local block to read or write in place: (n, m) or (n,)
    rows: slice  # its rows in the full (trainer-side) tensor
    cols: slice | None  # its columns in the full tensor; None for a 1-D parameter
    layer: nn.Module | None = None  # the linear layer that holds it (re-packed on the CPU after a change)
    whole: tuple[int, ...] = ()  # the full trainer-side tensor's shape


class SharedLinear:
    """A CPU layer's GEMM (`layer.cpu_linear`, in place of vLLM's packed kernel) computed straight from the trainer's
    own tensors: the row blocks of the layer's parts in order (q, k and v of a fused qkv; one for an unfused layer),
    (rows_i, k) each. The trainer merges its updates into them in place, so the engine holds no copy of them."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        self.weights = weights
        ends = list(itertools.accumulate(weight.shape[0] for weight in weights))
        self.rows = [slice(start, end) for start, end in zip([0, *ends[:-1]], ends)]  # each part's rows of the bias

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if len(self.weights) == 1:
            return F.linear(x, self.weights[0], bias)
        return torch.cat([F.linear(x, w, None if bias is None else bias[rows])
                          for w, rows in zip(self.weights, self.rows)], dim=-1)


def _is_linear(module: nn.Module) -> bool:
    from vllm.model_executor.layers.linear import LinearBase

    return isinstance(module, LinearBase)


def _packed(layer: nn.Module) -> bool:
    """Whether vLLM's CPU kernel holds the layer's weight packed, its `weight` left empty."""
    return hasattr(layer, "cpu_linear") and layer.weight.numel() == 0


def _row_parallel(layer: nn.Module) -> bool:
    from vllm.model_executor.layers.linear import RowParallelLinear

    return isinstance(layer, RowParallelLinear)


def _column_block(layer: nn.Module, shard: int | None) -> tuple[int, int, int]:
    """(offset of the shard's rows in the local weight, their count, their first row in the full trainer matrix)."""
    from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear

    sizes = list(getattr(layer, "output_partition_sizes", [layer.weight.shape[0]]))
    if isinstance(layer, RowParallelLinear):
        return 0, sizes[0], 0  # every rank holds all rows
    index = shard or 0
    offset, count = sum(sizes[:index]), sizes[index]
    tp_rank = getattr(layer, "tp_rank", 0)
    if isinstance(layer, QKVParallelLinear) and index > 0:
        # k and v: kv heads are replicated when there are more ranks than kv heads.
        return offset, count, (tp_rank // layer.num_kv_head_replicas) * count
    return offset, count, tp_rank * count


def _whole_rows(layer: nn.Module, shard: int | None) -> int:
    """The rows of the trainer's matrix whose block (of part `shard` of a fused layer) `layer` holds."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    if isinstance(layer, QKVParallelLinear):
        if not shard:
            return layer.total_num_heads * layer.head_size
        return layer.total_num_kv_heads * (layer.head_size if shard == 1 else layer.v_head_size)
    if isinstance(layer, MergedColumnParallelLinear):
        return layer.output_sizes[shard or 0]
    return layer.output_size


def _local_row(slot: Slot) -> int:
    """The first row of a slot's block in its layer's local weight (a fused q/k/v or gate/up weight holds several)."""
    weight = slot.layer.weight.data
    return (slot.tensor.storage_offset() - weight.storage_offset()) // weight.stride(0)


def _stacks(merges: list[tuple[Slot, LowRankDelta]]) -> list[list[tuple[Slot, LowRankDelta]]]:
    """The low-rank merges of an update, in stacks that one GEMM can apply: the blocks of one fused weight that sit
    on consecutive rows, span the same columns and whose deltas share A (`sketch.share_projection`: same seed,
    distribution, rank and in_features). Every other merge is a stack of its own."""
    stacks: dict[tuple, list[tuple[Slot, LowRankDelta]]] = {}
    for slot, delta in merges:
        key = (id(slot),)  # alone
        if slot.layer is not None and slot.cols is not None:
            key = (id(slot.layer), slot.cols.start, slot.cols.stop, delta.seed, delta.distribution, delta.rank,
                   delta.in_features, delta.factor.dtype)
        stacks.setdefault(key, []).append((slot, delta))
    out = []
    for stack in stacks.values():
        stack.sort(key=lambda merge: _local_row(merge[0]) if merge[0].layer is not None else 0)
        run = [stack[0]]
        for merge in stack[1:]:
            previous = run[-1][0]
            if _local_row(merge[0]) == _local_row(previous) + previous.tensor.shape[0]:
                run.append(merge)
            else:
                out.append(run)
                run = [merge]
        out.append(run)
    return out


class LogRAWorkerExtension:
    """Mixed into vLLM's worker class; `self.model_runner.model` is the worker's model."""

    def _logra_model(self) -> nn.Module:
        return self.model_runner.model

    def _logra_linear(self, name: str) -> tuple[nn.Module | None, int | None, str]:
        """(the module holding the trainer's tensor `name` or None, its part of a fused layer, "weight" or "bias")."""
        model = self._logra_model()
        module_name, _, leaf = name.rpartition(".")  # leaf: "weight" or "bias"
        parent, _, child = module_name.rpartition(".")
        shard = None
        for fused, parts in (getattr(model, "packed_modules_mapping", None) or {}).items():
            if child in parts:
                module_name, shard = f"{parent}.{fused}" if parent else fused, parts.index(child)
                break
        try:
            return model.get_submodule(module_name), shard, leaf
        except AttributeError:
            return None, shard, leaf

    def _logra_slot(self, name: str) -> Slot:
        module, shard, leaf = self._logra_linear(name)
        if module is not None and _is_linear(module):
            self._logra_unpack(module)
            from vllm.model_executor.layers.linear import RowParallelLinear

            offset, count, row_start = _column_block(module, shard)
            param = getattr(module, leaf)
            local = param.data[offset : offset + count]
            rows = _whole_rows(module, shard)
            if param.dim() == 1:  # a bias: split by rows like the weight, never by columns
                return Slot(local, slice(row_start, row_start + count), None, module, (rows,))
            col_start = 0
            if isinstance(module, RowParallelLinear):
                col_start = getattr(module, "tp_rank", 0) * module.input_size_per_partition
            return Slot(local, slice(row_start, row_start + count),
                        slice(col_start, col_start + local.shape[1]), module, (rows, module.input_size))
        params = dict(self._logra_model().named_parameters())
        if name not in params:
            raise KeyError(f"vLLM worker: no parameter for {name!r}")
        param = params[name].data
        indices = getattr(module, "shard_indices", None)  # a vocab-parallel embedding holds a block of rows
        whole = tuple(param.shape)
        if indices is not None:
            count = indices.org_vocab_end_index - indices.org_vocab_start_index
            start = indices.org_vocab_start_index
            param = param[:count]
            whole = (module.org_vocab_size, *param.shape[1:])
        else:
            start, count = 0, param.shape[0]
        cols = None if param.dim() == 1 else slice(0, param.shape[1])
        return Slot(param, slice(start, start + count), cols, None, whole)

    # ---- CPU backend: prepacked weights ------------------------------------------------------------------------

    def _logra_unpack(self, layer: nn.Module) -> None:
        """Give a prepacked CPU layer back a real weight tensor, recovered exactly from its kernel (kept, unless the
        trainer's tensors are at hand: `_logra_reads_trainer`)."""
        if not _packed(layer):
            return
        k = layer.input_size_per_partition
        dtype = layer.params_dtype if hasattr(layer, "params_dtype") else torch.float32
        eye = torch.eye(k, dtype=dtype)
        layer.weight.data = layer.cpu_linear(eye, None, None).t().contiguous()  # (n, k): linear(I) = Wᵀ exactly
        self.__dict__.setdefault("_logra_unpacked", set()).add(layer)

    def _logra_repack(self, layers: set[nn.Module]) -> None:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return  # on GPUs the kernels read layer.weight directly
        for layer in layers:
            if self._logra_reads_trainer() and not _is_linear(layer):
                # an embedding, or an LM head tied to it: the logits GEMM reads its weight (no packed copy beside it)
                layer.cpu_linear = vocab_logits
                continue
            # vLLM drops the weight only where its kernel packed a copy (not for torch's fallback GEMM); an embedding
            # (packed for a tied head's logits) keeps it for its lookups
            dispatch_cpu_unquantized_gemm(layer, remove_weight=self._logra_reads_trainer() and _is_linear(layer))
        self.__dict__.get("_logra_unpacked", set()).difference_update(layers)

    def _logra_reads_trainer(self) -> bool:
        """Whether this worker runs in the trainer's process on the CPU backend: then its linear layers compute from
        the trainer's own tensors where they can (`_logra_share`), a layer packed for another reason keeps no
        unpacked copy of its weight (`_logra_pack_from`), and one unpacked to be read is dropped again
        (`_logra_drop_unpacked`)."""
        return getattr(self, "_logra_in_trainer", False)

    def _logra_drop_unpacked(self) -> None:
        """Drop the weights unpacked since the last re-pack (read, not changed): their kernels still hold them."""
        for layer in self.__dict__.pop("_logra_unpacked", set()):
            layer.weight = nn.Parameter(torch.empty(0, dtype=layer.weight.dtype), requires_grad=False)

    def _logra_parts(self, layers: set[nn.Module], trainer: dict[str, torch.Tensor]
                     ) -> dict[nn.Module, list[tuple[str, int | None]]]:
        """{layer: the trainer's weight names that fill it, with their part of a fused layer (q, k, v)}."""
        parts: dict[nn.Module, list[tuple[str, int | None]]] = {}
        for name in trainer:
            module, shard, leaf = self._logra_linear(name)
            if module in layers and leaf == "weight":
                parts.setdefault(module, []).append((name, shard))
        return parts

    def _logra_share(self, layers: set[nn.Module], trainer: dict[str, torch.Tensor]) -> set[nn.Module]:
        """Point each layer's GEMM at the trainer's own tensors (`SharedLinear`): the trainer merges its updates
        into them in place, so the engine holds no copy of these weights and has nothing to merge or pack at a
        sync. Only a layer that holds whole matrices of the trainer's (no tensor-parallel block) in their dtype;
        returns the layers left as they were."""
        left, parts = set(), self._logra_parts(layers, trainer)
        for layer, names in parts.items():
            blocks = sorted((_column_block(layer, shard), name) for name, shard in names)
            weights = [trainer[name].detach() for _, name in blocks]
            whole = (all(row_start == 0 and count == weight.shape[0] for ((_, count, row_start), _), weight
                         in zip(blocks, weights))
                     and sum(w.shape[0] for w in weights) == sum(layer.output_partition_sizes)
                     and layer.input_size_per_partition == layer.input_size
                     and all(w.dtype == layer.params_dtype and w.shape[1] == layer.input_size for w in weights))
            if not whole:
                left.add(layer)
                continue
            layer.cpu_linear = SharedLinear(weights)  # vLLM's packed kernel (and its copy) goes with the old one
            bias = getattr(layer, "bias", None)
            if bias is not None and bias.dtype != layer.params_dtype:
                # vLLM's small-GEMM kernel (AMX) keeps a bf16 layer's bias in float32: the same bf16 values, back
                bias.data = bias.data.to(layer.params_dtype)
            if layer.weight.numel():
                layer.weight = nn.Parameter(torch.empty(0, dtype=layer.params_dtype), requires_grad=False)
            self.__dict__.get("_logra_unpacked", set()).discard(layer)
        return left | (layers - set(parts))

    def _logra_pack_from(self, layers: set[nn.Module], trainer: dict[str, torch.Tensor]) -> None:
        """Re-pack each layer's kernel straight from the trainer's tensors of its parts (q, k and v of a fused qkv):
        the merge the trainer made is the merge this worker would make, bit for bit, so it is not made twice, and
        no unpacked copy of the weight outlives the packing (one layer's at a time). For the layers `_logra_share`
        cannot point at the trainer's tensors (a tensor-parallel block)."""
        parts = self._logra_parts(layers, trainer)
        for layer in layers:
            sizes = list(layer.output_partition_sizes)
            weight = torch.empty(sum(sizes), layer.input_size_per_partition, dtype=layer.params_dtype)
            filled = 0
            for name, shard in parts.get(layer, []):
                offset, count, row_start = _column_block(layer, shard)
                cols = slice(0, layer.input_size)
                if _row_parallel(layer):
                    start = getattr(layer, "tp_rank", 0) * layer.input_size_per_partition
                    cols = slice(start, start + layer.input_size_per_partition)
                weight[offset : offset + count] = trainer[name][row_start : row_start + count, cols]
                filled += count
            if filled != weight.shape[0]:
                raise RuntimeError(f"vLLM worker: the trainer's tensors fill {filled} of {weight.shape[0]} rows of "
                                   f"{type(layer).__name__} (parts {[n for n, _ in parts.get(layer, [])]})")
            layer.weight = nn.Parameter(weight, requires_grad=False)
            self._logra_repack({layer})  # one layer's copy at a time: packed, then dropped

    # ---- called through collective_rpc --------------------------------------------------------------------------

    def logra_watch_trainer(self, trainer_pid: int) -> None:
        """Kill this worker, and the engine core above it, once the trainer's process is gone.

        vLLM's processes do not notice their parent's death: after a SIGKILL of the trainer they were seen running
        minutes later, holding gigabytes. A thread here checks the trainer every second. The engine core is this
        process itself (one worker) or this worker's parent (tensor parallelism); its pid is taken now, while the
        parent is still who started us."""
        if trainer_pid == os.getpid():
            self._logra_trainers_process = True  # the engine runs inside it: it cannot outlive it
            return
        import psutil  # a dependency of vLLM

        trainer = psutil.Process(trainer_pid)  # is_running() also tells a reused pid from the trainer
        core = os.getppid() if os.getppid() != trainer_pid else None

        def trainer_alive() -> bool:
            try:  # a killed trainer stays a zombie until its parent reaps it: that is dead too
                return trainer.is_running() and trainer.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return False

        def watch() -> None:
            while trainer_alive():
                time.sleep(1.0)
            if core is not None:
                os.kill(core, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="logra-watch-trainer", daemon=True).start()

    def logra_read_trainer(self, trainer: dict[str, torch.Tensor]) -> bool:
        """Whether this worker computes from the trainer's tensors (`_logra_reads_trainer`): in the trainer's process,
        on the CPU backend, and the trainer holding every packed layer's weights in the dtype the layer computes in.
        `trainer`: the trainer's tensors, by reference. Then each linear layer computes from them (`_logra_share`;
        a tensor-parallel block re-packs from them after each update), and an embedding's logits GEMM reads its
        weight instead of a packed copy. Returns it; a restarted worker starts without."""
        from vllm.platforms import current_platform

        linear = [(self._logra_linear(name)[0], tensor.dtype) for name, tensor in trainer.items()
                  if name.endswith(".weight")]
        self._logra_in_trainer = (getattr(self, "_logra_trainers_process", False) and current_platform.is_cpu()
                                  and all(dtype == module.params_dtype for module, dtype in linear
                                          if module is not None and _is_linear(module)))
        if self._logra_in_trainer:
            # packed, or on torch's GEMM reading a weight of its own (bf16 where the CPU has no bf16 kernels)
            layers = {module for module, _ in linear if module is not None and _is_linear(module)
                      and hasattr(module, "cpu_linear")}
            self._logra_share(layers, trainer)  # a tensor-parallel block keeps the kernel it packed at load
            self._logra_repack({m for m in self._logra_model().modules() if hasattr(m, "cpu_linear") and not
                                _is_linear(m)})
        return self._logra_in_trainer

    @torch.no_grad()
    def logra_apply(self, data: bytes, trainer: dict[str, torch.Tensor] | None = None) -> int:
        """Merge an `Update`; returns how many tensors it touched on this rank. `trainer`: the trainer's tensors,
        after the same update, handed over by reference in its own process (CPU backend): a packed layer the update
        changes is re-packed from them (`_logra_pack_from`) instead of merged into a copy of its own."""
        update = Update.from_bytes(data)
        count = len(update.low_rank) + len(update.dense)
        from_trainer = set()
        if trainer is not None and self._logra_reads_trainer():
            for name in [*update.low_rank, *update.dense]:
                module, _, leaf = self._logra_linear(name)
                if module is not None and _is_linear(module) and leaf == "weight" and hasattr(module, "cpu_linear"):
                    from_trainer.add(module)
            update = Update({n: d for n, d in update.low_rank.items() if self._logra_linear(n)[0] not in from_trainer},
                            {n: t for n, t in update.dense.items() if self._logra_linear(n)[0] not in from_trainer})
        touched = set()
        for stack in _stacks([(self._logra_slot(name), delta) for name, delta in update.low_rank.items()]):
            slot, delta = stack[0]
            if len(stack) == 1:
                delta.factor = delta.factor.to(slot.tensor.device)
                delta.apply_shard_(slot.tensor, slot.rows, slot.cols)
            else:
                # [F_q; F_k; F_v]·A (or [F_gate; F_up]·A): one A and one GEMM for the fused weight's row blocks
                offset, weight = _local_row(slot), slot.layer.weight.data
                rows = sum(s.tensor.shape[0] for s, _ in stack)
                blocks = [RowBlock(d.factor[s.rows].to(weight.device), d.rounding_key, s.rows.start or 0)
                          for s, d in stack]
                apply_stacked_update_(weight[offset : offset + rows], blocks,
                                      delta.projection(weight.device)[:, slot.cols], slot.cols.start or 0)
            touched.add(slot.layer)
        touched |= self._logra_copy(update.dense)
        self._logra_repack(touched - {None})
        if from_trainer:
            # the layers a load gave kernels of their own compute from the trainer's tensors again
            self._logra_pack_from(self._logra_share(from_trainer, trainer), trainer)
        return count

    @torch.no_grad()
    def logra_load(self, data: bytes) -> int:
        """Load full tensors (trainer names and shapes); returns how many this rank took."""
        touched = self._logra_copy(unpack_tensors(data))
        self._logra_repack(touched - {None})
        return len(touched)

    @torch.no_grad()
    def logra_load_shared(self, data: bytes) -> int:
        """Load full tensors handed over by reference (`handles.share_tensors`: CUDA IPC on the trainer's GPU, shared
        memory on the host): copied straight from the trainer's memory, nothing serialized. Returns how many this
        rank took."""
        device = self._logra_torch_device()
        tensors = open_tensors(data, device)
        touched = self._logra_copy(tensors)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the trainer may change its tensors as soon as this returns
        del tensors  # closes the handles
        self._logra_repack(touched - {None})
        return len(touched)

    def _logra_torch_device(self) -> torch.device:
        return next(self._logra_model().parameters()).device

    def logra_device(self) -> str:
        """Where this worker's weights are (`handles.device_id`): whether the trainer's tensors can be handed over."""
        return device_id(self._logra_torch_device())

    def logra_check(self) -> list[str]:
        """The attributes this extension reads that the loaded model's layers lack (`compat.py`); [] when none."""
        from vllm.platforms import current_platform

        return missing_layer_attributes(self._logra_model(), cpu=current_platform.is_cpu())

    def logra_payload_problems(self, kind: str, data: bytes) -> list[str]:
        """What is wrong with an update ("update") or whole tensors ("load") for this model (`rollout.payload`);
        [] when nothing is. Changes nothing."""
        if kind == "update":
            update = Update.from_bytes(data)
            return (update_problems(update, self._logra_whole_shape, self._logra_weight_dtype)
                    or self._logra_merge_problems(update))
        return tensors_problems(unpack_tensors(data), self._logra_whole_shape, self._logra_weight_dtype)

    def _logra_merge_problems(self, update: Update) -> list[str]:
        """The matrices whose merge would leave a number this worker's weight cannot hold (Inf or NaN, where the
        weight held a finite one), worked out before any matrix is merged: a merge that stopped at the first would
        leave the others merged."""
        problems = []
        for name, delta in update.low_rank.items():
            slot = self._logra_slot(name)
            projection = delta.projection(slot.tensor.device)[:, slot.cols]  # (r, this worker's columns)
            if not merge_stays_finite(slot.tensor, delta.factor[slot.rows], projection):
                problems.append(f"{name!r}: the merge would leave Inf or NaN in the {slot.tensor.dtype} weight")
        return problems

    def _logra_whole_slot(self, name: str) -> Slot | None:
        """Where the trainer's whole tensor `name` goes in this worker (a tied head: the embedding); None if the model
        has no such parameter."""
        try:
            return self._logra_slot(name)
        except (KeyError, AttributeError):
            config = getattr(getattr(self.model_runner, "model_config", None), "hf_config", None)
            if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
                return self._logra_whole_slot("model.embed_tokens.weight")  # vLLM's loader skips a tied head
            return None

    def _logra_whole_shape(self, name: str) -> tuple[int, ...] | None:
        """The shape of the trainer's parameter `name` (the whole tensor, whatever this worker holds of it); None
        if the model has none."""
        slot = self._logra_whole_slot(name)
        return None if slot is None else slot.whole

    def _logra_weight_dtype(self, name: str) -> torch.dtype | None:
        """The dtype this worker holds the trainer's parameter `name` in (a whole tensor sent is copied into it);
        None if the model has none."""
        slot = self._logra_whole_slot(name)
        return None if slot is None else slot.tensor.dtype

    def _logra_copy(self, tensors: dict[str, torch.Tensor]) -> set:
        """Copy whole tensors into this worker's blocks; returns the layers to re-pack (`_logra_repack`)."""
        touched, rest, written = set(), [], set()
        for name, full in tensors.items():
            try:
                slot = self._logra_slot(name)
            except KeyError:
                rest.append((name, full))  # e.g. lm_head.weight when tied: vLLM's own loader knows to skip it
                continue
            block = full[slot.rows] if slot.cols is None else full[slot.rows, slot.cols]
            slot.tensor.copy_(block)
            touched.add(slot.layer)
            if slot.layer is None:
                written.add(slot.tensor.untyped_storage().data_ptr())
        if rest:
            self._logra_model().load_weights(iter(rest))
        return touched | self._logra_packed_users(written)

    def _logra_packed_users(self, storages: set[int]) -> set:
        """The non-linear modules whose CPU kernel packed a copy of one of these storages' weights: the embedding,
        and an LM head tied to it (a module of its own sharing the embedding's weight, packed for the logits GEMM
        apart). Without a re-pack the logits would go on using the old embedding."""
        if not storages:
            return set()
        return {module for module in self._logra_model().modules()
                if hasattr(module, "cpu_linear") and not _is_linear(module) and getattr(module, "weight", None)
                is not None and module.weight.numel() > 0 and module.weight.untyped_storage().data_ptr() in storages}

    @torch.no_grad()
    def logra_blocks(self, names: list[str], seed: int | None = None) -> bytes:
        """This rank's blocks of the named tensors — or, with a seed, their fingerprints — keyed "name|row|col"."""
        out, previous = {}, None
        for name in names:
            module = self._logra_linear(name)[0]
            if self._logra_reads_trainer() and module is not previous:
                self._logra_drop_unpacked()  # read, unchanged: its kernel holds it still (q, k and v share one)
            previous = module
            slot = self._logra_slot(name)
            col = 0 if slot.cols is None else slot.cols.start
            tensor = slot.tensor
            if slot.layer is not None and hasattr(slot.layer, "params_dtype"):
                # On CPUs with AMX, vLLM's kernel for small GEMMs keeps a bf16 layer's bias in float32: the same
                # numbers (every write here copies bf16 values in), answered in the dtype the trainer holds.
                tensor = tensor.to(slot.layer.params_dtype)
            value = tensor if seed is None else fingerprint(tensor, seed, col)
            out[f"{name}|{slot.rows.start}|{col}"] = value.clone()
        if self._logra_reads_trainer():
            self._logra_drop_unpacked()
        return pack_tensors(out)
