"""Reward functions that misbehave, for tests/test_rewards.py: named by dotted path ("bad_rewards.…") as a config
names a custom reward. Only light imports, since each reward process imports this module."""

import math
import os
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
