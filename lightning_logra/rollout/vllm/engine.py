"""The vLLM rollout engine: `vllm.LLM` with its own copy of the weights, kept in step by `Update`s.

The trainer owns the weights; the engine's copy follows through `load_weights` (full tensors: at the start, and to
repair drift or a restart) and `apply_update` (per sketched matrix F = α·η·U and A's seed: O(d·r) numbers). Every
call reaches each vLLM worker through `collective_rpc` and `LogRAWorkerExtension`. A full load travels as
safetensors bytes, or, when the engine runs on the trainer's GPU, as CUDA IPC handles to the trainer's own tensors
(`handles.py`: nothing serialized). Before the engine starts, the vLLM internals it uses are checked
(`compat.py`), and its layers once it has loaded the model. How it starts (the arguments for `vllm.LLM`, the
environment of its processes): `launch.py`.

If the engine's process dies, the next call starts a new one, has the weight sync load the trainer's weights into it
(`reload_after_restart`), and carries on, so the training step that met the dead engine is not lost. A call
that has not returned within `call_timeout_s` (a stopped or deadlocked engine) is treated the same way: the engine's
processes are killed and it is restarted. A call still under way some seconds after the run received SIGTERM or
SIGUSR1 (`base/stop.py`) kills the engine and raises StopRequested instead, so that a signal always ends the run. And
the engine's processes watch the trainer's: if it dies, even by SIGKILL, they kill themselves rather than keep
their memory (gigabytes) forever. The watch, the kills and the restarts: `watchdog.py`.

With several trainer processes (DDP, FSDP), each rank starts an engine of its own (`place`): in processes that
know nothing of the trainer's process group, on that rank's GPU, holding the whole model. Or (`placement:
trainer_ranks`) the engine's workers are the trainer's own processes (vLLM's external launcher): each group of
`tensor_parallel_size` consecutive ranks runs one tensor-parallel engine, each rank one worker holding its shard of
every weight, as TRL's colocate mode and verl do; the ranks of a group generate their prompts together.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from lightning_logra.algo.update import Update
from lightning_logra.base.batch import Rollout
from lightning_logra.base.settings import check_at_least, check_positive, is_number
from lightning_logra.rollout.engine import RolloutEngine, SamplingParams
from lightning_logra.rollout.handles import FULL_LOADS, choose_full_load, device_id, share_tensors
from lightning_logra.rollout.tensor_bytes import pack_tensors, unpack_tensors
from lightning_logra.rollout.vllm.launch import EngineLaunch
from lightning_logra.rollout.vllm.outputs import SEED_MASK, assemble_blocks, samples_to_rollout
from lightning_logra.rollout.vllm.watchdog import EngineWatchdog

log = logging.getLogger(__name__)

PLACEMENTS = ("processes", "trainer_ranks")


class VLLMEngine(EngineLaunch, EngineWatchdog, RolloutEngine):
    """Generation with vLLM. Configure it in YAML under `model.rollouts.engine`; it starts when the model is set up.

    Args:
        dtype: the engine's weight dtype ("auto" takes the checkpoint's; "float32" on the CPU backend for tests).
        max_model_len: the longest prompt + completion; None takes the model's own limit.
        gpu_memory_utilization: the share of device memory vLLM may take (of host memory on the CPU backend,
            where it must stay ≤ 0.3 here). Colocated with training on one GPU, leave room for the trainer.
        kv_cache_gib: the KV cache, in GiB. None (the default): sized for the run (`kv_cache.py`): one training
            step's sequences on this rank (data.batch_size / ranks × model.sampling.num_generations) at
            max_model_len tokens each, or the share above when that is smaller; an engine not told the run's batch
            takes the share.
        tensor_parallel_size: GPUs the engine is sharded over.
        enforce_eager: no CUDA graphs / compilation. None (the default): eager on the CPU backend (which has no
            CUDA graphs), CUDA graphs on a GPU, where decoding small batches is several times faster with them; their
            capture (and vLLM's torch.compile before it) lengthens every engine start, restarts included. Sleep mode
            keeps the captured graphs: vLLM's allocator maps the weights and graph memory back at their addresses on
            waking, and the worker changes weights only in place.
        separate_process: run the engine core in its own process (vLLM's default). A crash there is survivable:
            the engine restarts. False runs it inside the trainer's process (faster start, no restart).
        sleep_between_rollouts: free the engine's device memory (level-1 sleep: weights to host memory, KV cache
            dropped) while the trainer runs its backward passes; GPU only.
        max_restarts: how many times in a row a dead or stalled engine is restarted before the error is raised.
        call_timeout_s: a generation or weight-sync call that has not returned after this many seconds counts as a
            stalled engine: its processes are killed and it is restarted (with `separate_process`; an engine in this
            process cannot be killed, so it has no deadline). Generous by default: one call generates a whole
            step's rollouts, which takes minutes for long completions on large batches. None: no deadline.
        load_chunk_mib: a full load is sent in chunks of this size (each is one message).
        full_load: how full loads reach the engine. "bytes": serialized (safetensors), through host memory; "shared":
            by reference (`handles.py`): CUDA IPC handles to the trainer's tensors on its GPU, shared memory for
            tensors on the CPU; "auto" (the default): shared when the engine is one worker, in a process of its own,
            on the GPU every tensor is on (colocated), bytes otherwise (the CPU backend, another GPU, tensor
            parallelism, `separate_process: false`). `handles.choose_full_load` says which settings can work.
        placement: with several trainer processes, where the engines run. "processes" (the default): each rank
            starts an engine of its own in processes of its own (`separate_process: true`), one worker
            (`tensor_parallel_size: 1`) on that rank's device holding the whole model. "trainer_ranks": the workers
            are the trainer's processes themselves (vLLM's external launcher; `separate_process` does not apply):
            each group of `tensor_parallel_size` consecutive ranks runs one tensor-parallel engine, each rank
            holding 1/`tensor_parallel_size` of every weight — for models whose whole copy does not fit beside the
            trainer's shards. The ranks of a group generate their prompts together; an engine that dies takes its
            trainer with it (no restart).
        engine_kwargs: anything else for `vllm.LLM`.

    With several trainer processes `gpu_memory_utilization` is the share each engine (or worker) takes: on the CPU
    backend, of the host memory that all ranks' engines share.
    """

    def __init__(
        self,
        dtype: str = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.3,
        kv_cache_gib: float | None = None,
        tensor_parallel_size: int = 1,
        enforce_eager: bool | None = None,
        seed: int = 0,
        separate_process: bool = True,
        sleep_between_rollouts: bool = False,
        max_restarts: int = 3,
        call_timeout_s: float | None = 3600.0,
        load_chunk_mib: int = 512,
        full_load: str = "auto",
        placement: str = "processes",
        engine_kwargs: dict | None = None,
    ) -> None:
        if not (is_number(gpu_memory_utilization) and 0 < gpu_memory_utilization <= 1):
            raise ValueError(f"engine.gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        check_positive("engine.kv_cache_gib", kv_cache_gib, "number of GiB", null="sized for the run")
        check_positive("engine.tensor_parallel_size", tensor_parallel_size, integer=True)
        check_at_least("engine.max_restarts", max_restarts, 0, integer=True)
        check_positive("engine.load_chunk_mib", load_chunk_mib, "number of MiB", integer=True)
        self.options = dict(
            dtype=dtype,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager,
            seed=seed,
            enable_sleep_mode=sleep_between_rollouts,
            **({} if kv_cache_gib is None else {"kv_cache_memory_bytes": int(kv_cache_gib * 2**30)}),
            **(engine_kwargs or {}),
        )
        if full_load not in FULL_LOADS:
            raise ValueError(f"engine.full_load must be one of {', '.join(FULL_LOADS)}, got {full_load!r}")
        check_positive("engine.call_timeout_s", call_timeout_s, "number of seconds", null="no deadline")
        if placement not in PLACEMENTS:
            raise ValueError(f"engine.placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
        self.placement = placement
        self.separate_process = separate_process and placement == "processes"
        self.call_timeout_s = call_timeout_s
        self.sleep_between_rollouts = sleep_between_rollouts
        self.max_restarts = max_restarts
        self.load_chunk_bytes = load_chunk_mib * 2**20
        self.full_load = full_load
        self.worker_devices: list[str] = []  # `handles.device_id` of each worker's weights, asked at each start
        self.last_full_load: str | None = None  # the path the last full load took: "bytes" or "shared"
        self.llm = None
        self.model_path: str | None = None
        self.pad_token_id = 0
        self.stop_token_ids: list[int] = []
        self.restarts = 0
        self._watched: list = []  # the engine's processes as it started (psutil), whose end a call notices
        self._asleep = False
        self.rank, self.world_size = 0, 1
        self.device: torch.device | None = None  # the trainer's device, when `place` set it
        self.group = None  # placement trainer_ranks: the ranks of this rank's engine (None: this rank alone)
        self.group_ranks = [0]
        self.sequences: int | None = None  # the most sequences one generation call asks for (`expect`)
        self.kv_cache_bytes: int | None = None  # what the started engine was given for its KV cache (None: the share)
        self.trainer_tensors: Callable[[], dict[str, torch.Tensor]] | None = None  # `read_trainer_tensors`

    # ---- life cycle ---------------------------------------------------------------------------------------------

    def place(self, rank: int, world_size: int, device: torch.device) -> None:
        tp = self.options["tensor_parallel_size"]
        if world_size > 1 and self.placement == "trainer_ranks":
            if world_size % tp:
                raise ValueError(f"model.rollouts.engine: placement trainer_ranks runs one engine per {tp} consecutive "
                                 f"ranks (engine.tensor_parallel_size); {world_size} ranks are not a multiple of it")
            # Every rank builds every group (a collective), and keeps its own.
            groups = [list(range(first, first + tp)) for first in range(0, world_size, tp)]
            self.group_ranks = groups[rank // tp]
            if tp > 1:
                self.group, _ = dist.new_subgroups_by_enumeration(groups)
        elif world_size > 1 and not self.separate_process:
            # vLLM's worker would run in the trainer's process, where torch.distributed is the trainer's already.
            raise ValueError("model.rollouts.engine: with several trainer processes each rank's engine must run in "
                             "processes of its own (engine.separate_process: true), or in the trainer's ranks "
                             "themselves (engine.placement: trainer_ranks)")
        elif world_size > 1 and tp != 1:
            raise ValueError("model.rollouts.engine: with several trainer processes each rank's engine runs on that "
                             f"rank's device alone; set engine.tensor_parallel_size: 1 (got {tp}), or "
                             "engine.placement: trainer_ranks for tensor-parallel engines in the trainer's ranks")
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)

    @property
    def in_trainer_ranks(self) -> bool:
        """Whether this engine's worker is this trainer process, one of a tensor-parallel group of ranks."""
        return self.placement == "trainer_ranks" and self.world_size > 1

    def another_turn(self, live: bool) -> bool:
        if self.group is None:
            return live
        everyone: list = [None] * len(self.group_ranks)
        dist.all_gather_object(everyone, live, group=self.group)
        return any(everyone)

    def runs_alongside(self) -> bool:
        # In the trainer's ranks (external launcher) or its process, the engine computes on the trainer's thread
        return self.separate_process and not self.in_trainer_ranks

    def expect(self, sequences: int) -> None:
        self.sequences = sequences

    def start(self, model: str, pad_token_id: int, stop_token_ids: list[int]) -> None:
        if self.llm is not None:
            return
        self.model_path, self.pad_token_id, self.stop_token_ids = model, pad_token_id, list(stop_token_ids)
        self._launch()

    def close(self) -> None:
        if self.llm is not None:
            try:
                self.llm.llm_engine.engine_core.shutdown()
            except Exception as err:  # a dead engine may fail to shut down cleanly; it is being dropped anyway
                log.debug("vLLM shutdown: %s", err)
            self.llm = None
            gc.collect()

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def max_model_len(self) -> int | None:
        return self.options["max_model_len"]

    def memory_bytes(self) -> int:
        """Host memory (RSS) of the engine's own processes — the engine core and its workers; 0 when it runs in
        this process, whose memory already includes it. Device memory shows in `memory/device_used_gib`."""
        import psutil  # a dependency of vLLM

        total = 0
        for process in self._engine_processes():
            try:
                total += process.memory_info().rss
            except psutil.NoSuchProcess:
                continue
        return total

    def _rpc(self, method: str, *args) -> list:
        return self.llm.collective_rpc(method, args=args)

    # ---- generation ---------------------------------------------------------------------------------------------

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingParams, seeds: list[int]) -> Rollout:
        from vllm import SamplingParams as VLLMSamplingParams

        mine = slice(0, len(prompt_ids))
        if self.group is not None:
            # A tensor-parallel engine in the trainer's ranks: every rank of the group must submit the same requests
            # (its workers run them in lockstep). The group's prompts, in rank order; each rank keeps its own rows.
            everyone: list = [None] * len(self.group_ranks)
            dist.all_gather_object(everyone, (prompt_ids, seeds), group=self.group)
            position = self.group_ranks.index(self.rank)
            first = sum(len(ids) for ids, _ in everyone[:position])
            mine = slice(first, first + len(prompt_ids))
            prompt_ids = [ids for part, _ in everyone for ids in part]
            seeds = [seed for _, part in everyone for seed in part]
        params = [
            VLLMSamplingParams(
                n=n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_new_tokens,
                stop_token_ids=self.stop_token_ids,
                logprobs=0,  # the sampled token's log-prob
                seed=seed & SEED_MASK,
                detokenize=False,
            )
            for seed in seeds
        ]
        requests = [{"prompt_token_ids": list(p)} for p in prompt_ids]

        def generate_then_sleep():  # one call, so that a stall while falling asleep is caught too
            outputs = self.llm.generate(requests, params, use_tqdm=False)
            if self.sleep_between_rollouts:
                self.llm.sleep(level=1)
                self._asleep = True
            return outputs

        outputs = self._with_restart(generate_then_sleep)[mine]
        completions, logprobs = [], []
        for output in outputs:
            for sample in sorted(output.outputs, key=lambda o: o.index):
                completions.append(list(sample.token_ids))
                logprobs.append([lp[t].logprob for t, lp in zip(sample.token_ids, sample.logprobs)])
        return samples_to_rollout(prompt_ids[mine], n, completions, logprobs, self.pad_token_id)

    # ---- weights ------------------------------------------------------------------------------------------------

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> int:
        """Returns the bytes sent: the serialized tensors, or on the shared path the handles alone."""
        path = choose_full_load(self.full_load, self.worker_devices, {device_id(t.device) for t in tensors.values()},
                                self.separate_process)
        sent = 0
        for chunk in _chunks(tensors, self.load_chunk_bytes):
            if path == "shared":
                data, kept = share_tensors(chunk)  # kept alive until the workers have copied them
                self._with_restart(lambda data=data: self._rpc("logra_load_shared", data), retry=False)
                on_gpu = any(t.is_cuda for t in kept)
                del kept
                if on_gpu:
                    torch.cuda.ipc_collect()  # frees copies made for CUDA IPC once the workers closed their handles
            else:
                data = pack_tensors(chunk)
                self._with_restart(lambda data=data: self._rpc("logra_load", data), retry=False)
            sent += len(data)
        self._with_restart(self._after_weight_change, retry=False)
        self.last_full_load = path
        return sent

    def read_trainer_tensors(self, tensors: Callable[[], dict[str, torch.Tensor]]) -> None:
        # In the trainer's process the worker reads them by reference (the CPU backend computes from them, where the
        # dtypes agree). A restarted engine keeps copies of its own again (what its start loads stays correct).
        if self.separate_process:
            return
        first, again = tensors(), tensors()
        if any(first[name].data_ptr() != again[name].data_ptr() for name in first):
            return  # made afresh at each call (a LoRA run's merged weights): a copy of every matrix at every update
        if all(self._with_restart(lambda: self._rpc("logra_read_trainer", first))):
            self.trainer_tensors = tensors

    def apply_update(self, update: Update) -> int:
        data = update.to_bytes()
        trainer = None if self.trainer_tensors is None else self.trainer_tensors()  # the update already merged
        # After a restart the engine holds the trainer's current weights (update included): nothing to redo.
        self._with_restart(lambda: (self._rpc("logra_apply", data, trainer), self._after_weight_change()),
                           retry=False)
        return len(data)

    def _after_weight_change(self) -> None:
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def fingerprints(self, names: list[str], seed: int) -> dict[str, torch.Tensor]:
        return assemble_blocks(self._blocks(names, seed), add_columns=True)

    def weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        return assemble_blocks(self._blocks(names, None), add_columns=False)

    def _blocks(self, names: list[str], seed: int | None) -> dict[str, torch.Tensor]:
        answers = self._with_restart(lambda: self._rpc("logra_blocks", list(names), seed))
        if self.group is not None:  # this rank's worker answered for its shards; the group's others hold the rest
            everyone: list = [None] * len(self.group_ranks)
            dist.all_gather_object(everyone, answers, group=self.group)
            answers = [answer for part in everyone for answer in part]
        blocks = {}
        for answer in answers:  # one per worker; tensor-parallel replicas give identical blocks under one key
            blocks.update(unpack_tensors(answer))
        return blocks


def _chunks(tensors: dict[str, torch.Tensor], limit: int) -> Iterable[dict[str, torch.Tensor]]:
    chunk, size = {}, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > limit:
            yield chunk
            chunk, size = {}, 0
        chunk[name] = tensor
        size += nbytes
    if chunk:
        yield chunk
