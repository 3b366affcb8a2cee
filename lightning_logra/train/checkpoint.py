"""Checkpoints that say what they are, written atomically.

Every checkpoint of an RLVRModule carries a `lightning_logra` entry: the format version and the settings its state
is only valid under (the weights' dtype, sketch or dense training; the sketch optimizer adds its own settings to its
state). Resuming under other settings, or from a newer format, is refused with the reason; a checkpoint of format 1
(written before checkpoints said what they are: the same layout without the entry) loads as it is, with a warning.

A crash mid-save leaves the previous checkpoint, never a truncated one. A checkpoint records the sha256 of what it
holds and is checked against it when it loads, and loading one never runs code from it (`lightning_logra.train.digests`,
`lightning_logra.train.safe_load`).

Each save writes a hidden temporary file beside the checkpoint (`.last.ckpt.<pid>.<random>.tmp`) and renames it
over the checkpoint when complete. A process killed mid-save (SIGKILL, out of memory) leaves its temporary file
behind; the next save removes such leftovers of processes that are no longer running. A full disk fails the save
with one message that names the checkpoint and says what to do; the previous checkpoint stays as it was.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn

from lightning_logra.train.digests import KEY as DIGESTS
from lightning_logra.train.digests import content_digests, verify_content
from lightning_logra.train.safe_load import load_file

log = logging.getLogger(__name__)

FORMAT = 2  # 1: no `lightning_logra` entry; 2: the entry, the sketch optimizer's settings and update counter
KEY = "lightning_logra"


def stamp(weights_dtype: str, mode: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint records about itself: the format and the settings its state is only valid under (the
    weights' dtype, and how it was trained: the training mode's `stamp`)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        package = version("lightning-logra")
    except PackageNotFoundError:
        package = "unknown"
    return {"format": FORMAT, "package": package, "weights_dtype": weights_dtype, **mode}


def check_resumable(checkpoint: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse to resume `checkpoint` under the settings `current` (a `stamp`) when its state would be misread."""
    saved = checkpoint.get(KEY)
    if saved is None:
        log.warning("the checkpoint is of format 1 (it does not record its settings): resuming without checking "
                    "them; it is read as it is, format 2 only adds that record")
        return
    if saved["format"] > FORMAT:
        raise ValueError(f"cannot resume: the checkpoint is of format {saved['format']} (lightning-logra "
                         f"{saved['package']}), and this lightning-logra ({current['package']}) reads formats up to "
                         f"{FORMAT}; upgrade lightning-logra")
    differences = []
    if saved["weights_dtype"] != current["weights_dtype"]:
        differences.append(f"model.dtype / trainer.precision: the checkpoint's weights are {saved['weights_dtype']}, "
                           f"this run's {current['weights_dtype']}")
    if saved["training"] != current["training"]:
        differences.append(f"trainer.strategy: the checkpoint was trained {saved['training']}, this run trains "
                           f"{current['training']} (its optimizer state does not fit)")
    if saved.get("lora") != current.get("lora"):  # rank, alpha and targets of LoRA adapters (train/lora.py)
        differences.append(f"trainer.strategy.init_args.lora: the checkpoint's adapters are {saved.get('lora')}, "
                           f"this run's {current.get('lora')}")
    if saved.get("optimizer") != current.get("optimizer"):  # the strategy's optimizer's class (None: AdamW)
        differences.append("the strategy's optimizer: the checkpoint's state is "
                           f"{saved.get('optimizer') or 'AdamW'}'s, "
                           f"this run's optimizer {current.get('optimizer') or 'AdamW'}")
    if differences:
        raise ValueError("cannot resume: " + "; ".join(differences) + ". Resume with the checkpoint's settings, or "
                         "start a new run from its weights (export them with lightning-logra export, then train from "
                         "that folder)")


