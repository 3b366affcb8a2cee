"""Verifiable rewards: 1.0 for a right answer, 0.0 otherwise.

Every reward has TRL's signature ``fn(prompts, completions, completion_ids, **columns) -> list[float | None]``:
``columns`` are the dataset's extra columns, each a list aligned with ``completions`` (``answer=[...]``), and unknown
ones are ignored, so the same function works in this trainer and as a TRL reward function. A completion is a string,
or, in conversational form (a chat template is applied), a list of messages ``[{"role": "assistant", "content":
...}]``; the built-in rewards take either. TRL lets a reward return None for "does not apply to this sample"; the
rewards here judge every sample and never do. A reward with settings is a class whose instances have that signature
(`MathAnswer`), built from a config's ``class_path``/``init_args``. ``model.reward`` may be a list of rewards, weighted
by ``model.reward_weights`` (`resolve_rewards`).

The trainer calls every reward in a process of its own (`TimedReward`), so that a batch it cannot score in time
can be cut off (`model.reward_timeout_s`) and one that allocates without bound fails there rather than take the
host's memory (`model.reward_memory_gib`); math_answer also bounds each check, in time and memory, in a pool of
verifier processes.
"""

import atexit
import functools
import importlib
import inspect
import logging
import math
import multiprocessing
import os
import pickle
import re
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Literal

logger = logging.getLogger(__name__)

RewardFn = Callable[..., list[float | None]]
# The built-in rewards, by the names a config gives them (the keys of _REWARDS). `RLVRModule`'s reward parameter
# is typed `RewardName | RewardFn`: jsonargparse then checks a name against this list, imports a dotted path to a
# function, and builds a class_path/init_args component (checking init_args against the class), all at parse time.
RewardName = Literal["exact_match", "math_answer"]

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_WORKERS = 2
# The address space a reward or verifier process may map beyond what it holds once started (`_limit_address_space`):
# 8 GiB, or a quarter of this machine's memory if that is less, so that several such processes cannot take it all.
DEFAULT_MEMORY_GIB = round(min(8.0, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 4 / 2**30), 1)
# Starting the verifier process (interpreter, the parent's main module, math-verify, sympy) takes seconds; allow for
# a loaded machine.
_START_TIMEOUT_S = 120.0


Completion = str | list[dict]  # a text, or in conversational form a list of messages


def completion_text(completion: Completion) -> str:
    """A completion's text, from either of TRL's forms: a string, or a list of messages whose last is the model's
    (``[{"role": "assistant", "content": text}]``)."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def exact_match(prompts: list, completions: list[Completion], answer: list[str], **_: object) -> list[float | None]:
    """1.0 where the completion is the answer up to surrounding whitespace (the embedded arithmetic task, whose
    completions end at EOS, so nothing may follow the answer)."""
    return [float(completion_text(completion).strip() == gold.strip())
            for completion, gold in zip(completions, answer, strict=True)]


# The last line that starts with "Answer:", the form DAPO-Math's prompts ask for ("Answer: $Answer" on its own
# line). Markdown bold around the label ("**Answer:** 12") is common enough in model output to accept.
_ANSWER_LINE = re.compile(r"^[ \t*]*answer[ \t*]*:[ \t*]*(.+?)[ \t]*$", re.IGNORECASE | re.MULTILINE)


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` whose braces close; None if there is none (a completion cut off
    inside the box has no answer)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    content_start = start + len("\\boxed{")
    for i in range(content_start - 1, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[content_start:i]
    return None


def extract_final_answer(completion: str) -> str | None:
    """The model's final answer: the last ``\\boxed{...}``, else the last ``Answer: ...`` line, else None."""
    boxed = _last_boxed(completion)
    if boxed is not None:
        return boxed
    lines = _ANSWER_LINE.findall(completion)
    return lines[-1] if lines else None


