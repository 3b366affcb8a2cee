"""The weights-version gate of an engine server: which run and weight version its weights are, and who may touch them
when. A change (an update or a load) waits until no other change, no weight read and (unless it lands in flight) no
generation is under way; an update is admitted only on top of the version before it, checked under the gate's lock
so that two updates of one version make one change. A generation or a weight read waits until the weights reach the
version it asks for and no change is under way, and holds changes back while it runs (a read holds back every change;
a generation all but those in flight).

The weights are held by the trainer process that made them (its identity, beside the run's: two trainers resumed
from one checkpoint share the run's id): while it asks anything, and has not ended, another process may neither
change them nor generate from them nor release them (`held_by_another`).

Plain asyncio: the routes (`routes.py`) hold one per server, and tests drive it without a web framework.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from lightning_logra.rollout.protocol import Label, process_tag

_MAX_WAIT_S = 3600.0  # the longest a request may wait for the version it asks for
HOLD_S = 120.0  # a process that asked anything this recently, and has not ended, holds the server: another
# process's changes, generations and releases are refused


class VersionGate:
    """The label of one server's weights (`protocol.Label`), and the changes, generations and reads under way."""

    def __init__(self) -> None:
        self.run: str | None = None
        self.version: int | None = 0
        self.holder: str | None = None  # the identity of the trainer process that made the weights (None: no header)
        self._changing = False  # an update or load is being merged: generation waits
        self._generating = 0  # generation requests under way: a change waits for them, unless it is in flight
        self._reading = 0  # weight reads (/blocks) under way: every change waits for them
        self._changed = asyncio.Condition()
        self._heard = -math.inf  # when the process that holds the weights last asked anything (time.monotonic)

    def _holds(self, run: str | None, process: str | None) -> bool:
        return run is not None and run == self.run and process == self.holder

    def heard_from(self, run: str | None, process: str | None) -> None:
        """A request of `process` of `run` arrived: the process that made the weights keeps holding the server."""
        if self._holds(run, process):
            self._heard = time.monotonic()

    def held_by_another(self, run: str | None, process: str | None) -> float | None:
        """Seconds since the process that made the weights last asked anything, when that is not `process` of `run`
        and it did so within HOLD_S (None: the server is free for it). Two trainers on one server each replaced the
        other's weights with a full load every step; two resumed from one checkpoint (one run id) took each other's
        updates for their own; and both went on as if nothing was wrong."""
        if self.run is None or self._holds(run, process):
            return None
        quiet = time.monotonic() - self._heard
        return quiet if quiet < HOLD_S else None

    def release(self, run: str | None, process: str | None) -> None:
        """`process` of `run` has ended: another may take the server at once (a release by another changes nothing)."""
        if self._holds(run, process):
            self._heard = -math.inf

    def label(self) -> Label:
        return Label(self.run, self.version)

    def answer(self, **more) -> dict:
        """The label as the routes answer it: with the holder's tag (never its identity) and `more`."""
        return {**self.label().to_json(), "holder": process_tag(self.holder), **more}

    async def settled(self, wait_s: float) -> bool:
        """Wait at most `wait_s` for the change under way, if any, to end; whether none is under way now. A label read
        mid-change is the unknown one (`forget`), and a trainer that took it for a cut-short change gave up on a server
        that was merging the update it had been sent."""
        if not self._changing:
            return True
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: not self._changing), wait_s)
            except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
                return False
        return True

    def follows(self, label: Label) -> bool:
        """Whether an update labelled `label` goes on top of the weights: they are the version before it, of its run
        (or the model's files)."""
        return self.run in (None, label.run) and self.version == label.version - 1

    def forget(self) -> None:
        """The weights are being changed: unknown until the change is whole (a cut-short change leaves them so)."""
        self.version = None

    def relabel(self, label: Label, process: str | None = None) -> None:
        self.run, self.version, self.holder = label.run, label.version, process
        self.heard_from(label.run, process)

    @asynccontextmanager
    async def change(self, label: Label, in_flight: bool = False, on_top: bool = False) -> AsyncIterator[bool]:
        """Hold the weights for a change to `label`: once no other change, no read and (unless `in_flight`) no
        generation is under way. With `on_top` (an update), only if the weights are then the version before
        `label`'s: yields False (nothing held) if not."""
        def free() -> bool:
            return not self._changing and self._reading == 0 and (in_flight or self._generating == 0)

        async with self._changed:
            await self._changed.wait_for(free)
            admitted = not on_top or self.follows(label)
            self._changing = admitted
        if not admitted:
            yield False
            return
        try:
            yield True
        finally:
            async with self._changed:
                self._changing = False
                self._changed.notify_all()

    def generation(self, run: str | None, min_version: int, wait_s: float) -> AbstractAsyncContextManager[bool]:
        """`async with gate.generation(...) as reached`: a generation at a version of `run` at least `min_version`,
        waited for at most `wait_s` (False: not reached, nothing held); changes not in flight wait for it."""
        return self._held("_generating", run, min_version, wait_s, any_run=False)

    def reading(self, run: str | None, min_version: int, wait_s: float,
                any_run: bool = False) -> AbstractAsyncContextManager[bool]:
        """As `generation`, for a read of the weights, which every change waits for. With `any_run`, weights of
        another run (or unknown) are read at once: a comparison finds them."""
        return self._held("_reading", run, min_version, wait_s, any_run)

    @asynccontextmanager
    async def _held(self, counter: str, run: str | None, min_version: int, wait_s: float,
                    any_run: bool) -> AsyncIterator[bool]:
        def ready() -> bool:
            if self._changing:
                return False
            ours = self.version is not None and self.run in (None, run)
            if not ours:
                return any_run
            return self.version >= min_version

        async with self._changed:
            reached = ready()
            if not reached:
                try:
                    await asyncio.wait_for(self._changed.wait_for(ready), min(float(wait_s), _MAX_WAIT_S))
                    reached = True
                except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
                    pass
            if reached:
                setattr(self, counter, getattr(self, counter) + 1)
        if not reached:
            yield False
            return
        try:
            yield True
        finally:
            async with self._changed:
                setattr(self, counter, getattr(self, counter) - 1)
                self._changed.notify_all()
