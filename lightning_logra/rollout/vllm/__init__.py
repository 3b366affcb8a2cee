"""The vLLM rollout engine, file by file: `engine.py` holds `VLLMEngine` (generation, weight syncs, its life cycle);
`launch.py` how it starts (the arguments it builds for `vllm.LLM`, the environment of the engine's processes);
`watchdog.py` the watch over its calls (deadlines, dead processes, kills, restarts); `worker.py` the worker extension
that runs inside each vLLM worker and changes its weights; `compat.py` the check of the vLLM internals these use;
`outputs.py` what both vLLM engines (this one and `RemoteEngine`) make of vLLM's answers; `kv_cache.py` the KV cache
sized for the run (one step's sequences at the engine's context).
"""

from lightning_logra.rollout.vllm.engine import VLLMEngine
from lightning_logra.rollout.vllm.launch import (
    CPU_BATCHED_TOKENS,
    WORKER_EXTENSION,
    eager_by_default,
    model_context,
    whole_prefills,
)
from lightning_logra.rollout.vllm.watchdog import EngineDied, EngineStalled

__all__ = ["CPU_BATCHED_TOKENS", "WORKER_EXTENSION", "EngineDied", "EngineStalled", "VLLMEngine", "eager_by_default",
           "model_context", "whole_prefills"]
