"""RunDirectory: the logger's run directory (`runs/<name>/version_N`) as the user meets it.

- `runs/<name>/latest` is a link to the checkpoint folder of the newest training run (`version_N/checkpoints`, or
  ModelCheckpoint's `dirpath`), set when fitting starts, so that `--ckpt_path runs/<name>/latest/last.ckpt` names
  the run just made, whatever its version number. It links the checkpoints rather than the whole run folder because
  TensorBoard follows links: `tensorboard --logdir runs` would list the newest run twice.
- A run that fails before it has anything to keep (no training step done, no checkpoint written; e.g. a bad
  setting caught at set-up) removes the directory it created, and `latest` goes back to where it pointed, so failed
  attempts do not leave empty `version_N` folders behind (and the next run does not get a higher number for them).

- Runs started at once on one folder each get a `version_N` of their own: before fitting, the command line claims the
  next free number by creating its folder (`claim_version`: a mkdir either creates it or fails), where TensorBoard's
  logger would only list the folder and take the next number, the same one for both.

The command line adds it to every run that has a logger; a directory that existed before the run (a logger given
an explicit version) is never removed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

LATEST = "latest"


def _fresh(path: Path) -> bool:
    """Whether `path` is new with this run: absent, or holding nothing but what the logger wrote when this run
    started it. (Lightning starts the loggers just before the callbacks' `setup`, which creates the directory and,
    for TensorBoard, an event file named with the id of the process writing it.)"""
    if not path.exists():
        return True
    mine = f".{os.getpid()}."
    return all(entry.is_file() and entry.name.startswith("events.out.tfevents.") and mine in entry.name
               for entry in path.iterdir())


def _will_be_rank_zero() -> bool:
    """Whether this process will be global rank 0, before any process group exists: Lightning's own launcher says
    so in NODE_RANK and LOCAL_RANK (which it sets for the processes it starts), torchrun and SLURM in RANK /
    SLURM_PROCID; none of them set: a single process."""
    if int(os.environ.get("LOCAL_RANK", 0)) or int(os.environ.get("NODE_RANK", 0)):
        return False
    return all(int(os.environ.get(key, 0)) == 0 for key in ("RANK", "SLURM_PROCID"))


class RunDirectory(Callback):
    def __init__(self) -> None:
        self.path: Path | None = None  # the logger's directory of this run
        self.created = False  # it did not exist before this run
        self.start_step = 0
        self.previous: str | None = None  # where `latest` pointed before this run moved it
        self.target: str | None = None  # where this run pointed it

    def claim_version(self, trainer: Trainer) -> None:
        """Gives a TensorBoard logger without a version the next free `version_N` by creating its folder, so that no
        other run can take it. In the process that will be global rank 0 only (called before the strategy has set
        up, so the rank is read from the launchers' variables); the other ranks write nothing there."""
        logger = trainer.logger
        if not isinstance(logger, TensorBoardLogger) or logger._version is not None or not _will_be_rank_zero():
            return
        root = Path(logger.root_dir)
        root.mkdir(parents=True, exist_ok=True)
        version = logger._get_next_version()
        while True:
            try:
                (root / f"version_{version}").mkdir()
                break
            except FileExistsError:  # another run took it since the listing
                version += 1
        logger._version = version
        self.path, self.created = Path(logger.log_dir), True  # removed again if the run fails before a step

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Before the CLI's SaveConfigCallback (added after this one) writes config.yaml into the directory.
        logger = trainer.logger
        if logger is None or getattr(logger, "log_dir", None) is None or not trainer.is_global_zero:
            return
        self.path = Path(logger.log_dir)
        self.created = self.created or _fresh(self.path)
        self.start_step = trainer.global_step

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        checkpoints = trainer.checkpoint_callback
        if self.path is None or checkpoints is None or checkpoints.dirpath is None:
            return
        link = self.path.parent / LATEST
        self.previous = os.readlink(link) if link.is_symlink() else None
        Path(checkpoints.dirpath).mkdir(parents=True, exist_ok=True)  # so that the link leads somewhere at once
        self.target = os.path.relpath(checkpoints.dirpath, link.parent)  # relative: the folder can move
        self._point(link, self.target)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self.path is None or not self.created or not self.path.is_dir():
            return
        if trainer.global_step > self.start_step or any(self.path.rglob("*.ckpt")):
            return  # it holds metrics of finished steps or a checkpoint: worth keeping
        shutil.rmtree(self.path, ignore_errors=True)
        rank_zero_info(f"Removed {self.path}: the run failed before its first step or checkpoint")
        link = self.path.parent / LATEST
        if self.target is not None and link.is_symlink() and os.readlink(link) == self.target:
            if self.previous is None:
                link.unlink()
            else:
                self._point(link, self.previous)

    @staticmethod
    def _point(link: Path, target: str) -> None:
        """Points `link` at `target` by an atomic rename over the old link."""
        temporary = link.with_name(f".{LATEST}.{os.getpid()}")
        try:
            temporary.unlink(missing_ok=True)
            temporary.symlink_to(target, target_is_directory=True)
            os.replace(temporary, link)
        except OSError as err:  # a folder named `latest` in the way, or a file system without links
            temporary.unlink(missing_ok=True)
            rank_zero_warn(f"RunDirectory: could not point {link} at {target}: {err}")