def changed_settings(recorded: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{key: (recorded, current)} for each of the module's settings that differs from what a checkpoint's
    hyper-parameters recorded, a group's by field (`loss.beta`)."""
    changed = {}
    for key, value in current.items():
        if key not in recorded or recorded[key] == value:
            continue
        before = recorded[key]
        if is_dataclass(value) and is_dataclass(before):
            for field in fields(value):
                old, new = getattr(before, field.name, None), getattr(value, field.name)
                if old != new:
                    changed[f"{key}.{field.name}"] = (old, new)
        else:
            changed[key] = (before, value)
    return changed


class StampedCheckpoints:
    """The checkpoint hooks of an RLVRModule, mixed into it: every checkpoint says what it is (`stamp`, with the tokens
    trained on and the sample source's part), a resume under settings its state would be misread under is refused,
    and the module's settings that differ from the checkpoint's are named. It uses the module's `mode`, `samples`,
    `num_tokens` and `hparams`."""

    def weights_dtype(self) -> str:
        """The dtype the policy's weights are held in during the run: a "-true" precision's, which the strategy's set-up
        converts them to; otherwise ("-mixed" ones, no Trainer) model.dtype's."""
        if self._trainer is None:
            return self.hparams.dtype
        precision = str(self.trainer.precision)
        return {"bf16-true": "bfloat16", "16-true": "float16", "64-true": "float64"}.get(precision, self.hparams.dtype)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[KEY] = {**stamp(self.weights_dtype(), self.mode.stamp()), "num_tokens": self.num_tokens,
                                      **self.samples.state()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Runs before any state is restored. Evaluating or exporting a checkpoint under other settings is fine (its
        # weights load, cast to this run's dtype); resuming training from state taken under other settings is not.
        fitting = self._trainer is not None and self.trainer.state.fn == TrainerFn.FITTING
        saved = checkpoint.get(KEY, {})
        if fitting:
            check_resumable(checkpoint, stamp(self.weights_dtype(), self.mode.stamp()))
            self.num_tokens = saved.get("num_tokens", 0)
        self.samples.restore(saved, fitting)
        # This run's settings apply, not the checkpoint's (lightning_logra.cli): say where they differ.
        for key, (recorded, value) in changed_settings(checkpoint.get("hyper_parameters", {}), self.hparams).items():
            log.warning("model.%s: the checkpoint was made with %r, this run uses %r", key, recorded, value)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO, writing atomically, recording the sha256 of everything it writes inside the file
    (`lightning_logra.train.digests`), and loading without running code from the file
    (`lightning_logra.train.safe_load`)
    after checking it against those digests."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        path = Path(path)
        checkpoint = {**checkpoint, DIGESTS: content_digests(checkpoint)}
        # The temporary file sits in the same directory so that os.replace is a rename, atomic on POSIX. It is
        # created with mode 0666 minus the umask, as any other file the run writes (tempfile.mkstemp would make
        # it 0600, and the rename keeps that).
        tmp = temporary_path(path)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as err:
            tmp.unlink(missing_ok=True)
            if _disk_full(err):
                # torch.save, interrupted by the failed write, then fails again closing its zip archive
                # ("unexpected pos"): that second error says nothing useful, so it is dropped.
                raise OSError(errno.ENOSPC, f"no space left on the device to save the checkpoint {path}: free "
                              f"space there or point ModelCheckpoint's dirpath at another disk; the previous "
                              f"checkpoint, if any, is intact") from None
            raise


    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        """The checkpoint at `path`, checked against the digests it records (one written before checkpoints recorded
        them loads with a warning). `weights_only` is ignored: nothing but plain data and the project's own classes
        is ever built from a checkpoint."""
        if not Path(path).is_file():
            raise FileNotFoundError(f"--ckpt_path: no such checkpoint file {str(path)!r}")
        return load_verified(path, map_location)


def load_verified(path: Path | str, map_location: Any = "cpu") -> dict[str, Any]:
    """A single-file checkpoint, loaded without running code from it and checked against its recorded digests."""
    checkpoint = load_file(path, map_location)
    recorded = checkpoint.pop(DIGESTS, None)
    if recorded is None:
        log.warning("%s records no sha256 digests (written before checkpoints did): it is not checked for damage",
                    path)
    else:
        verify_content(checkpoint, recorded, str(path))
    return checkpoint


def _disk_full(err: BaseException | None) -> bool:
    """Whether an ENOSPC error is `err` or anything it was raised from or while handling."""
    while err is not None:
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return True
        err = err.__cause__ or err.__context__
    return False


def _remove_stale_temporaries(directory: Path) -> None:
    """Delete temporary checkpoints (files, or sharded folders) whose writing process is gone (killed mid-save)."""
    for tmp in directory.glob(".*.ckpt.*.tmp"):
        pid = tmp.name.split(".")[-3]  # ".<name>.ckpt.<pid>.<random>.tmp"
        if pid.isdigit() and int(pid) != os.getpid() and _running(int(pid)):
            continue  # another process is writing it now
        _remove(tmp)


def temporary_path(path: Path) -> Path:
    """Where a checkpoint for `path` is written before it is moved there: beside it (a rename, not a copy), named
    after the writing process so that a later run can tell a dead writer's leftovers (`_remove_stale_temporaries`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(path.parent)
    return path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def replace_folder(new: Path, path: Path) -> None:
    """Put the finished sharded checkpoint `new` (a folder beside `path`) at `path`. A folder cannot replace another
    in one rename, so the previous checkpoint is renamed aside first and deleted only once the new one is in place:
    a crash while the shards are written (the long part) leaves the previous checkpoint as it was, and one between
    the two renames leaves it whole at `.<name>.old`. A symbolic link at `path` is what is replaced (renamed aside,
    then unlinked), not what it points to; a dangling one too, which `exists()` does not see."""
    old = path.parent / f".{path.name}.old"
    _remove(old)
    if path.exists() or path.is_symlink():
        path.rename(old)
    new.rename(path)
    _remove(old)


def follow_umask(folder: Path) -> None:
    """Give every file in `folder` the mode any new file of this process gets (0666 less the umask): safetensors
    writes model.safetensors 0600 while every other file of an export is 0644."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True
