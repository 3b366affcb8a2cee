"""Rewards for tests/test_rewards.py and tests/test_cli.py: functions that misbehave, named by dotted path
("bad_rewards.…") as a config names a custom reward, and two classes a config builds from class_path/init_args.
Only light imports, since each reward process imports this module."""

import math
import os
import threading
import time


def sleepy_reward(prompts, completions, **_):
    """Hangs on a batch that contains "hang"; otherwise scores each completion with the id of its process."""
    if "hang" in completions:
        time.sleep(600)
    return [float(os.getpid())] * len(completions)


def broken_reward(prompts, completions, **_):
    raise KeyError("answer")


def one_short(prompts, completions, **_):
    return [1.0] * (len(completions) - 1)


def nan_in_first_group(prompts, completions, **_):
    """Varies within every group; the first sample's reward is NaN (a judge that failed on it)."""
    return [math.nan if i == 0 else float(i % 2) for i in range(len(completions))]


def always_none(prompts, completions, **_):
    return [None] * len(completions)


class StartsWith:
    """A reward with a setting: 1.0 where the completion starts with `prefix`, else 0.0."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def __call__(self, prompts, completions, **_):
        return [float(completion.startswith(self.prefix)) for completion in completions]


class HoldsALock:
    """A reward that does not pickle (a lock among its attributes), so it cannot be sent to a reward process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __call__(self, prompts, completions, **_):
        with self.lock:
            return [0.0] * len(completions)