def _as_latex(answer: str) -> str:
    """Math-verify extracts LaTeX only between delimiters, so a bare answer ("\\frac{1}{2}", "34") is wrapped in
    ``$...$``; one already wrapped ("$\\frac{1}{2}$" on an Answer line) is unwrapped first so it is not doubled."""
    answer = answer.strip()
    if len(answer) >= 2 and answer.startswith("$") and answer.endswith("$"):
        answer = answer.strip("$")
    return f"${answer}$"


def _judge(prediction: str, gold: str) -> float:
    """Runs in a verifier process. Math-verify's own timeouts are off (None): they use ``signal.alarm``, which
    only works on a process's main thread; the parent bounds this call instead."""
    from math_verify import parse, verify

    # Math-verify warns once per process that its timeouts are disabled; that is deliberate here.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    gold_parsed = parse(_as_latex(gold), parsing_timeout=None)
    prediction_parsed = parse(_as_latex(prediction), parsing_timeout=None)
    return float(verify(gold_parsed, prediction_parsed, timeout_seconds=None))


def _check_memory_gib(memory_gib: float | None, key: str) -> None:
    """Refuses a memory limit that is not a positive, finite number of GiB (or None: no limit), naming its key."""
    if memory_gib is not None and (isinstance(memory_gib, bool) or not isinstance(memory_gib, (int, float))
                                   or not 0 < memory_gib < math.inf):
        raise ValueError(f"{key} must be a positive number of GiB (or null: no limit), got {memory_gib!r}")


def _limit_address_space(memory_gib: float | None) -> None:
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


def _serve_checks(conn: Connection, check: Callable[..., float], warmup: tuple, memory_gib: float | None) -> None:
    """A check worker's loop: score each item it receives with ``check(*item)`` until the parent closes the pipe.
    A check that runs out of memory (past ``memory_gib``) is reported as "memory" rather than scored, so that the
    parent warns and replaces this process (sympy's caches may be half-built)."""
    _limit_address_space(memory_gib)
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


class _ChildProcess:
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
            if not self._conn.poll(_START_TIMEOUT_S):
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
        return RuntimeError(f"the {self._name} process did not start within {_START_TIMEOUT_S:.0f} s (its error, "
                            f"if any, is on stderr); {self._start_error}")

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join()
            if not self._daemon:
                atexit.unregister(self.close)
        if self._conn is not None:
            self._conn.close()
        self._process, self._conn = None, None


class _CheckWorker(_ChildProcess):
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
        self.starting, self.index, self.deadline = True, None, time.monotonic() + _START_TIMEOUT_S

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


# The math verifier pools of this process, by their number of workers and memory limit, started on first use
# (importing this module starts nothing).
_MATH_POOLS: dict[tuple[int, float | None], CheckPool] = {}
_MATH_POOLS_LOCK = threading.Lock()


def _math_pool(workers: int, memory_gib: float | None) -> CheckPool:
    with _MATH_POOLS_LOCK:
        if (workers, memory_gib) not in _MATH_POOLS:
            _MATH_POOLS[workers, memory_gib] = CheckPool(
                _judge, workers, warmup=("1", "1"), name="math verifier",
                start_error="math_answer needs math-verify: pip install 'lightning-logra[math]'",
                memory_gib=memory_gib,
                memory_advice="if right answers need more, raise memory_gib in model.reward's init_args "
                              "(class_path: lightning_logra.rewards.MathAnswer; null: no limit)")
        return _MATH_POOLS[workers, memory_gib]


