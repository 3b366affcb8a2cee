"""Rewards for tests/unit/rewards/test_rewards.py and tests/integration/cli/test_cli.py: functions that misbehave,
named by dotted path ("bad_rewards.…") as a config names a custom reward, classes a config builds from
class_path/init_args, and a check for `CheckPool`'s worker processes. Only light imports, since each reward or check
process imports this module."""

import math
import os
import threading
import time


def sleepy_reward(prompts, completions, **_):
    """Hangs on a batch that contains "hang"; otherwise scores each completion with the id of its process."""
    if "hang" in completions:
        time.sleep(600)
    return [float(os.getpid())] * len(completions)


def allocate_without_bound():
    """Allocates 100 MB after 100 MB until an allocation fails. bytes(n) takes zeroed memory from calloc, which maps
    fresh pages without writing them: it takes address space (what RLIMIT_AS counts) but not the machine's memory,
    so that should the limit fail to hold, the test runs to its deadline without exhausting the host."""
    held = []
    while True:
        held.append(bytes(100 * 2**20))


def hungry_reward(prompts, completions, **_):
    """Allocates without bound on a batch that contains "hog"; otherwise scores each completion with the id of its
    process."""
    if "hog" in completions:
        allocate_without_bound()
    return [float(os.getpid())] * len(completions)


def string_rewards(prompts, completions, **_):
    """Rewards as text, which float() would take ("1.0"), but a reward that returns text is broken."""
    return ["1.0"] * len(completions)


def broken_reward(prompts, completions, **_):
    raise KeyError("answer")


def failed_allocation(prompts, completions, **_):
    raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] err == 0. DefaultCPUAllocator: can't allocate memory")


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


class RecordCalls:
    """Scores every completion 0.0 and keeps what each call received (for a reward called in the trainer's process,
    model.scoring.timeout_s: null)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, prompts, completions, **kwargs):
        self.calls.append({"prompts": prompts, "completions": completions, **kwargs})
        return [0.0] * len(completions)


def pool_check(kind: str, path: str) -> float:
    """A check for CheckPool's tests, by kind: "hang" writes its process id to `path` and never returns; "wait"
    returns 1.0 once the file `path` exists, which a "signal" check writes (so it returns only if another worker runs
    that check meanwhile); "raise" raises; "hog" allocates without bound; any other kind returns 0.5."""
    if kind == "hang":
        with open(path, "w") as file:
            file.write(str(os.getpid()))
        time.sleep(600)
    if kind == "wait":
        while not os.path.exists(path):
            time.sleep(0.01)
        return 1.0
    if kind == "signal":
        open(path, "w").close()
        return 1.0
    if kind == "raise":
        raise ValueError("unparsable")
    if kind == "hog":
        allocate_without_bound()
    return 0.5


def forking_reward(prompts, completions, **_):
    """Forks on every batch. The copy returns its own rewards (2.0 each) into whatever called the reward, and, on a
    batch that contains "linger", first leaves a process behind that sleeps for 10 minutes; the original scores each
    completion with the id of its process."""
    if os.fork() == 0:
        if "linger" in completions and os.fork() == 0:
            time.sleep(600)
        return [2.0] * len(completions)
    return [float(os.getpid())] * len(completions)
