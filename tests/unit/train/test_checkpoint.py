"""Atomic checkpoint writes: normal permissions, leftovers of a killed save removed, one clear error on a full disk."""

import errno
import io
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

from lightning_logra.train.checkpoint import AtomicCheckpointIO


def test_checkpoints_get_normal_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        AtomicCheckpointIO().save_checkpoint({"x": torch.ones(3)}, tmp_path / "last.ckpt")
        os.umask(0o027)
        AtomicCheckpointIO().save_checkpoint({"x": torch.ones(3)}, tmp_path / "other.ckpt")
    finally:
        os.umask(old)
    assert (tmp_path / "last.ckpt").stat().st_mode & 0o777 == 0o644  # as the event files and every other output
    assert (tmp_path / "other.ckpt").stat().st_mode & 0o777 == 0o640


def test_a_save_removes_what_a_killed_save_left(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    killed = tmp_path / f".last.ckpt.{dead.pid}.0a1b2c3d.tmp"  # a writer killed mid-save
    older = tmp_path / ".epoch=0-step=300.ckpt.k2j3h4g5.tmp"  # the naming of earlier versions (no pid)
    writing = tmp_path / f".last.ckpt.{os.getppid()}.0a1b2c3d.tmp"  # a live process's save in progress
    for path in (killed, older, writing):
        path.write_bytes(b"x" * 100)
    AtomicCheckpointIO().save_checkpoint({"x": torch.ones(3)}, tmp_path / "last.ckpt")
    assert not killed.exists() and not older.exists()
    assert writing.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["last.ckpt", writing.name])


class _FullDisk(io.FileIO):
    """A file on a disk that fills up after 1,000 bytes."""

    def write(self, data):
        if self.tell() + len(data) > 1000:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)


def test_a_full_disk_gives_one_clear_error_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"x": torch.zeros(3)}, path)
    monkeypatch.setattr(os, "fdopen", lambda fd, mode: _FullDisk(fd, mode.replace("b", "")))
    with pytest.raises(OSError) as raised:
        AtomicCheckpointIO().save_checkpoint({"x": torch.randn(10_000)}, path)
    monkeypatch.undo()

    assert raised.value.errno == errno.ENOSPC
    shown = "".join(traceback.format_exception(raised.value))
    assert f"no space left on the device to save the checkpoint {path}" in shown and "dirpath" in shown
    assert "unexpected pos" not in shown and "During handling" not in shown  # torch's follow-up error is dropped
    assert torch.equal(torch.load(path)["x"], torch.zeros(3))
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left behind


def _sharded(path: Path, content: str) -> None:
    """A stand-in for a sharded checkpoint folder: what torch.distributed.checkpoint writes, reduced to two files."""
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_text(content)
    (path / "meta.pt").write_text(content)


def test_a_sharded_checkpoint_replaces_the_previous_one_only_once_written(tmp_path, monkeypatch):
    # SketchFSDPStrategy writes its shards into a temporary folder beside the target and moves it into place after
    # every rank has written: a save that fails while writing leaves the previous checkpoint whole and no temporary.
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_logra.train.strategies.fsdp import SketchFSDPStrategy

    target = tmp_path / "last.ckpt"
    _sharded(target, "step 50")

    def write(self, checkpoint, path, storage_options=None):  # the shards, then a failure (the disk is full)
        _sharded(Path(path), checkpoint["step"])
        if checkpoint["step"] == "broken":
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ModelParallelStrategy, "save_checkpoint", write)
    strategy = SketchFSDPStrategy()  # one process: broadcast and barrier return at once
    with pytest.raises(OSError):
        strategy.save_checkpoint({"step": "broken"}, target)
    assert (target / "meta.pt").read_text() == "step 50"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    strategy.save_checkpoint({"step": "step 100"}, target)
    assert (target / "__0_0.distcp").read_text() == (target / "meta.pt").read_text() == "step 100"
    assert sorted(p.name for p in target.iterdir()) == ["SHA256SUMS", "__0_0.distcp", "meta.pt"]  # hashed inside
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # the previous one and the temporary gone
