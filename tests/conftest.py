"""Shared fixtures: tiny models built from a config (no downloads exist here)."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

SKETCH_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_tiny_qwen2(seed: int = 0, dtype: torch.dtype = torch.float32) -> Qwen2ForCausalLM:
    """A 2-layer Qwen2 (hidden 64, MLP 128, GQA 4/2 heads) with random weights."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    return Qwen2ForCausalLM(config).to(dtype).eval()


@pytest.fixture
def tiny_qwen2() -> Qwen2ForCausalLM:
    return make_tiny_qwen2()
