"""The processes rewards run in: one per reward with a deadline per batch and an address-space limit
(`TimedReward`, `RewardProcess`), and pools of check processes with a deadline per item (`CheckPool`, math_answer's
verifiers).

Custom rewards can be anything (running code, asking a model, a regex that backtracks forever, a list that grows
without end): only a process can be stopped, so every reward is called in one of its own (`model.scoring.timeout_s`,
`model.scoring.memory_gib`).
"""

import logging
import math
import os
import pickle
import re
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from lightning_logra.base.child import (
    DEFAULT_MEMORY_GIB,
    START_TIMEOUT_S,
    ChildProcess,
    limit_address_space,
)

logger = logging.getLogger(__name__)

def _serve_checks(conn: Connection, check: Callable[..., float], warmup: tuple, memory_gib: float | None) -> None:
    """A check worker's loop: score each item it receives with ``check(*item)`` until the parent closes the pipe.
    A check that runs out of memory (past ``memory_gib``) is reported as "memory" rather than scored, so that the
    parent warns and replaces this process (sympy's caches may be half-built)."""
    limit_address_space(memory_gib)
    # Run one check before reporting ready (for math-verify: import it and sympy and warm their caches), so that
    # a check's deadline measures the check, not the start of this process.
    check(*warmup)
    conn.send("ready")
    while True:
        try:
            item = conn.recv()
        except EOFError:
            return
        try:
            score = float(check(*item))
        except MemoryError:
            score = "memory"
        except Exception:
            # An answer that makes math-verify or sympy raise cannot be confirmed right, so it is wrong.
            score = 0.0
        conn.send(score)


class _CheckWorker(ChildProcess):
    """One process of a `CheckPool`, and what it is doing: starting (until it reports ready), checking one item (its
    index in the batch), or idle."""

    def __init__(self, check: Callable[..., float], warmup: tuple, memory_gib: float | None, name: str,
                 start_error: str) -> None:
        # daemon: the child dies with this process even if close() is never called.
        super().__init__(_serve_checks, (check, warmup, memory_gib), name, daemon=True, start_error=start_error)
        self.starting = False
        self.index: int | None = None
        self.deadline = math.inf  # of the start or of the check

    @property
    def busy(self) -> bool:
        return self.starting or self.index is not None

    def launch(self) -> None:
        self._launch()
        self.starting, self.index, self.deadline = True, None, time.monotonic() + START_TIMEOUT_S

    def send(self, index: int, item: tuple, timeout_s: float) -> None:
        self._conn.send(item)
        self.index, self.deadline = index, time.monotonic() + timeout_s


