"""Qwen2.5 shapes with random weights: the models the benchmarks measure (the memory and time of a step, a sync's
bytes, a checkpoint's size do not depend on the weights' values), built directly in their dtype on their device."""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_logra.sketch.config import DEFAULT_TARGETS

# The shipped tiny model (hidden 128, 4 layers): its folder, and its tokenizer for the random-weight models saved
TINY_MODEL = Path(__file__).resolve().parents[2] / "lightning_logra" / "data" / "tiny_arith"

# Qwen2.5 sizes (their config.json); tie_word_embeddings as they ship. "tiny" is for tests.
SHAPES = {
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def qwen2_model(shape: str, dtype: torch.dtype, max_positions: int, device: str = "cpu",
                **overrides) -> torch.nn.Module:
    """A Qwen2 with random weights in the shape of a Qwen2.5 size (`SHAPES`), built directly in `dtype` on `device`:
    a 7B model built in fp32 first (30 GB) would not fit this machine, and one initialized on the CPU and then
    copied to a GPU would spend minutes drawing random numbers. `overrides` change config fields (fewer layers)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{**SHAPES[shape], **overrides}, max_position_embeddings=max_positions)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)


def is_target(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in DEFAULT_TARGETS
