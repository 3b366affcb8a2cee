"""Verifiable rewards: 1.0 for a right answer, 0.0 otherwise.

Every reward has TRL's signature ``fn(prompts, completions, **columns) -> list[float | None]``: ``columns`` are the
dataset's extra columns, each a list aligned with ``completions`` (``answer=[...]``), and unknown ones are ignored,
so the same function works in this trainer and as a TRL reward function. TRL lets a reward return None for "does
not apply to this sample"; the rewards here judge every sample and never do. A reward with settings is a class whose
instances have that signature (`MathAnswer`), built from a config's ``class_path``/``init_args``.

The trainer calls every reward in a process of its own (`TimedReward`), so that a batch it cannot score in time
can be cut off (`model.reward_timeout_s`); math_answer also bounds each check in its own verifier process.
"""

import atexit
import importlib
import inspect
import logging
import multiprocessing
import os
import pickle
import re
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Literal

logger = logging.getLogger(__name__)

RewardFn = Callable[..., list[float | None]]
# The built-in rewards, by the names a config gives them (the keys of _REWARDS). `RLVRModule`'s reward parameter
# is typed `RewardName | RewardFn`: jsonargparse then checks a name against this list, imports a dotted path to a
# function, and builds a class_path/init_args component (checking init_args against the class), all at parse time.
RewardName = Literal["exact_match", "math_answer"]

DEFAULT_TIMEOUT_S = 5.0
# Starting the verifier process (interpreter, the parent's main module, math-verify, sympy) takes seconds; allow for
# a loaded machine.
_START_TIMEOUT_S = 120.0


def exact_match(prompts: list[str], completions: list[str], answer: list[str], **_: object) -> list[float | None]:
    """1.0 where the completion is the answer up to surrounding whitespace (the embedded arithmetic task, whose
    completions end at EOS, so nothing may follow the answer)."""
    return [float(completion.strip() == gold.strip()) for completion, gold in zip(completions, answer, strict=True)]


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
    """Runs in the verifier process. Math-verify's own timeouts are off (None): they use ``signal.alarm``, which
    only works on a process's main thread; the parent bounds this call instead."""
    from math_verify import parse, verify

    gold_parsed = parse(_as_latex(gold), parsing_timeout=None)
    prediction_parsed = parse(_as_latex(prediction), parsing_timeout=None)
    return float(verify(gold_parsed, prediction_parsed, timeout_seconds=None))


def _serve(conn: Connection) -> None:
    """The verifier process's loop: judge each ``(prediction, gold)`` pair it receives until the parent closes
    the pipe."""
    # Math-verify warns once per process that its timeouts are disabled; that is deliberate here (see _judge).
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    # Import math-verify and sympy and warm their caches before reporting ready, so that a check's timeout
    # measures the check, not the start of this process.
    _judge("1", "1")
    conn.send("ready")
    while True:
        try:
            prediction, gold = conn.recv()
        except EOFError:
            return
        try:
            score = _judge(prediction, gold)
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
        # A forked copy of this object (e.g. inside a fork-started data-loader worker) must not use the parent's
        # child process: it may not even wait on it. It starts its own.
        if self._owner_pid != os.getpid():
            self._process, self._conn, self._owner_pid = None, None, os.getpid()
        if self._process is None or not self._process.is_alive():
            self._start()
        assert self._conn is not None
        return self._conn

    def _start(self) -> None:
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
        # A child that cannot start must fail loudly, not let every request look answered.
        try:
            if not parent_conn.poll(_START_TIMEOUT_S):
                raise EOFError
            parent_conn.recv()
        except EOFError:
            self._stop()
            raise RuntimeError(f"the {self._name} process did not start within {_START_TIMEOUT_S:.0f} s (its error, "
                               f"if any, is on stderr); {self._start_error}") from None

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join()
            if not self._daemon:
                atexit.unregister(self.close)
        if self._conn is not None:
            self._conn.close()
        self._process, self._conn = None, None


class MathVerifier(_ChildProcess):
    """Judges answers with math-verify in a child process, giving up on any one answer after ``timeout_s``.

    Why a process: rewards get called from threads other than the main one (Lightning hooks, data-loader and
    rollout threads), where math-verify's ``signal.alarm`` timeout cannot be set. Running the check in a worker
    thread and waiting with a timeout would return on time, but a thread cannot be killed: sympy can spend minutes
    or forever on an answer such as ``10^{10^{10}}``, and every such answer would leave one more thread burning a
    core, and contending for the GIL with training, for the rest of the run. A process can be killed. So one child
    process judges the answers one at a time; when an answer runs past the timeout the child is killed (scoring
    that answer 0.0) and a fresh one is started for the next. A ``ProcessPoolExecutor`` would not do: it cannot
    kill one stuck worker, only wait for it.

    A restart (an interpreter start and the math-verify import, see `_ChildProcess`) is paid only after a timeout
    and not counted against the next answer's timeout. Calls from several threads take turns on the one child,
    which is fine at a few milliseconds a check.
    """

    def __init__(self) -> None:
        # daemon: the child dies with this process even if close() is never called.
        super().__init__(_serve, (), "math verifier", daemon=True,
                         start_error="math_answer needs math-verify: pip install 'lightning-logra[math]'")

    def score(self, predictions: list[str | None], golds: list[str], timeout_s: float) -> list[float]:
        """1.0 or 0.0 per pair; a missing prediction (None) is 0.0 without a check."""
        with self._lock:
            return [0.0 if prediction is None else self._score_one(prediction, gold, timeout_s)
                    for prediction, gold in zip(predictions, golds, strict=True)]

    def _score_one(self, prediction: str, gold: str, timeout_s: float) -> float:
        conn = self._connection()
        conn.send((prediction, gold))
        if conn.poll(timeout_s):
            try:
                return conn.recv()
            except EOFError:
                # poll also returns when the child died (e.g. killed for memory); the next call restarts it.
                logger.warning("math verifier process died judging %.200r; scored 0.0", prediction)
                self._stop()
                return 0.0
        logger.warning("math verification exceeded %.1f s on %.200r; scored 0.0 and replaced the verifier process",
                       timeout_s, prediction)
        self._stop()
        return 0.0


