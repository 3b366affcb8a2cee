"""Atomic checkpoint writes: normal permissions, leftovers of a killed save removed, one clear error on a full disk."""

import errno
import io
import os
import subprocess
import sys
import traceback

import pytest
import torch

from lightning_logra.checkpoint import AtomicCheckpointIO


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
