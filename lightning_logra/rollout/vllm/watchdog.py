"""VLLMEngine's watchdog: every call to the engine runs under it (`_with_restart`). A call that meets a dead engine
(vLLM's EngineDeadError, or one of its processes ended: EngineDied) or that runs past `call_timeout_s` (EngineStalled)
has the engine's processes killed and the engine restarted, its weights reloaded, up to `max_restarts` times in a row;
a call still under way past the grace after a signal kills the engine and raises StopRequested. The engine's module
docstring (`engine.py`) says why.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from lightning_logra.base.stop import STOP

log = logging.getLogger(__name__)


class EngineStalled(TimeoutError):
    """An engine call ran past `call_timeout_s`."""


class EngineDied(RuntimeError):
    """A process of the engine ended while a call waited on it (vLLM's client does not notice: the call would wait
    for `call_timeout_s`)."""


def _dead_engine_errors() -> tuple[type[BaseException], ...]:
    from vllm.v1.engine.exceptions import EngineDeadError

    return (EngineDeadError, EngineStalled, EngineDied)


_WATCH_S = 1.0  # how often a call under way checks that the engine's processes are alive


class EngineWatchdog:
    """The watchdog's part of `VLLMEngine` (a base class of it): it reads the engine's settings (`separate_process`,
    `call_timeout_s`, `max_restarts`, `in_trainer_ranks`), the processes it started with (`_watched`), and calls its
    `close`, `_launch`, `_wake` and the weight sync's `_reload`."""

    def restart(self) -> None:
        """Start a fresh engine and load the trainer's weights into it (`reload_after_restart`)."""
        self.close()
        self.restarts += 1
        log.warning("vLLM engine restarted (%d so far)", self.restarts)
        self._launch()
        if self._reload is not None:
            self._reload()

    def _with_restart(self, call: Callable[[], object], retry: bool = True):
        """Run `call` (waking the engine first); if the engine died or stalled, restart it (weights reloaded) and
        run it again when `retry`."""
        def awake_call():
            self._wake()
            return call()

        if self.in_trainer_ranks:  # its worker is this process: nothing to restart it into
            return awake_call()

        for attempt in range(self.max_restarts + 1):
            try:
                return self._within_deadline(awake_call)
            except _dead_engine_errors():
                if attempt == self.max_restarts:
                    raise
                self.restart()
                if not retry:
                    return None
        return None

    def _within_deadline(self, call: Callable[[], object]):
        """Run `call`, watching the engine's processes while it runs: if one of them ends, the others are killed and
        EngineDied is raised within a second or so; after `call_timeout_s` (a stopped or deadlocked engine) they are
        killed and EngineStalled is raised; past the grace after a signal, they are killed and StopRequested is raised
        (no restart: the run is stopping). The call runs in a thread of its own because vLLM's calls have no timeout
        and do not notice the engine's death; a thread still blocked on the killed engine is left behind (a daemon,
        it holds nothing but its stack)."""
        if not self.separate_process:
            return call()
        if STOP.overdue():  # the engine was killed for a signal the run is stopping on: no restart, no call
            raise STOP.error("a call to the vLLM engine")
        outcome = {}

        def run() -> None:
            try:
                outcome["value"] = call()
            except BaseException as err:  # handed to the caller below
                outcome["error"] = err

        thread = threading.Thread(target=run, name="vllm-call", daemon=True)
        thread.start()
        deadline = math.inf if self.call_timeout_s is None else time.monotonic() + self.call_timeout_s
        while thread.is_alive() and time.monotonic() < deadline:
            thread.join(min(_WATCH_S, max(deadline - time.monotonic(), 0.0)))
            if thread.is_alive() and STOP.overdue():
                log.warning("vLLM engine: a call still under way %.0f s after a signal; killing the engine's "
                            "processes so that the run can stop", STOP.grace_s)
                self._kill_processes()
                raise STOP.error("a call to the vLLM engine")
            if thread.is_alive() and self._engine_died():
                log.warning("vLLM engine: one of its processes ended during a call; killing the others to restart it")
                self._kill_processes()
                raise EngineDied("the vLLM engine died during a call (one of its processes ended)")
        if thread.is_alive():
            log.warning("vLLM engine: a call has not returned after %.0f s (engine.call_timeout_s); killing the "
                        "engine's processes to restart it", self.call_timeout_s)
            self._kill_processes()
            raise EngineStalled(f"the vLLM engine stalled: a call did not return within engine.call_timeout_s="
                                f"{self.call_timeout_s} s, {self.max_restarts + 1} times in a row; raise "
                                "engine.call_timeout_s if its calls are just slow")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def _engine_processes(self) -> list:
        """The engine's processes (the engine core, its workers): this process's children that vLLM names "VLLM::…",
        and theirs. Other descendants are left out: under Lightning's launcher the other ranks' trainers are rank
        0's children, and their engines are theirs, not rank 0's to measure or kill."""
        import psutil  # a dependency of vLLM

        processes, parents = [], [psutil.Process()]
        while parents:
            try:
                children = parents.pop().children()
            except psutil.NoSuchProcess:
                continue
            for process in children:
                try:
                    if process.name().startswith("VLLM"):
                        processes.append(process)
                        parents.append(process)
                except psutil.NoSuchProcess:
                    continue
        return processes

    def _engine_died(self) -> bool:
        """Whether a process the engine started with (its core, its workers) has ended. A stopped one (SIGSTOP) has
        not: that is what `call_timeout_s` is for."""
        import psutil

        for process in self._watched:
            try:
                if not process.is_running() or process.status() == psutil.STATUS_ZOMBIE:
                    return True
            except psutil.NoSuchProcess:
                return True
        return False

    def _kill_processes(self) -> None:
        import psutil

        processes = self._engine_processes()
        for process in processes:
            try:
                process.kill()  # SIGKILL: a stopped (SIGSTOP) process cannot act on anything gentler
            except psutil.NoSuchProcess:
                continue
        psutil.wait_procs(processes, timeout=30)
