"""The GPU configs of sharded training: their headers' per-GPU memory arithmetic, recomputed from the published shapes
of the models they name (built on the meta device: no weights, no download) and the configs' own sketch settings."""

import math
import re
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from conftest import CONFIGS
from lightning_logra.sketch.projection import storage_dtype
from lightning_logra.train.strategies.fsdp import SketchFSDPStrategy, shard_rows

# config.json of Qwen/Qwen2.5-7B and Qwen/Qwen2.5-32B
SHAPES = {
    "qwen7b_fsdp.yaml": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                             num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen32b_fsdp.yaml": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                              num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}
GB = 1e9


def _header(config: Path) -> dict[str, float]:
    """The `#   <name>  <GB>` lines of a config's header."""
    return {name: float(value) for name, value in re.findall(r"^#   (\w+) +([\d.]+) ", config.read_text(), re.M)}


def _per_gpu(model: torch.nn.Module, strategy: SketchFSDPStrategy, world: int) -> dict[str, float]:
    """What the largest rank (rank 0: torch.chunk gives it the most rows) holds, in GB, for bf16 weights."""
    sketch = strategy.config
    handles = sketch.install(model)  # raises if the rank does not fit a target matrix
    head = set(model.get_output_embeddings().parameters())
    carriers = {layer.sketch_param for layer in handles.values()}
    weights = 0
    for param in model.parameters():
        if param in carriers:
            continue
        rows = param.shape[0] if param in head else len(range(param.shape[0])[shard_rows(param.shape[0], 0, world)])
        weights += rows * math.prod(param.shape[1:]) * 2  # bf16
    r = sketch.rank
    sketches = sum(layer.out_features * r * 4 for layer in handles.values())
    state = sum(2 * len(range(layer.out_features)[shard_rows(layer.out_features, 0, world)]) * r * 4
                for layer in handles.values())  # sketch Adam: m and v
    buffer = sum(math.ceil(layer.out_features / world) * world * r * 4 for layer in handles.values())
    # A in bf16 where its entries are exact there (Rademacher at rank 256), else fp32
    projection_bytes = storage_dtype(r, sketch.distribution, torch.bfloat16).itemsize
    projections = sum(r * layer.in_features * projection_bytes for layer in handles.values())
    projections = projections if sketch.cache_projection else 0
    return {"weights": weights / GB, "sketches": sketches / GB, "sketch_state": state / GB,
            "reduce_buffer": buffer / GB, "projections": projections / GB}


def _engine_per_gpu(model: torch.nn.Module, config: Qwen2Config, engine, sequences_per_gpu: int) -> dict[str, float]:
    """What the vLLM engine holds on each GPU while it generates, in GB, for bf16 weights and KV cache: its share of
    the whole model (1/tensor_parallel_size: one engine per tensor-parallel group of ranks, or a whole copy per rank),
    and the KV cache of every sequence its group generates at max_model_len, for the kv heads a GPU holds."""
    tp = engine.options["tensor_parallel_size"]
    # the model's own parameters: not the sketch carriers (stride-0 views of one zero)
    weights = sum(p.numel() for n, p in model.named_parameters() if not n.endswith("sketch_param")) * 2 / tp
    head_dim = config.hidden_size // config.num_attention_heads
    kv_heads = max(1, config.num_key_value_heads // tp)  # vLLM replicates kv heads when TP exceeds their count
    tokens = sequences_per_gpu * tp * engine.options["max_model_len"]
    kv_cache = tokens * config.num_hidden_layers * 2 * kv_heads * head_dim * 2
    return {"engine_weights": weights / GB, "engine_kv_cache": kv_cache / GB}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_headers_memory_arithmetic_is_the_models(run_cli, name):
    # the GPU config, checked on this CPU machine by overriding only where it runs
    cli = run_cli(CONFIGS / name, "--trainer.accelerator", "cpu", "--trainer.precision", "32-true", fast=False,
                  run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, SketchFSDPStrategy) and cli.trainer.num_devices == 8
    assert strategy.config.hparams()["sketch/optimizer"] == "SketchAdam"  # two state tensors (m, v) per sketch
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[name]))
    computed = _per_gpu(model, strategy, world=8)
    # The configs generate with vLLM: each rank's engine whole (7B), or one engine per node in the trainer's ranks,
    # tensor-parallel (32B), asleep during the update.
    engine, hp = cli.model.engine, cli.model.hparams
    assert type(engine).__name__ == "VLLMEngine" and engine.sleep_between_rollouts
    assert engine.placement == ("trainer_ranks" if name == "qwen32b_fsdp.yaml" else "processes")
    sequences = cli.datamodule.batch_size // 8 * hp.sampling.num_generations  # per GPU: its share of the prompts
    assert engine.options["max_model_len"] >= cli.datamodule.max_prompt_length + hp.sampling.max_new_tokens
    computed |= _engine_per_gpu(model, Qwen2Config(**SHAPES[name]), engine, sequences)
    stated = _header(CONFIGS / name)
    assert set(computed) <= set(stated)
    for key, value in computed.items():
        assert stated[key] == pytest.approx(value, abs=0.006), (key, stated[key], value)
    # The engine's share of each 80 GB GPU holds its weights and KV cache, with room for its activations (~1-2 GB).
    engine_share = engine.options["gpu_memory_utilization"] * 80
    assert engine_share >= computed["engine_weights"] + computed["engine_kv_cache"] + 1.0
    # And beside it, while generating, the trainer's resident part fits: weights, sketches, state, projections.
    resident = sum(computed[key] for key in ("weights", "sketches", "sketch_state", "projections"))
    assert resident + engine_share < 0.6 * 80
