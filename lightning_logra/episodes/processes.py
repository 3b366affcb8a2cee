"""The processes environments run in: no tool runs in the trainer's process.

`EnvironmentPool` keeps `workers` processes, each holding the environments of the episodes given to it (episode i to
worker i mod workers, for its whole life). Each round of an episode step is one batch per worker: the worker runs its
episodes' requests at once, each in a thread of its own, and the calls of one turn at once too; a request or call
past `timeout_s` is answered `error: ... timed out` and its thread left behind, and the worker, which can no longer be
trusted to be idle, is replaced after the batch (its other episodes end: their environments are gone). A worker that
does not answer its whole batch in time, dies, or runs out of its address space (`memory_gib`) is killed with its
process group and replaced, and its episodes end. None of it stops training: an ended episode is scored as it stands.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from lightning_logra.base.child import ChildProcess, limit_address_space
from lightning_logra.episodes.calls import ParsedTurn, parse_tool_calls
from lightning_logra.episodes.environment import (
    FunctionTools,
    GymAdapter,
    answer_text,
    environment_class,
    finite_reward,
    function_tools,
    import_path,
    tool_methods,
)

log = logging.getLogger(__name__)

# What a request may take beyond its calls' deadline (a turn's parsing, the answers' assembly), and what a worker may
# take beyond that to answer its batch (pickling, the pipe, a loaded machine)
_SLACK_S = 5.0
_GRACE_S = 30.0


@dataclass(frozen=True)
class EnvironmentSpec:
    """What an environment process builds each episode's environment from (plain data: it is sent to the process).
    kind: "class" (a TRL-style environment class, `path` and `args`), "functions" (`model.episodes.tools`: `paths`), or
    "gym" (`GymAdapter(env=path, env_args=args)`)."""

    kind: str
    path: str = ""
    args: tuple[tuple[str, Any], ...] = ()
    paths: tuple[str, ...] = ()
    invalid_tool_call: str = "answer"  # "answer": the model reads why; "end": the episode ends
    max_answer_chars: int = 1 << 16  # of a turn's answers together, and of a reset's text


@dataclass
class Reply:
    """An environment's answer to a turn: the messages it adds (tool answers, or the next observation), whether the
    episode ends, and what the turn did."""

    messages: list[dict[str, str]]
    done: bool
    calls: int = 0
    errors: int = 0  # tool calls that raised, timed out or named no tool
    invalid: int = 0  # calls that could not be read


class _Episode:
    """One episode's environment, inside an environment process."""

    def __init__(self, spec: EnvironmentSpec) -> None:
        self.spec = spec
        if spec.kind == "class":
            self.env = import_path(spec.path, "model.episodes.environment_factory")(**dict(spec.args))
            self.tools = {name: getattr(self.env, name) for name in tool_methods(type(self.env))}
        elif spec.kind == "functions":
            self.tools = function_tools(spec.paths, "model.episodes.tools")
            self.env = FunctionTools(self.tools)
        else:
            self.env, self.tools = GymAdapter(spec.path, dict(spec.args)), {}

    def start(self, seed: int, row: dict[str, Any]) -> str | None:
        text = self.env.start(seed, row) if isinstance(self.env, GymAdapter) else self.env.reset(**row)
        return None if text is None else self._cut([{"role": "user", "content": answer_text(text)}])[0]["content"]

    def respond(self, text: str, timeout_s: float) -> tuple[Reply, bool]:
        """The environment's reply to a turn's text, and whether a call was left running past its deadline."""
        if isinstance(self.env, GymAdapter):
            observation, done = self.env.act(text)
            return Reply(self._cut([{"role": "user", "content": observation}]), done), False
        turn: ParsedTurn = parse_tool_calls(text)
        if turn.answered:
            return Reply([], done=True), False
        if turn.invalid and self.spec.invalid_tool_call == "end":
            return Reply([], done=True, calls=len(turn.calls), invalid=len(turn.invalid)), False
        messages: list[dict[str, str]] = []
        errors, stuck = 0, False
        if turn.calls:
            pool = ThreadPoolExecutor(max_workers=len(turn.calls))
            futures = [pool.submit(self._call, call.name, call.arguments) for call in turn.calls]
            done, _ = wait_futures(futures, timeout=timeout_s)
            pool.shutdown(wait=False)  # a call past its deadline keeps its thread; the worker is replaced after
            for call, future in zip(turn.calls, futures):
                if future in done:
                    answer, failed = future.result()
                else:
                    answer, failed, stuck = f"error: the call timed out after {timeout_s:g} s", True, True
                errors += failed
                messages.append({"role": "tool", "name": call.name, "content": answer})
        messages += [{"role": "tool", "name": "invalid_call", "content": f"error: {why}"} for why in turn.invalid]
        return Reply(self._cut(messages), False, len(turn.calls), errors, len(turn.invalid)), stuck

    def _call(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        tool = self.tools.get(name)
        if tool is None:
            return f"error: there is no tool named {name!r}; the tools are {sorted(self.tools)}", True
        try:
            return answer_text(tool(**arguments)), False
        except Exception as err:  # the model reads what went wrong, as a tool's answer
            return f"error: {type(err).__name__}: {err}", True

    def _cut(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """A turn's messages with at most max_answer_chars of content among them, in order (the first answers whole,
        then what is left, then nothing): a tool that returns megabytes, or a turn of many calls, must not fill the
        trainer's memory; the episode's token budget cuts what is left."""
        left, cut = self.spec.max_answer_chars, []
        for message in messages:
            content = message["content"][:left]
            left -= len(content)
            cut.append({**message, "content": content})
        return cut

    def reward(self) -> float | None:
        reward = getattr(self.env, "reward", None)
        if not callable(reward):
            return None
        value = reward()
        where = "GymAdapter" if isinstance(self.env, GymAdapter) else self.spec.path
        return None if value is None else finite_reward(value, f"model.episodes.environment_factory: {where}.reward() "
                                                               "returned")


def _serve(conn: Connection, spec: EnvironmentSpec, memory_gib: float | None) -> None:
    """An environment process's loop: a batch of requests in, their answers out, until the parent closes the pipe."""
    os.setpgid(0, 0)  # a group of its own: what the environments start is stopped with it
    limit_address_space(memory_gib)
    episodes: dict[int, _Episode] = {}
    conn.send("ready")
    while True:
        try:
            requests, timeout_s = conn.recv()
        except EOFError:
            return
        answers: dict[int, tuple[str, Any]] = {}
        stuck: list[bool] = []  # a call left running past its deadline (a thread that cannot be stopped)
        threads = [threading.Thread(target=_answer, args=(spec, episodes, request, timeout_s, answers, stuck),
                                    daemon=True) for request in requests]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout_s + _SLACK_S
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        for key, op, _ in requests:
            if key not in answers:  # a reset, step or reward past the deadline: the episode's environment is gone
                stuck.append(True)
                episodes.pop(key, None)
                answers[key] = ("error", f"{op} timed out after {timeout_s:g} s")
        conn.send((dict(answers), bool(stuck)))


def _answer(spec: EnvironmentSpec, episodes: dict[int, _Episode], request: tuple, timeout_s: float,
            answers: dict[int, tuple[str, Any]], stuck: list[bool]) -> None:
    """One request of a batch, in a thread of its own: its answer into `answers`."""
    key, op, args = request
    try:
        if op == "start":
            episodes[key] = _Episode(spec)
            answers[key] = ("ok", episodes[key].start(*args))
        elif key not in episodes:
            answers[key] = ("lost", "its environment is gone")
        elif op == "respond":
            reply, left = episodes[key].respond(*args, timeout_s)
            if left:
                stuck.append(True)
            answers[key] = ("ok", reply)
        else:  # "finish"
            answers[key] = ("ok", episodes.pop(key).reward())
    except MemoryError:
        episodes.pop(key, None)  # a failed environment's episode ends: nothing asks for it again
        answers[key] = ("error", "out of memory (model.episodes.memory_gib)")
    except Exception:
        episodes.pop(key, None)
        answers[key] = ("error", traceback.format_exc(limit=-3))


class _Worker(ChildProcess):
    def __init__(self, spec: EnvironmentSpec, memory_gib: float | None) -> None:
        super().__init__(_serve, (spec, memory_gib), "environment", daemon=False,
                         start_error="model.episodes.environment_factory / model.episodes.tools could not be started")

    def _kill(self) -> None:
        try:
            os.killpg(self._process.pid, signal.SIGKILL)  # the process and what it started
        except (ProcessLookupError, PermissionError):
            self._process.kill()


class EnvironmentPool:
    """`workers` environment processes (see the module's doc); `call` runs one round of requests on them."""

    def __init__(self, spec: EnvironmentSpec, workers: int, timeout_s: float, memory_gib: float | None) -> None:
        self.spec, self.timeout_s, self.memory_gib = spec, timeout_s, memory_gib
        self._workers = [_Worker(spec, memory_gib) for _ in range(workers)]
        self._lock = threading.Lock()  # the overlapped rollouts' worker thread and an evaluation take turns

    def close(self) -> None:
        for worker in self._workers:
            worker.close()

    def call(self, op: str, requests: dict[int, tuple]) -> dict[int, tuple[str, Any]]:
        """`op` ("start": args (seed, row); "respond": (text,); "finish": ()) for each episode index, on the worker
        that holds it. Returns each index's (status, value): "ok" and the answer; "lost" (its environment is gone:
        its worker was replaced) or "error" and why."""
        if not requests:
            return {}
        with self._lock:
            return self._call(op, requests)

    def _call(self, op: str, requests: dict[int, tuple]) -> dict[int, tuple[str, Any]]:
        batches: dict[int, list[tuple]] = {}
        for index, args in requests.items():
            batches.setdefault(index % len(self._workers), []).append((index, op, args))
        conns = {}
        for w, batch in batches.items():
            conn = self._workers[w]._connection()  # started (and ready) on first use or after a replacement
            conn.send((batch, self.timeout_s))
            conns[conn] = w
        results: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + self.timeout_s + _SLACK_S + _GRACE_S
        while conns:
            ready = wait(list(conns), max(0.0, deadline - time.monotonic()))
            if not ready:
                why = f"did not answer within {self.timeout_s + _SLACK_S + _GRACE_S:g} s"
                for w in conns.values():
                    self._replace(w, why, batches[w], results)
                break
            for conn in ready:
                w = conns.pop(conn)
                try:
                    answers, stuck = conn.recv()
                except (EOFError, OSError):
                    self._replace(w, "died", batches[w], results)
                    continue
                results.update(answers)
                if stuck:
                    log.warning("an environment request or tool call ran past model.episodes.tool_timeout_s=%g s: its "
                                "answer says so, and environment process %d is replaced (the episodes it held end)",
                                self.timeout_s, w)
                    self._workers[w].close()
        return results

    def _replace(self, w: int, why: str, batch: list[tuple], results: dict[int, tuple[str, Any]]) -> None:
        log.warning("environment process %d %s: it is replaced, and its %d episodes end", w, why, len(batch))
        self._workers[w].close()  # started again on its next use
        for index, _, _ in batch:
            results[index] = ("lost", why)


def spec_from_settings(environment_factory: str | dict | None, tools: list[str] | None, invalid_tool_call: str,
                       max_answer_chars: int) -> EnvironmentSpec:
    """The spec of `model.episodes.environment_factory` (a dotted path, or class_path and init_args) or
    `model.episodes.tools`; an environment class that cannot be made from its init_args is refused here, naming the
    key (GymAdapter's `env` and `env_args` the same)."""
    key = "model.episodes.environment_factory"
    common = {"invalid_tool_call": invalid_tool_call, "max_answer_chars": max_answer_chars}
    if environment_factory is None:
        return EnvironmentSpec("functions", paths=tuple(tools or ()), **common)
    if isinstance(environment_factory, str):
        path, args = environment_factory, {}
    else:
        path, args = environment_factory["class_path"], dict(environment_factory.get("init_args") or {})
    cls = import_path(path, key)
    gym = isinstance(cls, type) and issubclass(cls, GymAdapter)
    if gym and not isinstance(args.get("env"), str):
        raise ValueError(f"{key}.init_args.env: GymAdapter needs the class of the gym-like environment, by dotted path "
                         f"(init_args: {{env: package.module.Class, env_args: {{...}}}}); got {args.get('env')!r}")
    environment_class(path, args, key)
    if gym:
        env, env_args = args["env"], dict(args.get("env_args") or {})
        environment_class(env, env_args, f"{key}.init_args.env")
        return EnvironmentSpec("gym", path=env, args=tuple(sorted(env_args.items())), **common)
    return EnvironmentSpec("class", path=path, args=tuple(sorted(args.items())), **common)


def spec_tools(spec: EnvironmentSpec) -> dict[str, Callable]:
    """The tools a spec's environment offers, by name, read from the class or the functions (not called)."""
    if spec.kind == "class":
        return tool_methods(import_path(spec.path, "model.episodes.environment_factory"))
    if spec.kind == "functions":
        return function_tools(spec.paths, "model.episodes.tools")
    return {}
