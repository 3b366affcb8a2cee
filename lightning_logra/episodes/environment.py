"""What a multi-turn episode talks to: a user's environment (TRL's `environment_factory` contract), plain functions
as tools, or a gym-like text environment through `GymAdapter`.

The contract, as TRL's: an environment is a class; one instance per episode, made in an environment process (never in
the trainer's). `reset(**row)` receives the dataset row's columns (`prompt`, `answer`, ...) and may return text,
added to the prompt's last user message. Its public methods (not `reset`, not `reward`, not starting with `_`) are
the tools: their type hints and docstrings (Google style: a summary, then `Args:`) give the schema the chat template
shows the model (`transformers.utils.get_json_schema`). A method's return value is the tool's answer (str() of it;
JSON for a dict or list); an exception it raises is the answer too (`error: ...`), not a crash. An optional
`reward(self) -> float | None` is the environment's own reward of the episode, read when it ends, and scored by the
`environment` reward (`model.reward: environment`, alone or beside others).

`GymAdapter` wraps an environment of the `reset(seed, **row) -> observation` / `step(action) -> (observation,
reward, done, info)` kind: every turn's text is an action, each observation the next user message, the rewards summed
into the episode's environment reward.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
from collections.abc import Callable
from typing import Any

from lightning_logra.base.settings import real_number

NOT_TOOLS = frozenset({"reset", "reward"})  # an environment's methods that the model cannot call


def import_path(path: str, key: str) -> Any:
    """The object a dotted path names (`package.module.name`), or an error naming the key and the fix."""
    module_name, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"{key}: cannot import {path!r} ({err}); give a dotted path to a top-level definition "
                         f"(package.module.name) of an installed module") from err


def environment_class(path: str, args: dict[str, Any], key: str) -> type:
    """The class a dotted path names, checked to make an environment from `args` (its init_args); or an error naming
    `key` and what is wrong. Checked at set-up: in the environment processes, an object that is not a class, or a
    class that cannot be made from `args`, would fail every episode's start, and each would run without tools."""
    cls = import_path(path, key)
    if not isinstance(cls, type):
        raise ValueError(f"{key}: {path!r} is not a class (it is {type(cls).__name__} {cls!r}); give a class, one "
                         f"instance of which each episode talks to")
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # a class written in C may state no signature: it is made as it is
        return cls
    try:
        signature.bind(**args)
    except TypeError as err:
        raise ValueError(f"{key}: {path} cannot be made with init_args {args} ({err}); give the arguments its "
                         f"__init__ needs as init_args ({{class_path: {path}, init_args: {{...}}}})") from None
    return cls


def function_tools(paths: list[str] | tuple[str, ...], key: str) -> dict[str, Callable]:
    """Plain functions as tools, by the name the model calls them by (the last part of each dotted path); two with
    one name are refused naming both (one would silently answer for the other)."""
    tools: dict[str, Callable] = {}
    where: dict[str, str] = {}
    for path in paths:
        name = path.rpartition(".")[2]
        if name in tools:
            raise ValueError(f"{key}: {where[name]!r} and {path!r} are both named {name!r}, and the model calls a tool "
                             f"by its name; give one of them a name of its own (wrap it in a function)")
        tools[name], where[name] = import_path(path, key), path
    return tools


def finite_reward(value: Any, what: str) -> float:
    """An environment's reward as a float: one real number as a reward function's is (`base.settings.real_number`: a
    bool, numpy's scalars and 0-d tensors too), and finite (a reward function's NaN drops its group; an episode has
    no group of its own to drop); anything else is refused, the message beginning with `what` ("pkg.Env.reward()
    returned"): a "0.5" is text, not a score."""
    number = real_number(value)
    if number is None or not math.isfinite(number):
        raise ValueError(f"{what} {value!r} (a {type(value).__name__}): it must return a real number (an int, a float "
                         "or a bool, numpy's or a 0-d tensor's too; finite) or None")
    return number


def tool_methods(environment_class: type) -> dict[str, Callable]:
    """The environment's tools by name: its public methods other than `reset` and `reward`."""
    return {name: member for name, member in inspect.getmembers(environment_class, inspect.isfunction)
            if not name.startswith("_") and name not in NOT_TOOLS}


def tool_schemas(tools: dict[str, Callable], key: str) -> list[dict[str, Any]]:
    """The JSON schemas the chat template renders, one per tool; a tool without the type hints or docstring a schema
    needs is refused naming it."""
    from transformers.utils import get_json_schema  # here: the environments' processes never import transformers

    schemas = []
    for name, fn in tools.items():
        try:
            schemas.append(get_json_schema(fn))
        except Exception as err:  # transformers raises its own TypeErrors and ValueErrors, by what is missing
            raise ValueError(f"{key}: the tool {name!r} has no schema ({err}); give each argument a type hint and the "
                             f"function a Google-style docstring with an Args: section") from err
    return schemas


def answer_text(value: Any) -> str:
    """A tool's return value as the model reads it."""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            pass
    return str(value)


class FunctionTools:
    """The environment of plain functions (`model.episodes.tools`): stateless, nothing to reset, no reward of its
    own."""

    def __init__(self, functions: dict[str, Callable]) -> None:
        self.functions = functions

    def reset(self, **row: Any) -> None:
        return None


class GymAdapter:
    """A gym-like text environment as an episode's environment: `env` (a dotted path) makes it with `env_args`;
    `reset(seed=..., **row)` gives the first observation (added to the prompt), and each turn's whole text is
    the action of `step(action) -> (observation, reward, done, info)`; the observation is the next user message
    (`done` ends the episode) and the rewards add up to the episode's environment reward."""

    def __init__(self, env: str, env_args: dict[str, Any] | None = None) -> None:
        self.env_path, self.env_args = env, dict(env_args or {})
        self.env: Any = None
        self.total = 0.0

    def start(self, seed: int, row: dict[str, Any]) -> str | None:
        self.env = import_path(self.env_path, "model.episodes.environment_factory: GymAdapter's env")(**self.env_args)
        self.total = 0.0
        observation = self.env.reset(seed=seed, **row)
        return None if observation is None else answer_text(observation)

    def act(self, action: str) -> tuple[str, bool]:
        observation, reward, done, _info = self.env.step(action)
        self.total += 0.0 if reward is None else finite_reward(
            reward, f"model.episodes.environment_factory: GymAdapter's env {self.env_path}.step() returned the reward")
        return answer_text(observation), bool(done)

    def reward(self) -> float:
        return self.total