class CheckPool:
    """``workers`` processes that score items with ``check(*item)`` in parallel, each check cut off after ``timeout_s``
    and allowed ``memory_gib`` GiB of address space beyond what its process maps once started (None: no limit).

    Why processes, and of our own: rewards get called from threads other than the main one (Lightning hooks, data-
    loader and rollout threads), where math-verify's ``signal.alarm`` timeout cannot be set. A check run in a thread
    could be waited for with a timeout, but a thread cannot be killed: sympy can spend minutes or forever on an answer
    such as ``10^{10^{10}}``, and every such answer would leave one more thread burning a core for the rest of the run.
    A process can be killed, but a ``ProcessPoolExecutor`` (or a ``multiprocessing.Pool``) cannot kill one stuck
    worker, only wait for it or stop them all. So each worker here takes one item at a time with a deadline; one that
    overruns it is killed (its item scores 0.0) and a fresh one started in its place, while the other workers go on
    with the rest of the batch. The fresh one joins when it reports ready (an interpreter start and the imports, not
    counted against any item's deadline). A check that raises scores 0.0; one that runs out of memory scores 0.0 and
    its process is replaced, with a warning that ends with ``memory_advice`` (the setting to raise). Calls from
    several threads take turns.
    """

    def __init__(self, check: Callable[..., float], workers: int, warmup: tuple, name: str, start_error: str,
                 memory_gib: float | None, memory_advice: str) -> None:
        self._name, self._memory_gib, self._memory_advice = name, memory_gib, memory_advice
        self._lock = threading.Lock()
        self._workers = [_CheckWorker(check, warmup, memory_gib, name, start_error) for _ in range(workers)]

    def close(self) -> None:
        """Stops the worker processes; the next batch starts new ones."""
        with self._lock:
            self._stop_workers()

    def _stop_workers(self) -> None:
        for worker in self._workers:
            if not worker._forked():
                worker._stop()
            worker._process, worker._conn, worker.starting, worker.index = None, None, False, None

    def score(self, items: list[tuple | None], timeout_s: float) -> list[float]:
        """One score per item, in order; a None item scores 0.0 without a check."""
        with self._lock:
            scores = [0.0] * len(items)
            queue = deque(index for index, item in enumerate(items) if item is not None)
            try:
                if queue:
                    self._start_workers()
                while queue or any(worker.index is not None for worker in self._workers):
                    for worker in self._workers:
                        if queue and not worker.busy:
                            index = queue.popleft()
                            worker.send(index, items[index], timeout_s)
                    busy = [worker for worker in self._workers if worker.busy]
                    ready = wait([worker._conn for worker in busy],
                                 max(0.0, min(worker.deadline for worker in busy) - time.monotonic()))
                    for worker in busy:
                        if worker._conn in ready:
                            self._receive(worker, scores, items)
                        elif time.monotonic() >= worker.deadline:
                            self._overrun(worker, items, timeout_s)
            except BaseException:
                self._stop_workers()  # their answers to this batch must not be read as the next batch's
                raise
            return scores

    def _start_workers(self) -> None:
        for worker in self._workers:
            if worker._forked():  # a forked copy of the pool: the processes are the parent's, not to be touched
                worker._process, worker._conn, worker.starting, worker.index = None, None, False, None
            if worker._process is None or not (worker.starting or worker._process.is_alive()):
                worker.launch()  # first use, or the process died while idle (e.g. killed for memory)

    def _receive(self, worker: _CheckWorker, scores: list[float], items: list[tuple | None]) -> None:
        try:
            message = worker._conn.recv()
        except EOFError:
            if worker.starting:
                raise worker._start_failed() from None
            # The worker died on this item (e.g. killed for memory).
            logger.warning("%s process died on %.200r; scored 0.0 and replaced it", self._name, items[worker.index])
            worker.launch()
            return
        if worker.starting:
            worker.starting, worker.deadline = False, math.inf  # the "ready" message
        elif message == "memory":
            logger.warning("%s ran out of memory (%s GiB beyond its start) on %.200r; scored 0.0 and replaced its "
                           "process: %s", self._name, self._memory_gib, items[worker.index], self._memory_advice)
            worker.launch()
        else:
            scores[worker.index] = message
            worker.index, worker.deadline = None, math.inf

    def _overrun(self, worker: _CheckWorker, items: list[tuple | None], timeout_s: float) -> None:
        if worker.starting:
            raise worker._start_failed()
        logger.warning("%s exceeded %.1f s on %.200r; scored 0.0 and replaced its process", self._name, timeout_s,
                       items[worker.index])
        worker.launch()  # kills the stuck process first


def _serve_reward(conn: Connection, payload: bytes, memory_gib: float | None) -> None:
    """The reward process's loop: call the reward on each batch it receives until the parent closes the pipe (or
    dies: the pipe closes with it). The reward is unpickled once, so state it builds on first use (a client, a
    judge model) lasts for the life of the process. Its memory is limited from the start (`limit_address_space`),
    unpickling included."""
    # A group of its own, so that stopping it stops what the reward started too (processes it forked or spawned).
    os.setpgid(0, 0)
    limit_address_space(memory_gib)
    fn = pickle.loads(payload)
    conn.send("ready")
    me = os.getpid()
    while True:
        try:
            prompts, completions, columns = conn.recv()
        except EOFError:
            return
        try:
            answer = ("rewards", list(fn(prompts, completions, **columns)))
        except MemoryError:
            # Past the limit: reported apart from other errors (which stop the run), since the parent scores the
            # batch as a missed deadline. No traceback is formatted: until this block ends, the traceback keeps the
            # reward's frames, and what they allocated, alive.
            answer = ("memory", None)
        except Exception:
            answer = ("error", traceback.format_exc())
        if os.getpid() != me:
            # A copy of this process the reward forked has come back here: only the process that was asked answers
            # (a second answer on the pipe would be taken for the next batch's), and the copy must not read the
            # requests meant for it.
            os._exit(0)
        try:
            conn.send(answer)
        except (BrokenPipeError, EOFError):
            return


