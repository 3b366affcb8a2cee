"""SIGTERM / SIGUSR1: the step in progress ends, a checkpoint of it is saved where `--ckpt_path` finds it, and the
run exits with 128 + the signal's number, every rank at the same step (callbacks/signals.py)."""

import glob
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_logra.callbacks import SaveOnSignal
from lightning_logra.callbacks.signals import agree, last_checkpoint_path

SAVED = re.compile(r"(SIG\w+): saved a checkpoint of step (\d+) to (\S+); exiting with status (\d+)\. "
                   r"Resume with --ckpt_path (\S+)")


def _run(run_cli, config, root, steps, *extra, **how):
    """A tiny run (conftest's run_cli) validating only at its end, its reward computed in the trainer's process (no
    reward process to start)."""
    return run_cli(config, "--trainer.val_check_interval", str(steps), "--model.reward_timeout_s", "null", *extra,
                   steps=steps, root=root, **how)


# ---- the parts ------------------------------------------------------------------------------------------------------


def test_every_run_of_the_command_line_saves_on_signal_and_a_configured_one_replaces_it(run_cli):
    callbacks = run_cli("tiny_arith", fast=False, run=False).trainer.callbacks
    assert sum(isinstance(c, SaveOnSignal) for c in callbacks) == 1
    own = run_cli("tiny_arith", "--trainer.callbacks+=lightning_logra.callbacks.SaveOnSignal", fast=False,
                  run=False).trainer.callbacks
    assert sum(isinstance(c, SaveOnSignal) for c in own) == 1


def test_the_checkpoint_goes_where_resumption_finds_the_last_one(tmp_path):
    class StepNamed(ModelCheckpoint):
        CHECKPOINT_NAME_LAST = "last-{step}"

    def trainer(**kwargs):
        return Trainer(default_root_dir=tmp_path, accelerator="cpu", **kwargs)

    assert last_checkpoint_path(trainer(callbacks=[ModelCheckpoint(tmp_path / "own")], logger=False)) == str(
        tmp_path / "own" / "last.ckpt")
    assert last_checkpoint_path(trainer(callbacks=[StepNamed(tmp_path / "own")], logger=False)) == str(
        tmp_path / "own" / "last-step=0.ckpt")
    # no ModelCheckpoint: where it would have put its checkpoints
    logger = TensorBoardLogger(tmp_path, name="run", version=3)
    assert last_checkpoint_path(trainer(enable_checkpointing=False, logger=logger)) == str(
        tmp_path / "run" / "version_3" / "checkpoints" / "last.ckpt")
    assert last_checkpoint_path(trainer(enable_checkpointing=False, logger=False)) == str(
        tmp_path / "checkpoints" / "last.ckpt")


def test_ranks_agree_on_the_highest_signal_any_of_them_received():
    def other_rank_sent(value):
        def reduce(tensor, reduce_op):
            assert reduce_op == "max"
            return torch.maximum(tensor, torch.tensor(value))
        return SimpleNamespace(world_size=2, strategy=SimpleNamespace(root_device=torch.device("cpu"), reduce=reduce))

    assert agree(other_rank_sent(0), 0) == 0
    assert agree(other_rank_sent(signal.SIGUSR1), 0) == signal.SIGUSR1  # this rank received nothing
    assert agree(other_rank_sent(signal.SIGUSR1), signal.SIGTERM) == signal.SIGTERM


def _trainer_stub(received_sigterm=False):
    return SimpleNamespace(received_sigterm=received_sigterm, world_size=1, is_global_zero=True,
                           strategy=SimpleNamespace(launcher=None))


def test_the_handler_only_records_the_highest_signal_and_the_previous_handlers_come_back():
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    callback = SaveOnSignal()
    callback.on_train_start(_trainer_stub(), None)
    try:
        # else the signals below would end pytest
        assert signal.getsignal(signal.SIGTERM) == signal.getsignal(signal.SIGUSR1) == callback._record
        signal.raise_signal(signal.SIGUSR1)
        assert callback.received == signal.SIGUSR1
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGUSR1)
        assert callback.received == signal.SIGTERM
    finally:
        callback.on_train_end(_trainer_stub(), None)
    assert {signum: signal.getsignal(signum) for signum in before} == before


def test_a_sigterm_lightning_took_before_training_exits_without_a_checkpoint(caplog):
    # Between Lightning's own registration and training's start, its handler takes SIGTERM (and would end the run
    # with status 0 at the end of the first step).
    before = signal.getsignal(signal.SIGTERM)
    callback = SaveOnSignal()
    with pytest.raises(SystemExit) as info:
        callback.on_train_start(_trainer_stub(received_sigterm=True), None)
    callback.on_exception(_trainer_stub(), None, info.value)
    assert info.value.code == 143
    assert "SIGTERM before the first training step of this run: nothing new to save" in caplog.text
    assert signal.getsignal(signal.SIGTERM) is before