def math_answer(prompts: list, completions: list[Completion], answer: list[str], timeout_s: float = DEFAULT_TIMEOUT_S,
                workers: int = DEFAULT_WORKERS, memory_gib: float | None = DEFAULT_MEMORY_GIB,
                **_: object) -> list[float | None]:
    """1.0 where the completion's final answer (its last ``\\boxed{}``, else its last ``Answer:`` line) is
    mathematically equal to the gold answer by math-verify (``\\frac{1}{2}`` = ``0.5``, ``2\\sqrt{2}`` =
    ``\\sqrt{8}``), else 0.0. The answers are checked by ``workers`` processes in parallel; each check is cut off
    after ``timeout_s`` seconds, or when it needs more than ``memory_gib`` GiB, and then scores 0.0. Safe to call
    from any thread."""
    predictions = [extract_final_answer(completion_text(completion)) for completion in completions]
    items = [None if prediction is None else (prediction, str(gold))
             for prediction, gold in zip(predictions, answer, strict=True)]
    return _math_pool(workers, memory_gib).score(items, timeout_s)


class MathAnswer:
    """`math_answer` with its settings, for a config::

        reward:
          class_path: lightning_logra.rewards.MathAnswer
          init_args: {timeout_s: 10.0, workers: 4}

    Args:
        timeout_s: the seconds one answer's check may take; past it the answer scores 0.0 (sympy can spend minutes
            on an answer such as ``10^{10^{10}}``), its verifier process is replaced, and the others go on.
        workers: verifier processes checking a batch's answers in parallel (each a few milliseconds per answer,
            and about 100 MB for sympy).
        memory_gib: the address space, in GiB, a verifier process may map beyond what it holds once started
            (default: 8, or a quarter of the machine's memory if less); a check that needs more scores 0.0 and its
            process is replaced, as at the timeout. None: no limit.
    """

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, workers: int = DEFAULT_WORKERS,
                 memory_gib: float | None = DEFAULT_MEMORY_GIB) -> None:
        if not timeout_s > 0:
            raise ValueError(f"model.reward: MathAnswer's timeout_s must be a positive number of seconds, "
                             f"got {timeout_s}")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"model.reward: MathAnswer's workers must be a positive number of processes, "
                             f"got {workers!r}")
        _check_memory_gib(memory_gib, "model.reward: MathAnswer's memory_gib")
        self.timeout_s, self.workers, self.memory_gib = timeout_s, workers, memory_gib

    def __call__(self, prompts: list, completions: list[Completion], answer: list[str],
                 **_: object) -> list[float | None]:
        return math_answer(prompts, completions, answer, timeout_s=self.timeout_s, workers=self.workers,
                           memory_gib=self.memory_gib)

    def __repr__(self) -> str:
        return f"MathAnswer(timeout_s={self.timeout_s}, workers={self.workers}, memory_gib={self.memory_gib})"


_REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "math_answer": math_answer}


def import_reward(path: str) -> RewardFn:
    """A reward function (or class) by dotted import path ("pkg.module.fn")."""
    module, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"model.reward: cannot import {path!r} ({err})") from err


def reward_name(reward: str | RewardFn) -> str:
    """How messages name a reward: as the config named it, else by the import path of its function or class."""
    if isinstance(reward, str):
        return reward
    if inspect.isfunction(reward):
        return f"{reward.__module__}.{reward.__qualname__}"
    if type(reward).__repr__ is not object.__repr__:  # an object that shows its settings (MathAnswer)
        return repr(reward)
    return f"{type(reward).__module__}.{type(reward).__qualname__}"


def _serve_reward(conn: Connection, payload: bytes, memory_gib: float | None) -> None:
    """The reward process's loop: call the reward on each batch it receives until the parent closes the pipe (or
    dies: the pipe closes with it). The reward is unpickled once, so state it builds on first use (a client, a
    judge model) lasts for the life of the process. Its memory is limited from the start (`_limit_address_space`),
    unpickling included."""
    _limit_address_space(memory_gib)
    fn = pickle.loads(payload)
    conn.send("ready")
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
        try:
            conn.send(answer)
        except (BrokenPipeError, EOFError):
            return


