"""Where a training step's seconds go, for its log: the parts the step names, each timed from where the last ended."""

from __future__ import annotations

import time

# The parts of a step the module times, and what each is:
PARTS = {
    "wait": "blocked on the engine: generation itself in the serial loop, the wait for it when overlapped, and "
            "dynamic sampling's later rounds",
    "score": "the rewards of the step's first round",
    "update": "advantages, forward and backward passes, the reduction, the step size and the applied update",
    "sync": "the trainer's time in the weight sync (the whole send when serial, handing it over when overlapped)",
}


class StepTimes:
    """A clock for one training step, started when made: `lap(part)` adds the seconds since the last mark to `part`,
    `took(part, seconds)` adds seconds measured elsewhere (and marks now)."""

    def __init__(self) -> None:
        self.start = self.mark = time.perf_counter()
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.laps: list[tuple[str, float]] = []  # (part, when it ended) in order: MemoryProfiler's phases

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self.seconds[part] += now - self.mark
        self.mark = now
        self.laps.append((part, now))

    def took(self, part: str, seconds: float) -> None:
        self.seconds[part] += seconds
        self.mark = time.perf_counter()
        self.laps.append((part, self.mark))

    def elapsed(self) -> float:
        """Seconds since the step began (`train/step_s`: the parts, the weight sync and the rest)."""
        return time.perf_counter() - self.start

    def metrics(self) -> dict[str, float]:
        """`train/<part>_s` for each part, and `train/rollout_s` (wait + score: generation as the trainer sees it)."""
        metrics = {f"train/{part}_s": seconds for part, seconds in self.seconds.items()}
        metrics["train/rollout_s"] = self.seconds["wait"] + self.seconds["score"]
        return metrics
