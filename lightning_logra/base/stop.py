"""A stop that a signal asked for, which the waits on a rollout engine heed.

SaveOnSignal's handler only records a SIGTERM or SIGUSR1 and the run stops at the next step boundary. A wait on an
engine in processes of its own (a generation, an update sent, a drain of overlapped rollouts) can outlast any
scheduler's grace time: a stopped or deadlocked engine answers nothing until `call_timeout_s`. So the handler also
records the signal here, and such a wait that is still going `grace_s` seconds after the signal kills the engine and
raises StopRequested: the run saves its last finished step and exits with the signal's status
(`callbacks/signals.py`). A wait that ends within the grace is untouched, so a healthy engine's run still stops at the
step boundary with everything in flight saved.

Process-wide, as signal handlers are: set from the main thread's handler, read by any thread that waits.
"""

from __future__ import annotations

import math
import signal
import time


class StopRequested(SystemExit):
    """A wait on the engine outlived the grace after a signal. A SystemExit with the signal's status (128 + its number),
    so that a process ends with it wherever the exception goes, and Lightning's on_exception hooks still see it."""

    def __init__(self, signum: int, what: str) -> None:
        super().__init__(128 + signum)
        self.signum, self.what = signum, what

    def __str__(self) -> str:
        return f"{signal.Signals(self.signum).name}: {self.what}"


class _Stop:
    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.signum, self.at, self.grace_s = 0, math.inf, math.inf

    def request(self, signum: int, grace_s: float) -> None:
        """Record a signal (the first one's time counts) and the grace the waits allow after it."""
        if not self.signum:
            self.at = time.monotonic()
        self.signum, self.grace_s = max(self.signum, signum), grace_s

    def overdue(self) -> bool:
        """Whether a signal came more than the grace ago: a wait still going now is stopped."""
        return bool(self.signum) and time.monotonic() - self.at >= self.grace_s

    def error(self, what: str) -> StopRequested:
        return StopRequested(self.signum, f"{what} still under way {self.grace_s:g} s after it")


STOP = _Stop()