class RewardProcess(_ChildProcess):
    """Calls a reward (sent pickled) in a child process, giving up on a batch after ``timeout_s``, or when the
    reward needs more than ``memory_gib`` GiB of address space beyond what the process holds once started.

    Custom rewards can be anything (running code, asking a model, a regex that backtracks forever, a list that
    grows without end). As for the math check, only a process can be stopped: when a batch runs past the deadline or
    out of memory, the child is killed, every completion of the batch scores None (nothing is learned from it) and a
    fresh child takes the next batch. Not a daemon, so that the reward may start processes of its own (math_answer
    does). It is stopped when this process exits, and, blocked on the pipe, ends by itself if this process is killed.
    """

    def __init__(self, payload: bytes, name: str, memory_gib: float | None) -> None:
        self.name, self.memory_gib = name, memory_gib
        super().__init__(_serve_reward, (payload, memory_gib), "reward", daemon=False,
                         start_error=f"model.reward {name!r} could not be started")

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
                                       f"{self._memory_note()}")
                if kind == "memory":
                    logger.warning("model.reward %r ran out of memory on a batch of %d completions: its process may "
                                   "map model.reward_memory_gib=%s GiB beyond what it holds once started. They score "
                                   "None and the process is replaced; raise model.reward_memory_gib (null: no limit) "
                                   "if the reward needs more", self.name, len(completions), self.memory_gib)
                else:
                    logger.warning("the reward process of model.reward %r died on a batch of %d completions; they "
                                   "score None and a new process is started", self.name, len(completions))
            else:
                logger.warning("model.reward %r ran past model.reward_timeout_s=%.0f s on a batch of %d completions "
                               "(%.0f s): they score None (nothing is learned from them) and the reward process is "
                               "replaced", self.name, timeout_s, len(completions), time.monotonic() - start)
            self._stop()
            return [None] * len(completions)

    def _memory_note(self) -> str:
        """What to know of an error that may be an allocation refused under the limit but not raised as a
        MemoryError: torch's ("can't allocate memory") is a RuntimeError, and CUDA reserves far more address space
        than the memory it uses."""
        if self.memory_gib is None:
            return ""
        return (f"\n(The reward process may map model.reward_memory_gib={self.memory_gib:g} GiB beyond what it holds "
                f"once started; if the error is an allocation that failed, raise it, or set it to null for a reward "
                f"that runs on a GPU.)")


# One reward process per reward (its pickled form: the same function, or a class with the same settings), memory
# limit and training process, started on first use and shared by every module that holds it (a test session builds
# many).
_REWARD_PROCESSES: dict[tuple[bytes, float | None], RewardProcess] = {}


class TimedReward:
    """A reward called in its `RewardProcess` with a deadline of ``timeout_s`` per batch and a limit of
    ``memory_gib`` GiB of address space beyond the process's start (None: no limit). Holds the reward pickled, as it
    is sent to that process, so a module that holds it can still be copied and pickled."""

    def __init__(self, reward: RewardFn, timeout_s: float, memory_gib: float | None = DEFAULT_MEMORY_GIB) -> None:
        self.name, self.timeout_s, self.memory_gib = reward_name(reward), timeout_s, memory_gib
        # Fail at set-up, naming the key, rather than when the first batch is scored.
        try:
            self.payload = pickle.dumps(reward)
        except Exception as err:  # pickle raises PicklingError, TypeError or AttributeError, by what it meets
            raise ValueError(
                f"model.reward {self.name!r} cannot be sent to its reward process: it does not pickle "
                f"({type(err).__name__}: {err}). Define the function or class at the top level of a module, keep "
                f"what does not pickle (locks, clients, open files) out of its attributes until the first call, or "
                f"set model.reward_timeout_s: null to call it in the trainer's process without a deadline"
            ) from err

    def __call__(self, prompts: list, completions: list, **columns: list) -> list[float | None]:
        key = (self.payload, self.memory_gib)
        process = _REWARD_PROCESSES.get(key)
        if process is None:
            process = _REWARD_PROCESSES[key] = RewardProcess(self.payload, self.name, self.memory_gib)
        return process(prompts, completions, self.timeout_s, **columns)