# One verifier per process, started on first use, so importing this module starts nothing.
_VERIFIER = MathVerifier()


def math_answer(prompts: list[str], completions: list[str], answer: list[str], timeout_s: float = DEFAULT_TIMEOUT_S,
                **_: object) -> list[float | None]:
    """1.0 where the completion's final answer (its last ``\\boxed{}``, else its last ``Answer:`` line) is
    mathematically equal to the gold answer by math-verify (``\\frac{1}{2}`` = ``0.5``, ``2\\sqrt{2}`` =
    ``\\sqrt{8}``), else 0.0. Each check is cut off after ``timeout_s`` seconds and then scores 0.0; safe to call
    from any thread."""
    predictions = [extract_final_answer(completion) for completion in completions]
    return _VERIFIER.score(predictions, [str(gold) for gold in answer], timeout_s)


class MathAnswer:
    """`math_answer` with its setting, for a config::

        reward:
          class_path: lightning_logra.rewards.MathAnswer
          init_args: {timeout_s: 10.0}

    Args:
        timeout_s: the seconds one answer's check may take; past it the answer scores 0.0 (sympy can spend minutes
            on an answer such as ``10^{10^{10}}``).
    """

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not timeout_s > 0:
            raise ValueError(f"model.reward: MathAnswer's timeout_s must be a positive number of seconds, "
                             f"got {timeout_s}")
        self.timeout_s = timeout_s

    def __call__(self, prompts: list[str], completions: list[str], answer: list[str],
                 **_: object) -> list[float | None]:
        return math_answer(prompts, completions, answer, timeout_s=self.timeout_s)

    def __repr__(self) -> str:
        return f"MathAnswer(timeout_s={self.timeout_s})"


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


def _serve_reward(conn: Connection, payload: bytes) -> None:
    """The reward process's loop: call the reward on each batch it receives until the parent closes the pipe (or
    dies: the pipe closes with it). The reward is unpickled once, so state it builds on first use (a client, a
    judge model) lasts for the life of the process."""
    fn = pickle.loads(payload)
    conn.send("ready")
    while True:
        try:
            prompts, completions, columns = conn.recv()
        except EOFError:
            return
        try:
            answer = ("rewards", list(fn(prompts, completions, **columns)))
        except Exception:
            answer = ("error", traceback.format_exc())
        try:
            conn.send(answer)
        except (BrokenPipeError, EOFError):
            return


class RewardProcess(_ChildProcess):
    """Calls a reward (sent pickled) in a child process, giving up on a batch after ``timeout_s``.

    Custom rewards can be anything (running code, asking a model, a regex that backtracks forever). As for the math
    check, only a process can be stopped: when a batch runs past the deadline, the child is killed, every completion
    of the batch scores None (nothing is learned from it) and a fresh child takes the next batch. Not a daemon, so
    that the reward may start processes of its own (math_answer does).
    It is stopped when this process exits, and, blocked on the pipe, ends by itself if this process is killed.
    """

    def __init__(self, payload: bytes, name: str) -> None:
        self.name = name
        super().__init__(_serve_reward, (payload,), "reward", daemon=False,
                         start_error=f"model.reward {name!r} could not be started")

    def __call__(self, prompts: list[str], completions: list[str], timeout_s: float,
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
                    raise RuntimeError(f"model.reward {self.name!r} raised in its reward process:\n{value}")
                logger.warning("the reward process of model.reward %r died on a batch of %d completions; they "
                               "score None and a new process is started", self.name, len(completions))
            else:
                logger.warning("model.reward %r ran past model.reward_timeout_s=%.0f s on a batch of %d completions "
                               "(%.0f s): they score None (nothing is learned from them) and the reward process is "
                               "replaced", self.name, timeout_s, len(completions), time.monotonic() - start)
            self._stop()
            return [None] * len(completions)


# One reward process per reward (its pickled form: the same function, or a class with the same settings) and
# training process, started on first use and shared by every module that holds it (a test session builds many).
_REWARD_PROCESSES: dict[bytes, RewardProcess] = {}


class TimedReward:
    """A reward called in its `RewardProcess` with a deadline of ``timeout_s`` per batch. Holds the reward pickled,
    as it is sent to that process, so a module that holds it can still be copied and pickled."""

    def __init__(self, reward: RewardFn, timeout_s: float) -> None:
        self.name, self.timeout_s = reward_name(reward), timeout_s
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

    def __call__(self, prompts: list[str], completions: list[str], **columns: list) -> list[float | None]:
        process = _REWARD_PROCESSES.get(self.payload)
        if process is None:
            process = _REWARD_PROCESSES[self.payload] = RewardProcess(self.payload, self.name)
        return process(prompts, completions, self.timeout_s, **columns)


def get_reward(name: str) -> RewardFn:
    """The reward function a config names."""
    try:
        return _REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; known rewards: {sorted(_REWARDS)}") from None


def resolve_reward(reward: str | RewardFn, timeout_s: float | None) -> RewardFn:
    """``model.reward`` made a callable, called in a process of its own with a deadline of `timeout_s` per batch
    (None: in this process, without a deadline).

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
    return reward if timeout_s is None else TimedReward(reward, timeout_s)
