"""A child process that serves requests over a pipe, started by "spawn", with an address-space limit, killed and
started again when a request overruns its deadline: what rewards, verifiers and environments run in (only a process
can be stopped)."""

import atexit
import multiprocessing
import os
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from lightning_logra.base.settings import check_positive

# The address space a reward or verifier process may map beyond what it holds once started (`limit_address_space`):
# 8 GiB, or a quarter of this machine's memory if that is less, so that several such processes cannot take it all.
DEFAULT_MEMORY_GIB = round(min(8.0, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 4 / 2**30), 1)
# Starting a check process (interpreter, the parent's main module, math-verify, sympy) takes seconds; allow for a
# loaded machine.
START_TIMEOUT_S = 120.0


def check_memory_gib(memory_gib: float | None, key: str) -> None:
    """Refuses a memory limit that is not a positive, finite number of GiB (or None: no limit), naming its key."""
    check_positive(key, memory_gib, "number of GiB", null="no limit")


def limit_address_space(memory_gib: float | None) -> None:
    """Lets this process map at most ``memory_gib`` GiB more than it has mapped now (RLIMIT_AS), so that a reward
    or a check that allocates without bound gets a MemoryError (or, failing inside C code, dies) instead of taking
    the host's memory. Called first thing in a started child, before the reward is unpickled.

    Relative to what is mapped now, not an absolute cap: "spawn" has already re-imported the trainer's main module,
    which under the command line is torch, Lightning and transformers, about 1 GiB of address space with a CPU torch
    and more with CUDA's libraries, none of it the reward's doing (and not all of it memory in use). Only the soft
    limit is set, so a verifier process started by a reward process (which inherits its limit) can set its own.
    Linux only: RLIMIT_AS is not enforced on macOS, and /proc, which gives what is mapped, is Linux's."""
    if memory_gib is None or sys.platform != "linux":
        return
    import resource  # not on Windows

    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")  # VmSize, in bytes
    limit = mapped + int(memory_gib * 2**30)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:  # a `ulimit -v` of the shell: the soft limit cannot exceed it
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


class ChildProcess:
    """A "spawn"-started child process that serves requests over a pipe, and is killed and restarted when one
    overruns its deadline.

    Forking a parent that holds threads (or CUDA) can deadlock the child, hence "spawn": a start costs an interpreter
    start, a re-import of the parent's main module and the child's own imports, and a script that uses one must keep
    its top-level work under ``if __name__ == "__main__":``. The child reports ready before the first request, so a
    request's deadline measures the request, not the start. Calls from several threads take turns (``_lock``).
    """

    def __init__(self, target: Callable, args: tuple, name: str, daemon: bool, start_error: str) -> None:
        self._target, self._args, self._name, self._daemon = target, args, name, daemon
        self._start_error = start_error
        self._lock = threading.Lock()
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        self._owner_pid = os.getpid()

    def close(self) -> None:
        """Stops the child process; the next request starts a new one."""
        with self._lock:
            self._stop()

    def _connection(self) -> Connection:
        if self._forked():
            self._process, self._conn = None, None
        if self._process is None or not self._process.is_alive():
            self._start()
        assert self._conn is not None
        return self._conn

    def _forked(self) -> bool:
        """Whether this is a forked copy of the object that started the child (e.g. inside a fork-started data-loader
        worker): such a copy must not use the parent's child process (it may not even wait on it), and starts its
        own."""
        forked = self._owner_pid != os.getpid()
        self._owner_pid = os.getpid()
        return forked

    def _start(self) -> None:
        self._launch()
        # A child that cannot start must fail loudly, not let every request look answered.
        try:
            if not self._conn.poll(START_TIMEOUT_S):
                raise EOFError
            self._conn.recv()
        except EOFError:
            raise self._start_failed() from None

    def _launch(self) -> None:
        """Starts the child without waiting for it to report ready."""
        self._stop()
        context = multiprocessing.get_context("spawn")
        parent_conn, child_conn = context.Pipe()
        process = context.Process(target=self._target, args=(child_conn, *self._args), name=self._name,
                                  daemon=self._daemon)
        process.start()
        # The child holds its own end; closing ours lets recv() see EOF if the child dies.
        child_conn.close()
        self._process, self._conn = process, parent_conn
        if not self._daemon:
            # Registered after multiprocessing's own exit handler, so it runs first (atexit is last in, first out):
            # that handler would otherwise wait forever for a non-daemon child.
            atexit.register(self.close)

    def _start_failed(self) -> RuntimeError:
        self._stop()
        return RuntimeError(f"the {self._name} process did not start within {START_TIMEOUT_S:.0f} s (its error, "
                            f"if any, is on stderr); {self._start_error}")

    def _stop(self) -> None:
        if self._process is not None:
            self._kill()
            self._process.join()
            if not self._daemon:
                atexit.unregister(self.close)
        if self._conn is not None:
            self._conn.close()
        self._process, self._conn = None, None

    def _kill(self) -> None:
        self._process.kill()