def get_reward(name: str) -> RewardFn:
    """The reward function a config names."""
    try:
        return _REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; known rewards: {sorted(_REWARDS)}") from None


def resolve_reward(reward: str | RewardFn, timeout_s: float | None,
                   memory_gib: float | None = DEFAULT_MEMORY_GIB) -> RewardFn:
    """``model.reward`` made a callable, called in a process of its own with a deadline of `timeout_s` per batch and
    `memory_gib` GiB of address space beyond that process's start (`timeout_s` None: in this process, without a
    deadline or a limit).

    The reward is a built-in name ("exact_match", "math_answer"), a dotted path ("pkg.mod.fn"; a class named so is
    built with its defaults), or a callable already built: what the command line hands over for a dotted path or a
    ``class_path``/``init_args`` component, or what Python code passes.
    """
    if isinstance(reward, str):
        reward = import_reward(reward) if "." in reward else get_reward(reward)
    if inspect.isclass(reward):
        reward = reward()
    if not callable(reward):
        raise TypeError(f"model.reward must be a reward name, a dotted path or a callable "
                        f"fn(prompts, completions, **columns); got {type(reward).__name__}")
    return reward if timeout_s is None else TimedReward(reward, timeout_s, memory_gib)


@dataclass(frozen=True)
class Reward:
    """One of ``model.reward``'s rewards, as the module calls it."""

    fn: RewardFn  # called with TRL's signature: a TimedReward (its own process and deadline) or the reward itself
    name: str  # how messages name it: as the config did (`reward_name`)
    key: str  # how metrics name it: reward/<key>/mean, reward/<key>/std
    weight: float  # its weight in the total reward


def _metric_key(reward: RewardFn) -> str:
    """TRL's name for a reward in its metrics: a function's ``__name__``, else the class name of an instance."""
    while isinstance(reward, functools.partial):
        reward = reward.func
    return getattr(reward, "__name__", type(reward).__name__)


def resolve_rewards(reward: str | RewardFn | list[str | RewardFn], weights: list[float] | None,
                    timeout_s: float | None, memory_gib: float | None = DEFAULT_MEMORY_GIB) -> list[Reward]:
    """``model.reward`` (one reward or a list, each as `resolve_reward` takes it) with ``model.reward_weights`` (one
    weight per reward; None: 1.0 each), as TRL's ``reward_funcs`` and ``reward_weights``, each called in a process of
    its own with ``model.reward_timeout_s`` and ``model.reward_memory_gib`` (`TimedReward`). Metric names are unique:
    a name met again is numbered (``StartsWith``, ``StartsWith_2``)."""
    _check_memory_gib(memory_gib, "model.reward_memory_gib")
    rewards = list(reward) if isinstance(reward, (list, tuple)) else [reward]
    if not rewards:
        raise ValueError("model.reward is an empty list: give at least one reward")
    if weights is None:
        weights = [1.0] * len(rewards)
    if len(weights) != len(rewards):
        raise ValueError(f"model.reward_weights has {len(weights)} weights for the {len(rewards)} rewards of "
                         f"model.reward: give one weight per reward, in the same order (or null for 1.0 each)")
    if not all(isinstance(w, (int, float)) and math.isfinite(w) for w in weights):
        raise ValueError(f"model.reward_weights must be finite numbers, got {list(weights)}")
    resolved, keys = [], []
    for given, weight in zip(rewards, weights, strict=True):
        fn = resolve_reward(given, timeout_s=None)
        key = base = _metric_key(fn)
        number = 1
        while key in keys:
            number += 1
            key = f"{base}_{number}"
        keys.append(key)
        resolved.append(Reward(fn if timeout_s is None else TimedReward(fn, timeout_s, memory_gib), reward_name(given),
                               key, float(weight)))
    return resolved