def test_outside_the_main_thread_it_warns_and_leaves_the_handlers_alone():
    before = signal.getsignal(signal.SIGUSR1)
    callback = SaveOnSignal()
    with pytest.warns(UserWarning, match="outside the main thread"):
        thread = threading.Thread(target=callback.on_train_start, args=(_trainer_stub(), None))
        thread.start()
        thread.join()
    assert signal.getsignal(signal.SIGUSR1) is before


# ---- runs in this process (SIGUSR1 raised by a callback, while SaveOnSignal's handler is installed) ---------------


@pytest.fixture
def one_thread():
    """Runs in this process on one thread, as the subprocesses below (OMP_NUM_THREADS=1): on a shared 2-core machine
    a run's two threads spend most of their time waiting for each other (10 s against 1 s here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class RaiseSignal(Callback):
    """Raises SIGUSR1 in this process once: in the sanity check, or at the start of the validation or the training
    step that comes after `step` steps."""

    def __init__(self, when: str, step: int = 0) -> None:
        self.when, self.step, self.sent = when, step, False

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._raise(trainer, "sanity check" if trainer.sanity_checking else "validation")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._raise(trainer, "step")

    def _raise(self, trainer, now: str) -> None:
        if self.sent or now != self.when or trainer.global_step != self.step:
            return
        handler = signal.getsignal(signal.SIGUSR1)
        assert isinstance(getattr(handler, "__self__", None), SaveOnSignal)  # else the signal would end pytest
        self.sent = True
        signal.raise_signal(signal.SIGUSR1)


def _raise(when: str, step: int = 0) -> str:
    return '--trainer.callbacks+={"class_path": "test_signals.RaiseSignal", "init_args": ' \
           f'{{"when": "{when}", "step": {step}}}}}'


@pytest.mark.integration
@pytest.mark.parametrize("when, step, max_steps, saved", [
    ("validation", 2, 10, 3),  # the validation after step 2: saved at the end of step 3
    ("step", 3, 10, 4),  # step 4, after which a validation is due: saved, then the validation is skipped
    ("step", 2, 3, 3),  # the last step: saved, and the run exits 138 where it would have finished
], ids=["in a validation", "before a validation", "in the last step"])
def test_a_signal_in_this_process_saves_at_the_next_step_end(run_cli, tmp_path, caplog, one_thread, when, step,
                                                             max_steps, saved):
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    with pytest.raises(SystemExit) as info:
        _run(run_cli, "tiny_arith", tmp_path, max_steps, "--trainer.val_check_interval", "2", _raise(when, step))
    assert info.value.code == 128 + signal.SIGUSR1 == 138
    line = SAVED.search(caplog.text)
    assert line and line.group(1, 2, 4) == ("SIGUSR1", str(saved), "138")
    path = line.group(3)
    assert line.group(5) == path and path.endswith(os.path.join("version_0", "checkpoints", "last.ckpt"))
    assert torch.load(path, weights_only=False)["global_step"] == saved
    events = EventAccumulator(glob.glob(str(tmp_path / "**" / "events.out.tfevents.*"), recursive=True)[0])
    events.Reload()
    assert len(events.Scalars("train/loss")) == saved  # the saved step's metrics too
    assert len(events.Scalars("val/pass@1")) == (saved - 1) // 2  # every 2 steps, none after the saved one
    assert {signum: signal.getsignal(signum) for signum in before} == before  # nothing of the run is left behind


@pytest.mark.integration
def test_a_signal_in_the_sanity_check_exits_before_the_first_step_without_a_checkpoint(run_cli, tmp_path, caplog,
                                                                                        one_thread):
    with pytest.raises(SystemExit) as info:
        _run(run_cli, "tiny_arith", tmp_path, 10, "--trainer.num_sanity_val_steps", "1", _raise("sanity check"))
    assert info.value.code == 138
    assert "SIGUSR1 before the first training step of this run: nothing new to save, exiting with status 138 " \
           "without a checkpoint" in caplog.text
    assert not glob.glob(str(tmp_path / "**" / "*.ckpt"), recursive=True)


# ---- the command line in processes of its own, signalled from outside ---------------------------------------------


def _start(run_cli, config: str, root: Path, steps: int, *extra: str) -> subprocess.Popen:
    """`python cli.py fit` in the background, its output in `root/out.log`; conftest.StepMarks marks each step."""
    return _run(run_cli, config, root, steps, *extra, "--trainer.callbacks+=conftest.StepMarks", subprocess=True,
                wait=False)


def _mark(root: Path, rank: int) -> tuple[int, int] | None:
    """(global step, process id) of the rank's last finished step, as conftest.StepMarks wrote it."""
    path = root / f"step.rank{rank}"
    if not path.exists():
        return None
    step, pid = path.read_text().split()
    return int(step), int(pid)


