"""SaveOnSignal: SIGTERM or SIGUSR1 (what SLURM and Kubernetes send some time before they kill a job) saves a
checkpoint at the next step boundary and ends the run with the status a shell reports for a death by that signal.

The run finishes the step in progress, saves a checkpoint of it where `--ckpt_path` resumption finds it (the name
and folder `ModelCheckpoint` gives its last checkpoint, `<dirpath>/last.ckpt`; without a ModelCheckpoint,
`checkpoints/last.ckpt` in the logger's folder, or in `default_root_dir` without a logger), logs one line that names
the signal, the step and the path, and exits with status 128 + the signal's number: 143 for SIGTERM, 138 for SIGUSR1,
so that a scheduler records a failure, not a finished job. The save goes through `trainer.save_checkpoint` as every
other does (atomic; under FSDP sharded into a folder renamed into place). It does not requeue the job: that is left to
the job script (SLURM's `--requeue`, or `scontrol requeue $SLURM_JOB_ID` in the script after a 138 or 143 exit).

With several processes the ranks agree at every step boundary on whether any of them received a signal (one
all-reduce of one number: the highest signal number received, 0 for none), so that every rank saves the same step and
all exit together, whichever rank the signal reached. The handler itself only records the number: it runs in the
middle of whatever the step is doing (a collective, a write), where anything more could deadlock or corrupt it.

When a signal is acted on:
- during a training step: at its end. The checkpoint is written in `on_train_batch_end`, where ModelCheckpoint
  writes its own, so it holds the same state as a periodic one (as long as this callback comes after the others
  that change state there: the command line adds it after those a config lists). The process exits at the next
  hook, once the step's metrics have reached the logger (a validation due at that step is skipped).
- during a validation: at the end of the next training step.
- during the sanity check, or a SIGTERM that Lightning's own handler took after `fit` installed it: before the first
  training step, with 128 + the signal's number, no checkpoint, and a line that says so.
- while the trainer waits on a rollout engine in processes of its own that does not answer (stopped, deadlocked, or
  just slow) for `engine_grace_s` seconds after the signal: the engine's processes are killed and the wait raises
  StopRequested (`base/stop.py`). In a step's rollouts (before the step changed anything) the checkpoint holds the
  last finished step, and the resumed run redoes the interrupted one; in the sync after an update, the step
  finishes and is saved at its end; with overlapped rollouts, the checkpoint keeps the batches in flight the engine
  had finished and the resumed run draws the others again (it no longer equals an uninterrupted run). With several
  processes, or during a validation, the run exits without a checkpoint: the other ranks may be in a collective
  this one will never join. Exit status 128 + the signal's number, as above.
- earlier, while the model, the data, the engine or a checkpoint load: the handlers are not installed yet, and the
  signal ends the process at once, as it would any other (status 143 or 138); there is nothing to save.

Lightning's own SIGTERM handler, installed as `fit` starts, sets a flag on which its loops end the run with status 0
and no checkpoint: this callback replaces it with its own as the sanity check or training starts, and puts the
previous handlers back when training ends, before Lightning restores those it found.

Grace time: the scheduler must allow at least the longest training step, plus the work after it (a weight sync,
`sync/seconds`), plus one checkpoint save, between the signal and its kill. `train/step_s` logs each step's time.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.utilities import rank_zero_warn

from lightning_logra.base.settings import check_positive
from lightning_logra.base.stop import STOP, StopRequested
from lightning_logra.rollout.remote import NoServerLeft

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def agree(trainer: Trainer, received: int) -> int:
    """The signal every rank acts on: the highest signal number any rank has `received` (0: none). Every rank calls
    it at the same point; one all-reduce of one number (with one process, none)."""
    if trainer.world_size == 1:
        return received
    flag = torch.tensor(received, device=trainer.strategy.root_device)
    return int(trainer.strategy.reduce(flag, reduce_op="max"))


def last_checkpoint_path(trainer: Trainer) -> str:
    """Where `--ckpt_path` resumption finds the newest checkpoint: the name ModelCheckpoint gives its last checkpoint
    in its folder, else `checkpoints/last.ckpt` where ModelCheckpoint would have put it (the logger's version folder,
    or `default_root_dir` without a logger). Every rank calls it (`trainer.log_dir` is a broadcast)."""
    checkpoints = trainer.checkpoint_callback
    if isinstance(checkpoints, ModelCheckpoint):
        # A name pattern of its own (CHECKPOINT_NAME_LAST = "last-{step}") is filled in as ModelCheckpoint would.
        metrics = {**trainer.callback_metrics, "epoch": torch.tensor(trainer.current_epoch),
                   "step": torch.tensor(trainer.global_step)}
        return checkpoints.format_checkpoint_name(metrics, checkpoints.CHECKPOINT_NAME_LAST)
    return os.path.join(trainer.log_dir, "checkpoints", "last.ckpt")


class SaveOnSignal(Callback):
    """
    Args:
        engine_grace_s: how long a wait on a rollout engine in processes of its own may go on after the signal before
            the engine is killed and the run stops without it (saving its last finished step): a stopped or
            deadlocked engine would otherwise hold the run until the engine's call_timeout_s.
    """

    def __init__(self, engine_grace_s: float = 30.0) -> None:
        check_positive("SaveOnSignal.engine_grace_s", engine_grace_s, "number of seconds")
        self.engine_grace_s = engine_grace_s
        self.received = 0  # the highest signal number received since training started; 0: none
        self.exit_code: int | None = None  # set once the checkpoint is saved: the status to exit with
        self._previous: dict[int, Any] = {}  # the handlers this callback replaced, while its own are installed

    # ---- the handler: only a flag ---------------------------------------------------------------------------------

    def _record(self, signum: int, frame: Any) -> None:
        self.received = max(self.received, signum)
        STOP.request(signum, self.engine_grace_s)  # for the waits on an engine (base/stop.py)

    def _install(self, trainer: Trainer) -> None:
        # After Lightning's own registration (when `fit` starts), which would otherwise wrap or replace these.
        if self._previous:
            return
        if threading.current_thread() is not threading.main_thread():
            rank_zero_warn("SaveOnSignal: fit runs outside the main thread, where Python cannot install signal "
                           "handlers; a SIGTERM or SIGUSR1 will not save a checkpoint")
            return
        # A SIGTERM that Lightning's handler took between its registration and now counts as received.
        self.received = signal.SIGTERM if trainer.received_sigterm else 0
        self.exit_code = None
        STOP.clear()
        if self.received:
            STOP.request(self.received, self.engine_grace_s)
        self._previous = {signum: signal.signal(signum, self._record) for signum in SIGNALS}

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        # STOP stays set: the engine calls still queued when the process exits (Lightning tears nothing down after
        # an exception) must not wait on a stalled engine. The next run's setup clears it.

    # ---- hooks ------------------------------------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        STOP.clear()  # a stop an earlier run of this process ended on does not stop this one's engine

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Installed before the sanity check: Lightning's evaluation loop would end it on its own SIGTERM flag, with
        # status 0.
        self._start(trainer)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start(trainer)

    def _start(self, trainer: Trainer) -> None:
        self._install(trainer)
        if not self._previous:
            return
        signum = agree(trainer, self.received)
        if signum:
            if trainer.is_global_zero:
                log.warning("%s before the first training step of this run: nothing new to save, exiting with "
                            "status %d without a checkpoint", signal.Signals(signum).name, 128 + signum)
            self._exit(trainer, 128 + signum)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._previous:
            return
        signum = agree(trainer, self.received)
        if not signum:
            return
        path = last_checkpoint_path(trainer)
        trainer.save_checkpoint(path, weights_only=False)  # all of the state: resumable
        self.exit_code = 128 + signum
        if trainer.is_global_zero:
            log.warning("%s: saved a checkpoint of step %d to %s; exiting with status %d. Resume with --ckpt_path %s",
                        signal.Signals(signum).name, trainer.global_step, path, self.exit_code, path)

    # The first hook after the saved step's own end (its metrics logged, the module's on_train_batch_end done).
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.exit_code is not None:
            self._exit(trainer, self.exit_code)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.exit_code is not None:
            self._exit(trainer, self.exit_code)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.exit_code is not None:
            self._exit(trainer, self.exit_code)
        self._restore()  # before Lightning restores the handlers it found (after on_train_end, in its teardown)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if isinstance(exception, StopRequested) and self._previous:
            self._save_unfinished(trainer, str(exception), f"exiting with status {exception.code}")
        elif isinstance(exception, NoServerLeft) and trainer.training:
            self._save_unfinished(trainer, "no engine server left", "stopping")
        self._restore()  # as in on_train_end; the exit above ends here too

    @staticmethod
    def _save_unfinished(trainer: Trainer, why: str, ending: str) -> None:
        """A wait on the engine outlived the grace after a signal, or no engine server is left. One process: it met
        the engine before the step changed anything (the rollouts; a failed sync lets the step finish), so the state is
        the last finished step's, saved as at a step boundary; Lightning redoes the interrupted step on resume.
        Several: the other ranks may be in a collective this one will never join, so nothing is saved (a save needs
        them all)."""
        if trainer.world_size > 1 or trainer.sanity_checking or trainer.validating:
            log.warning("%s: %s without a checkpoint (%s); resume from the last saved one", why, ending,
                        "several processes" if trainer.world_size > 1 else "during a validation")
            return
        path = last_checkpoint_path(trainer)
        trainer.save_checkpoint(path, weights_only=False)
        log.warning("%s: saved a checkpoint of step %d (the last finished) to %s; %s. Resume with --ckpt_path %s",
                    why, trainer.global_step, path, ending, path)

    @staticmethod
    def _exit(trainer: Trainer, code: int) -> None:
        launcher = trainer.strategy.launcher
        if isinstance(launcher, _SubprocessScriptLauncher) and launcher.procs:
            # Lightning started the other ranks from this one, and a thread of it SIGKILLs this process as soon as
            # one of them exits non-zero, as each is about to: they are taken off its watch and waited for, so that
            # this process exits last, with its own status.
            children = list(launcher.procs)
            launcher.procs.clear()
            for child in children:
                child.wait()
        raise SystemExit(code)
