"""SIGTERM / SIGUSR1: the step in progress ends, a checkpoint of it is saved where `--ckpt_path` finds it, and the
run exits with 128 + the signal's number, every rank at the same step (callbacks/signals.py)."""

import signal
import threading
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_logra.base.stop import STOP, StopRequested
from lightning_logra.callbacks import SaveOnSignal
from lightning_logra.callbacks.signals import agree, last_checkpoint_path
from lightning_logra.rollout.remote import NoServerLeft


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


@pytest.mark.parametrize("world_size, validating, saved", [(1, False, True), (2, False, False), (1, True, False)])
def test_a_stop_while_waiting_on_the_engine_saves_the_last_finished_step_with_one_process(
        tmp_path, caplog, world_size, validating, saved):
    # The trainer met StopRequested waiting on the engine (the engine killed past the grace): it saves as at a step
    # boundary, except where other ranks would have to join the save, or mid-validation.
    written = []
    trainer = SimpleNamespace(received_sigterm=False, world_size=1, is_global_zero=True, global_step=4,
                              strategy=SimpleNamespace(launcher=None), sanity_checking=False, validating=validating,
                              checkpoint_callback=None, log_dir=str(tmp_path),
                              save_checkpoint=lambda path, weights_only: written.append((path, weights_only)))
    callback = SaveOnSignal(engine_grace_s=5)
    callback.on_train_start(trainer, None)
    trainer.world_size = world_size
    signal.raise_signal(signal.SIGTERM)
    assert STOP.signum == signal.SIGTERM and STOP.grace_s == 5  # the engine's waits heed it
    callback.on_exception(trainer, None, StopRequested(signal.SIGTERM, "a call to the vLLM engine still under way"))
    path = str(tmp_path / "checkpoints" / "last.ckpt")
    if saved:
        assert written == [(path, False)]
        assert f"saved a checkpoint of step 4 (the last finished) to {path}; exiting with status 143" in caplog.text
    else:
        assert written == []
        assert "exiting with status 143 without a checkpoint" in caplog.text
    assert signal.getsignal(signal.SIGTERM) is not callback._record  # the handlers put back


def test_no_engine_server_left_saves_the_last_finished_step(tmp_path, caplog):
    # The run stopped with NoServerLeft at a step's rollouts, and only the periodic checkpoints were there to resume.
    written = []
    trainer = SimpleNamespace(received_sigterm=False, world_size=1, is_global_zero=True, global_step=7,
                              strategy=SimpleNamespace(launcher=None), sanity_checking=False, validating=False,
                              training=True, checkpoint_callback=None, log_dir=str(tmp_path),
                              save_checkpoint=lambda path, weights_only: written.append((path, weights_only)))
    callback = SaveOnSignal()
    callback.on_train_start(trainer, None)
    callback.on_exception(trainer, None, NoServerLeft("model.rollouts.engine: no engine server is left to generate on"))
    path = str(tmp_path / "checkpoints" / "last.ckpt")
    assert written == [(path, False)]
    assert f"no engine server left: saved a checkpoint of step 7 (the last finished) to {path}; stopping" in caplog.text


def test_the_engine_grace_is_a_positive_number_of_seconds():
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="SaveOnSignal.engine_grace_s"):
            SaveOnSignal(engine_grace_s=bad)
