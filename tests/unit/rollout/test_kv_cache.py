"""vLLM's KV cache sized for the run (`rollout/vllm/kv_cache.py`, `VLLMEngine.expect`): the bytes asked for, by the
formula, from a saved model's config; the share kept where the options give a size, the run's batch is unknown or
the share is smaller. (A started engine that takes the size: tests/integration/vllm/test_overlap.py.)"""

import pytest
import torch
from transformers import Qwen2Config

from lightning_logra.rollout import VLLMEngine
from lightning_logra.rollout.vllm.kv_cache import CPU_BLOCK_TOKENS as BLOCK_TOKENS
from lightning_logra.rollout.vllm.kv_cache import cpu_blocks, kv_bytes_per_token, run_cache_bytes

GIB = 2**30


def _config(**overrides) -> Qwen2Config:
    shape = dict(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=300)
    return Qwen2Config(**{**shape, **overrides})


def test_a_token_holds_keys_and_values_of_every_layer():
    # 2 (K and V) · 3 layers · 2 key/value heads · 32 (128 / 4 heads) numbers each
    assert kv_bytes_per_token(_config(), "float32") == 2 * 3 * 2 * 32 * 4
    assert kv_bytes_per_token(_config(), "bfloat16") == 2 * 3 * 2 * 32 * 2
    assert kv_bytes_per_token(_config(head_dim=16), "half") == 2 * 3 * 2 * 16 * 2
    assert kv_bytes_per_token(_config(dtype=torch.bfloat16), "auto") == 2 * 3 * 2 * 32 * 2


def test_a_sequence_takes_whole_blocks():
    assert run_cache_bytes(32, 128, 10, 128) == 32 * 128 * 10
    assert run_cache_bytes(32, 129, 10, 128) == 32 * 2 * 128 * 10
    assert run_cache_bytes(32, 129, 10, 32) == 32 * 5 * 32 * 10
    assert run_cache_bytes(0, 5, 10, 32) == 32 * 10  # never less than one sequence


def test_the_cpu_backend_takes_blocks_of_32_tokens_unless_given():
    assert cpu_blocks({}) == {"block_size": 32}
    assert cpu_blocks({"block_size": 128}) == {}


@pytest.fixture
def model_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # conftest's size for the tests' engines
    _config().save_pretrained(tmp_path)
    return str(tmp_path)


def _cache(engine: VLLMEngine, model: str, sequences: int | None) -> dict:
    engine.model_path = model
    if sequences is not None:
        engine.expect(sequences)
    return engine._cache_for_run(dict(engine.options), cpu_backend=True)


def test_the_engine_asks_for_the_runs_sequences_at_its_longest_length(model_folder):
    per_token = 2 * 3 * 2 * 32 * 4
    engine = VLLMEngine(dtype="float32", max_model_len=200, gpu_memory_utilization=0.2)
    assert _cache(engine, model_folder, 32) == {"kv_cache_memory_bytes": 32 * 7 * BLOCK_TOKENS * per_token}
    # no max_model_len: the model's context (300 positions, 10 blocks)
    engine = VLLMEngine(dtype="float32", gpu_memory_utilization=0.2)
    assert _cache(engine, model_folder, 8) == {"kv_cache_memory_bytes": 8 * 10 * BLOCK_TOKENS * per_token}
    # a block size given is the one counted
    engine = VLLMEngine(dtype="float32", max_model_len=200, engine_kwargs={"block_size": 128})
    assert _cache(engine, model_folder, 32) == {"kv_cache_memory_bytes": 32 * 2 * 128 * per_token}


def test_the_share_stays_where_a_size_is_given_the_batch_unknown_or_the_share_smaller(model_folder, monkeypatch):
    given = VLLMEngine(kv_cache_gib=0.5)
    assert given.options["kv_cache_memory_bytes"] == GIB // 2
    assert _cache(given, model_folder, 32) == {}
    assert _cache(VLLMEngine(engine_kwargs={"kv_cache_memory_bytes": 123}), model_folder, 32) == {}
    with monkeypatch.context() as patch:
        patch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # vLLM's own size, in GiB, on the CPU backend
        assert _cache(VLLMEngine(), model_folder, 32) == {}
    assert _cache(VLLMEngine(), model_folder, None) == {}
    # 10⁷ sequences at 2 blocks of fp32 keys and values: 2.3 TiB, more than any machine's share
    assert _cache(VLLMEngine(dtype="float32", max_model_len=200), model_folder, 10**7) == {}


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), "1"])
def test_a_kv_cache_size_must_be_a_positive_number(value):
    with pytest.raises(ValueError, match="engine.kv_cache_gib must be a positive number of GiB"):
        VLLMEngine(kv_cache_gib=value)