class RewardProcess(ChildProcess):
    """Calls a reward (sent pickled) in a child process, giving up on a batch after ``timeout_s``, or when the
    reward needs more than ``memory_gib`` GiB of address space beyond what the process holds once started.

    Custom rewards can be anything (running code, asking a model, a regex that backtracks forever, a list that
    grows without end). As for the math check, only a process can be stopped: when a batch runs past the deadline or
    out of memory, the child is killed, every completion of the batch scores None (nothing is learned from it) and a
    fresh child takes the next batch. Not a daemon, so that the reward may start processes of its own (math_answer
    does). It is stopped when this process exits, and, blocked on the pipe, ends by itself if this process is killed.
    It leads a process group of its own, stopped with it, so that nothing the reward forked or started outlives it;
    and a copy of it that the reward forked never answers (nor reads) a batch.
    """

    def __init__(self, payload: bytes, name: str, memory_gib: float | None) -> None:
        self.name, self.memory_gib = name, memory_gib
        super().__init__(_serve_reward, (payload, memory_gib), "reward", daemon=False,
                         start_error=f"model.reward {name!r} could not be started")

    def _kill(self) -> None:
        # The process and its group (what the reward forked or started), unless it has not made the group yet.
        try:
            os.killpg(self._process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self._process.kill()

    def __call__(self, prompts: list, completions: list, timeout_s: float,
                 **columns: list) -> list[float | None]:
        with self._lock:
            conn = self._connection()
            start = time.monotonic()
            conn.send((prompts, completions, columns))
            if conn.poll(timeout_s):
                try:
                    kind, value = conn.recv()
                except EOFError:
                    kind, value = "died", None
                if kind == "rewards":
                    return value
                if kind == "error":
                    raise RuntimeError(f"model.reward {self.name!r} raised in its reward process:\n{value}"
                                       f"{self._memory_note(value)}")
                if kind == "memory":
                    logger.warning("model.reward %r ran out of memory on a batch of %d completions: its process may "
                                   "map model.scoring.memory_gib=%s GiB beyond what it holds once started. They score "
                                   "None and the process is replaced; raise model.scoring.memory_gib (null: no limit) "
                                   "if the reward needs more", self.name, len(completions), self.memory_gib)
                else:
                    logger.warning("the reward process of model.reward %r died on a batch of %d completions; they "
                                   "score None and a new process is started", self.name, len(completions))
            else:
                logger.warning("model.reward %r ran past model.scoring.timeout_s=%.0f s on a batch of %d completions "
                               "(%.0f s): they score None (nothing is learned from them) and the reward process is "
                               "replaced", self.name, timeout_s, len(completions), time.monotonic() - start)
            self._stop()
            return [None] * len(completions)

    def _memory_note(self, error: str) -> str:
        """What to know of an error that may be an allocation refused under the limit but not raised as a
        MemoryError: torch's ("can't allocate memory") is a RuntimeError, and CUDA reserves far more address space
        than the memory it uses. Only for an error that speaks of memory: any other has nothing to do with it."""
        if self.memory_gib is None or not _ALLOCATION.search(error):
            return ""
        return (f"\n(The reward process may map model.scoring.memory_gib={self.memory_gib:g} GiB beyond what it holds "
                "once started; if the error is an allocation that failed, raise it, or set it to null for a reward "
                "that runs on a GPU.)")


# How a failed allocation reads in a traceback (Python's, torch's, CUDA's, the C library's).
_ALLOCATION = re.compile(r"alloc|memory|ENOMEM|mmap", re.IGNORECASE)

# One reward process per reward (its pickled form: the same function, or a class with the same settings), memory
# limit and training process, started on first use and shared by every module that holds it (a test session builds
# many).
_REWARD_PROCESSES: dict[tuple[bytes, float | None], RewardProcess] = {}


class TimedReward:
    """A reward called in its `RewardProcess` with a deadline of ``timeout_s`` per batch and a limit of
    ``memory_gib`` GiB of address space beyond the process's start (None: no limit). Holds the reward pickled, as it
    is sent to that process, so a module that holds it can still be copied and pickled."""

    def __init__(self, reward: Callable, name: str, timeout_s: float, memory_gib: float | None = DEFAULT_MEMORY_GIB
                 ) -> None:
        self.name, self.timeout_s, self.memory_gib = name, timeout_s, memory_gib
        # Fail at set-up, naming the key, rather than when the first batch is scored.
        try:
            self.payload = pickle.dumps(reward)
        except Exception as err:  # pickle raises PicklingError, TypeError or AttributeError, by what it meets
            raise ValueError(
                f"model.reward {self.name!r} cannot be sent to its reward process: it does not pickle "
                f"({type(err).__name__}: {err}). Define the function or class at the top level of a module, keep "
                f"what does not pickle (locks, clients, open files) out of its attributes until the first call, or "
                f"set model.scoring.timeout_s: null to call it in the trainer's process without a deadline"
            ) from err

    def __call__(self, prompts: list, completions: list, **columns: list) -> list[float | None]:
        key = (self.payload, self.memory_gib)
        process = _REWARD_PROCESSES.get(key)
        if process is None:
            process = _REWARD_PROCESSES[key] = RewardProcess(self.payload, self.name, self.memory_gib)
        return process(prompts, completions, self.timeout_s, **columns)
