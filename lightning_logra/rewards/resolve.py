"""``model.reward`` and ``model.scoring.weights`` made the rewards the module calls: names, dotted paths and
components resolved, each in a process of its own (`processes.TimedReward`), with the names messages and metrics give
them."""

import functools
import importlib
import inspect
import math
from dataclasses import dataclass

from lightning_logra.base.child import DEFAULT_MEMORY_GIB, check_memory_gib
from lightning_logra.rewards.builtin import BUILTIN, RewardFn
from lightning_logra.rewards.processes import TimedReward


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


def reward_setting(reward: str | RewardFn | list[str | RewardFn]) -> str | RewardFn | list[str | RewardFn]:
    """``model.reward`` as the hyper-parameters keep it (and so every checkpoint): a function by its name, a
    built-in's as the registry names it (``exact_match``), another's as its dotted path, which `resolve_reward`
    resolves again; anything else as it is. A checkpoint that held the function itself would need it on the loader's
    allow-list, and an allowed function is one a crafted checkpoint could call with arguments of its choosing."""
    if isinstance(reward, (list, tuple)):
        return [reward_setting(item) for item in reward]
    if inspect.isfunction(reward) and "<locals>" not in reward.__qualname__:
        builtin = [name for name, fn in BUILTIN.items() if fn is reward]
        return builtin[0] if builtin else f"{reward.__module__}.{reward.__qualname__}"
    return reward


def get_reward(name: str) -> RewardFn:
    """The reward function a config names."""
    try:
        return BUILTIN[name]
    except KeyError:
        raise ValueError(f"model.reward: unknown reward {name!r}; the built-in rewards are {sorted(BUILTIN)}") from None


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
    return reward if timeout_s is None else TimedReward(reward, reward_name(reward), timeout_s, memory_gib)


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
    """``model.reward`` (one reward or a list, each as `resolve_reward` takes it) with ``model.scoring.weights`` (one
    weight per reward; None: 1.0 each), as TRL's ``reward_funcs`` and ``reward_weights``, each called in a process of
    its own with ``model.scoring.timeout_s`` and ``model.scoring.memory_gib`` (`TimedReward`). Metric names are unique:
    a name met again is numbered (``StartsWith``, ``StartsWith_2``)."""
    check_memory_gib(memory_gib, "model.scoring.memory_gib")
    rewards = list(reward) if isinstance(reward, (list, tuple)) else [reward]
    if not rewards:
        raise ValueError("model.reward is an empty list: give at least one reward")
    if weights is None:
        weights = [1.0] * len(rewards)
    if len(weights) != len(rewards):
        raise ValueError(f"model.scoring.weights has {len(weights)} weights for the {len(rewards)} rewards of "
                         f"model.reward: give one weight per reward, in the same order (or null for 1.0 each)")
    if not all(isinstance(w, (int, float)) and math.isfinite(w) for w in weights):
        raise ValueError(f"model.scoring.weights must be finite numbers, got {list(weights)}")
    resolved, keys = [], []
    for given, weight in zip(rewards, weights, strict=True):
        fn = resolve_reward(given, timeout_s=None)
        key = base = _metric_key(fn)
        number = 1
        while key in keys:
            number += 1
            key = f"{base}_{number}"
        keys.append(key)
        timed = fn if timeout_s is None else TimedReward(fn, reward_name(fn), timeout_s, memory_gib)
        resolved.append(Reward(timed, reward_name(given), key, float(weight)))
    return resolved
