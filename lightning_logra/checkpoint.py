"""Checkpoints written atomically: a crash mid-save leaves the previous checkpoint, never a truncated one.

Each save writes a hidden temporary file beside the checkpoint (`.last.ckpt.<pid>.<random>.tmp`) and renames it
over the checkpoint when complete. A process killed mid-save (SIGKILL, out of memory) leaves its temporary file
behind; the next save removes such leftovers of processes that are no longer running. A full disk fails the save
with one message that names the checkpoint and says what to do; the previous checkpoint stays as it was.
"""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(path.parent)
        # The temporary file sits in the same directory so that os.replace is a rename, atomic on POSIX. It is
        # created with mode 0666 minus the umask, as any other file the run writes (tempfile.mkstemp would make
        # it 0600, and the rename keeps that).
        tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
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


def _disk_full(err: BaseException | None) -> bool:
    """Whether an ENOSPC error is `err` or anything it was raised from or while handling."""
    while err is not None:
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return True
        err = err.__cause__ or err.__context__
    return False


def _remove_stale_temporaries(directory: Path) -> None:
    """Delete temporary checkpoint files whose writing process is gone (killed mid-save)."""
    for tmp in directory.glob(".*.ckpt.*.tmp"):
        pid = tmp.name.split(".")[-3]  # ".<name>.ckpt.<pid>.<random>.tmp"
        if pid.isdigit() and int(pid) != os.getpid() and _running(int(pid)):
            continue  # another process is writing it now
        tmp.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True
