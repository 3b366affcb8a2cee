"""Environments and tools for tests/unit/episodes: ones that behave, and ones that raise, hang or answer 10 MB,
named by dotted path ("bad_envs.…") as a config names them. Only light imports: each environment process imports it."""

import os
import time


def add(a: int, b: int) -> int:
    """The sum of two whole numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


class Counter:
    """Counts the calls of its episode; its reward is that count, and reset says the row's answer back."""

    def reset(self, **row) -> str:
        self.calls = 0
        return f" (answer {row['answer']})"

    def bump(self, by: int) -> str:
        """Raises the count.

        Args:
            by: how much
        """
        self.calls += by
        return f"count {self.calls} in {os.getpid()}"

    def reward(self) -> float:
        return float(self.calls)


class Faulty:
    """A tool per fault."""

    def reset(self, **row) -> None:
        return None

    def fail(self, x: int) -> str:
        """Raises.

        Args:
            x: anything
        """
        raise RuntimeError(f"broken on {x}")

    def hang(self, x: int) -> str:
        """Never answers.

        Args:
            x: anything
        """
        time.sleep(600)
        return "late"

    def flood(self, x: int) -> str:
        """Answers 10 MB.

        Args:
            x: anything
        """
        return "9" * (10 * 2**20)


class Echo:
    """A gym-like text environment: the observation repeats the action; done after two steps; reward 1 a step."""

    def reset(self, seed, **row):
        self.steps = 0
        return f"seed {seed % 100}"

    def step(self, action):
        self.steps += 1
        return f"you said {action[:20]}", 1.0, self.steps >= 2, {}