def _wait_for_step(run: subprocess.Popen, root: Path, ranks: int, step: int) -> list[int]:
    """Polls until every rank has finished `step` steps; returns their process ids."""
    deadline = time.monotonic() + 300
    while True:
        marks = [_mark(root, rank) for rank in range(ranks)]
        if all(mark is not None and mark[0] >= step for mark in marks):
            return [pid for _, pid in marks]
        assert run.poll() is None, (root / "out.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.05)


def _stopped(run: subprocess.Popen, root: Path, status: int) -> tuple[int, str, str]:
    """Waits for the signalled run; returns (its step, the checkpoint path, the log line's signal)."""
    assert run.wait(timeout=300) == status, (root / "out.log").read_text()[-3000:]
    saved = SAVED.search((root / "out.log").read_text())
    assert saved and int(saved.group(4)) == status and saved.group(5) == saved.group(3)
    return int(saved.group(2)), saved.group(3), saved.group(1)


def _state(root: Path) -> dict:
    path, = glob.glob(str(root / "**" / "checkpoints" / "last.ckpt"), recursive=True)  # not latest/
    return torch.load(path, weights_only=False)


def _assert_equal(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}/{i}")
    else:
        assert a == b, where


@pytest.mark.integration
def test_sigterm_saves_the_step_exits_143_and_a_resume_equals_an_uninterrupted_run(run_cli, tmp_path):
    steps = 8  # the uninterrupted run; the signalled one stops at about step 3 (asserted below)
    straight = _start(run_cli, "tiny_arith", tmp_path / "straight", steps)  # beside it: one core each
    run = _start(run_cli, "tiny_arith", tmp_path / "stopped", 200)
    _wait_for_step(run, tmp_path / "stopped", ranks=1, step=2)
    run.send_signal(signal.SIGTERM)
    step, path, name = _stopped(run, tmp_path / "stopped", 143)
    assert name == "SIGTERM" and 2 <= step < steps
    assert _mark(tmp_path / "stopped", 0)[0] == step  # no step after the saved one
    assert torch.load(path, weights_only=False)["global_step"] == step
    # the saved step's metrics reached the logger before the exit
    events = EventAccumulator(glob.glob(str(tmp_path / "stopped" / "**" / "events.out.tfevents.*"), recursive=True)[0])
    events.Reload()
    assert len(events.Scalars("train/loss")) == step

    assert straight.wait(timeout=300) == 0, (tmp_path / "straight" / "out.log").read_text()[-3000:]
    resumed = _start(run_cli, "tiny_arith", tmp_path / "resumed", steps, "--ckpt_path", path)
    assert resumed.wait(timeout=300) == 0, (tmp_path / "resumed" / "out.log").read_text()[-3000:]
    a, b = _state(tmp_path / "straight"), _state(tmp_path / "resumed")
    assert a["global_step"] == b["global_step"] == steps
    _assert_equal(a["state_dict"], b["state_dict"])  # every policy weight
    _assert_equal(a["optimizer_states"], b["optimizer_states"])  # and the sketch optimizer's state
    saved = torch.load(path, weights_only=False)["state_dict"]
    assert any(not torch.equal(saved[n], a["state_dict"][n]) for n in saved)  # the resumed steps changed something


@pytest.mark.integration
def test_sigusr1_to_one_rank_stops_both_ranks_at_the_same_step(run_cli, tmp_path):
    run = _start(run_cli, "tiny_arith_ddp", tmp_path, 200)
    _, other = _wait_for_step(run, tmp_path, ranks=2, step=2)
    os.kill(other, signal.SIGUSR1)  # rank 1 only, which rank 0 started: rank 0 hears of it through the agreement
    step, path, name = _stopped(run, tmp_path, 138)
    assert name == "SIGUSR1"
    assert [_mark(tmp_path, rank)[0] for rank in (0, 1)] == [step, step]
    assert [(tmp_path / f"exit.rank{rank}").read_text() for rank in (0, 1)] == ["138", "138"]
    with pytest.raises(ProcessLookupError):
        os.kill(other, 0)  # rank 0 waited for rank 1 before it exited itself
    assert torch.load(path, weights_only=False)["global_step"] == step
