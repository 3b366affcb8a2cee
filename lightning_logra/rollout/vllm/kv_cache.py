"""The vLLM engine's KV cache sized for the run: room for one step's generations, not a share of the machine.

Left to itself vLLM reserves `gpu_memory_utilization` of the device (of host memory on the CPU backend) for the
weights and the KV cache, whatever the run asks of it: at 0.2 of a 23 GiB machine, 4.6 GiB for a step of 32
completions of under 128 tokens, which need 0.2 GiB. Told how many sequences one generation call of the run holds at
most, the engine asks vLLM for a cache of that many sequences at its longest length (`kv_cache_memory_bytes`), when
that is less than the share would be. A call with more sequences (an evaluation's batch) still runs: vLLM schedules
as many at a time as the cache holds, the rest wait for room.
"""

from __future__ import annotations

import torch

# A KV-cache block, in tokens: a sequence takes whole blocks, and rows that share a prompt share its whole blocks
# (vLLM's prefix caching). vLLM's CPU backend would take 128 (its attention kernel takes multiples of 32); the engine
# asks for 32 there (`cpu_blocks`); a GPU's is vLLM's 16.
CPU_BLOCK_TOKENS = 32
GPU_BLOCK_TOKENS = 16

_DTYPES = {"half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16, "float": torch.float32,
           "float32": torch.float32}


def kv_bytes_per_token(config, dtype: str) -> int:
    """One token's keys and values over every layer: 2 · layers · key/value heads · head dim · bytes per number,
    for a transformers config and the engine's `dtype` ("auto": the config's)."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    if dtype == "auto":
        number = getattr(text, "dtype", None) or getattr(config, "dtype", None) or torch.float32
        number = getattr(torch, number) if isinstance(number, str) else number
    else:
        number = _DTYPES.get(dtype, torch.float32)
    return 2 * text.num_hidden_layers * kv_heads * head_dim * number.itemsize


def run_cache_bytes(sequences: int, max_model_len: int, per_token: int, block_tokens: int) -> int:
    """The cache `sequences` sequences of up to `max_model_len` tokens take, in whole blocks of `block_tokens` (at
    least one sequence's: vLLM refuses a cache that cannot hold its longest one)."""
    blocks = -(-max_model_len // block_tokens)
    return max(sequences, 1) * blocks * block_tokens * per_token


def cpu_blocks(options: dict) -> dict:
    """The KV-cache block of an engine on the CPU backend, unless the options give one: 32 tokens, not vLLM's 128
    there. A group's completions share their prompt's whole blocks, and a prompt of 60-80 tokens fills none of 128:
    each of a step's 32 sequences prefilled its prompt alone. With blocks of 32 the shipped SmolLM2 config's
    generation (4 prompts × 8 samples of 16 tokens) took 3.2 s against 6.9."""
    return {} if "block_size" in options else {"block_size": CPU_BLOCK_TOKENS}


def device_memory_bytes(cpu_backend: bool, device: torch.device | None) -> int:
    """What vLLM's share is a share of: the host's memory on the CPU backend, else the GPU's (`device`, or the
    current one)."""
    if cpu_backend:
        import psutil  # a dependency of vLLM

        return psutil.virtual_memory().total
    return torch.cuda.mem_get_info(device if device is not None and device.type == "cuda" else None)[1]
