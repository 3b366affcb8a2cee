"""The update journal: each step's `Update` bytes, kept so that an engine server that fell behind (restarted, stopped,
joined mid-run) catches up by replaying the updates it missed instead of loading the whole model.

Version v of a run is its weights after v updates (version 0: the model's files). The journal holds the bytes of
version v's update under v: the last `keep` in memory, and, with a directory, every one on disk as well
(`<directory>/<run>/<v>.update`, written atomically) until replaying from there would move more bytes than a full load
(`prune`). Replayed in order onto version v's weights they give version v + n's bit for bit on the same kind of
device (`LowRankDelta` regenerates A from its seed and rounds with the key it carries).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger(__name__)


class UpdateJournal:
    def __init__(self, keep: int = 16, directory: str | Path | None = None) -> None:
        self.keep = keep
        self.directory = Path(directory) if directory is not None else None
        self.run = uuid.uuid4().hex[:16]  # this run's id; a resumed run takes its checkpoint's (`restore`)
        self.version = 0
        self._memory: OrderedDict[int, bytes] = OrderedDict()

    def _path(self, version: int) -> Path:
        return self.directory / self.run / f"{version:09d}.update"

    def record(self, data: bytes, write: bool = True) -> int:
        """Version + 1 is `data`'s update; kept in memory and (`write`, the rank that sends) on disk. Returns the new
        version."""
        self.version += 1
        if write:
            self._memory[self.version] = data
            while len(self._memory) > self.keep:
                self._memory.popitem(last=False)
            if self.directory is not None:
                path = self._path(self.version)
                path.parent.mkdir(parents=True, exist_ok=True)
                partial = path.with_suffix(".partial")
                with open(partial, "wb") as file:
                    file.write(data)
                    file.flush()
                    os.fsync(file.fileno())
                os.replace(partial, path)  # a reader never sees a half-written update
        return self.version

    def get(self, version: int) -> bytes | None:
        if version in self._memory:
            return self._memory[version]
        if self.directory is not None and self._path(version).is_file():
            return self._path(version).read_bytes()
        return None

    def since(self, version: int) -> list[bytes] | None:
        """The updates that take version `version`'s weights to the current ones, in order; None when one of them is
        no longer kept (or `version` is not one of this run's)."""
        if not 0 <= version <= self.version:
            return None
        updates = []
        for v in range(version + 1, self.version + 1):
            data = self.get(v)
            if data is None:
                return None
            updates.append(data)
        return updates

    def prune(self, full_load_bytes: int) -> None:
        """Drop from disk the updates no catch-up would replay: those older than the point past which replaying costs
        more bytes than a full load."""
        if self.directory is None or not (self.directory / self.run).is_dir() or not full_load_bytes:
            return  # (a full load's size unknown: every update kept)
        total, oldest_useful = 0, self.version + 1
        for v in range(self.version, 0, -1):
            path = self._path(v)
            if not path.is_file():
                break
            total += path.stat().st_size
            if total > full_load_bytes:
                break
            oldest_useful = v
        for path in (self.directory / self.run).glob("*.update"):
            if int(path.stem) < oldest_useful:
                path.unlink(missing_ok=True)

    def state(self) -> dict:
        return {"run": self.run, "version": self.version}

    def restore(self, state: dict) -> None:
        """A resumed run's: its id and version; memory starts empty (the disk keeps what was written)."""
        self.run, self.version = state["run"], int(state["version"])
        self._memory.clear()
