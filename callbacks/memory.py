"""MemoryProfiler: the average and peak memory of every training step, and the footprint by category."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from lightning_logra.base.resident import process_rss_reader
from lightning_logra.base.settings import check_positive
from lightning_logra.rollout.engine import RolloutEngine
from lightning_logra.sketch.memory import MemoryBreakdown, memory_breakdown

GIB = 2**30


def cuda_allocated_reader(device: torch.device) -> Callable[[], int]:
    """A function returning the bytes the CUDA allocator has handed out on `device` (tensors alive, not its cache)."""
    return lambda: torch.cuda.memory_allocated(device)


class StepSampler:
    """Reads `read()` (bytes) every `interval_s` on a background thread between `start()` and `stop()`.

    A thread, because a training step is one long call into the module: only something running beside it sees the
    memory rise and fall inside the step. The samples are evenly spaced, so their mean is the time average.
    """

    def __init__(self, read: Callable[[], int], interval_s: float = 0.005) -> None:
        self.read, self.interval_s = read, interval_s
        self._samples: list[int] = []
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        # One sample at each end, so that a step shorter than the interval is still measured.
        self._samples = [self._now()]
        self._done.clear()
        self._thread = threading.Thread(target=self._sample, name="memory-sampler", daemon=True)
        self._thread.start()

    def _now(self) -> tuple[float, int]:
        return time.perf_counter(), self.read()

    def _sample(self) -> None:
        while not self._done.wait(self.interval_s):
            self._samples.append(self._now())

    def stop(self) -> tuple[float, int]:
        """(average, peak) bytes since `start()`."""
        self._done.set()
        self._thread.join()
        self._thread = None
        self._samples.append(self._now())
        sizes = [size for _, size in self._samples]
        return sum(sizes) / len(sizes), max(sizes)

    def peaks(self, laps: list[tuple[str, float]]) -> dict[str, int]:
        """The highest sample of each part of the last window, `laps` giving each part's end in order (a part's
        samples are those after the previous part's end, up to its own; several laps of one part count as one, and
        what follows the last lap is "other")."""
        peaks: dict[str, int] = {}
        ends = iter([*laps, ("other", float("inf"))])
        part, end = next(ends)
        for when, size in self._samples:
            while when > end:
                part, end = next(ends)
            peaks[part] = max(peaks.get(part, 0), size)
        return peaks


class MemoryProfiler(Callback):
    """Log the memory of every training step of this device and, once, the footprint by category.

    Every step: `memory/avg_gib` and `memory/peak_gib`, from the CUDA allocator on a GPU (memory_allocated sampled
    for the average, max_memory_allocated for the peak, plus `memory/device_used_gib`: what the device has in use
    by all processes and caches) and from the process's resident set size on the CPU. A step is the window from
    `on_train_batch_start` to this callback's `on_train_batch_end`: rollout, backward and update (and the work of
    callbacks listed before this one), without validation or checkpointing. A rollout engine in another process
    is reported beside it as `memory/engine_gib` (`RolloutEngine.memory_bytes()`).

    After the first step: `memory/<category>_gib` for each category of `memory_breakdown`. At the end of fit, rank
    zero prints a table of both. Observation only: the run is the same without this callback.

    Where the peak comes from, for an RLVRModule: every step, `memory/step/<part>_gib`, the highest memory during
    each part of the step (`train/step_times.py`: wait, i.e. generation, score, update, sync, and other) above what
    the process held when training started; on the CPU, after the first step, what it held then, by what loaded it:
    `memory/setup/libraries_gib` (before the model loads: torch, vLLM, the data), `memory/weights_gib` (the
    policy's tensors), `memory/setup/engine_gib` (what starting an engine in this process added: its weights and
    KV cache) and `memory/setup/rest_gib` (the rest). So a step's peak is libraries + weights + engine + rest + the
    highest part.

    Args:
        interval_s: seconds between two samples of the step's memory.
    """

    def __init__(self, interval_s: float = 0.005) -> None:
        check_positive("MemoryProfiler: interval_s", interval_s, "number of seconds")
        self.interval_s = interval_s
        self.steps: list[tuple[float, float]] = []  # (average, peak) GiB of each training step of the last fit
        self.breakdown: MemoryBreakdown | None = None
        self._sampler: StepSampler | None = None
        self._cuda: torch.device | None = None  # the device to ask the CUDA allocator about; None on the CPU
        self._at_setup: int | None = None  # this process's RSS before the model loaded (fit on the CPU)
        self._at_start = 0  # the memory read when training started
        self.setup_account: dict[str, float] = {}  # memory/setup/* GiB (the CPU)
        self.part_peaks: dict[str, float] = {}  # the highest memory/step/<part>_gib over the steps

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Before configure_model loads the policy and starts the engine
        cpu = trainer.strategy.root_device.type == "cpu"
        self._at_setup = process_rss_reader()() if stage == "fit" and cpu else None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.steps, self.breakdown, self.setup_account, self.part_peaks = [], None, {}, {}
        device = pl_module.device
        if device.type == "cuda" and torch.cuda.is_available():
            self._cuda = device
            read = cuda_allocated_reader(device)
        else:
            self._cuda = None
            read = process_rss_reader()
        self._sampler = StepSampler(read, self.interval_s)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._at_start = self._sampler.read()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._cuda is not None:
            torch.cuda.reset_peak_memory_stats(self._cuda)
        self._sampler.start()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        average, peak = self._sampler.stop()
        metrics: dict[str, float] = {}
        if self._cuda is not None:
            # The allocator's high-water mark is exact, where samples can miss a spike shorter than the interval.
            peak = torch.cuda.max_memory_allocated(self._cuda)
            free, total = torch.cuda.mem_get_info(self._cuda)
            metrics["memory/device_used_gib"] = (total - free) / GIB
        self.steps.append((average / GIB, peak / GIB))
        metrics["memory/avg_gib"], metrics["memory/peak_gib"] = self.steps[-1]
        engine = getattr(pl_module, "engine", None)  # any LightningModule can be profiled; RLVRModule has an engine
        engine_bytes = engine.memory_bytes() if isinstance(engine, RolloutEngine) else None
        if engine_bytes is not None:
            metrics["memory/engine_gib"] = engine_bytes / GIB
        if self.breakdown is None:
            # Measured after the first step rather than at fit start: dense optimizers (AdamW) create their state
            # in their first step. From then on it is static, so it is logged once.
            self.breakdown = memory_breakdown(pl_module.policy, trainer.optimizers)
            metrics.update({f"memory/{name}_gib": size / GIB for name, size in self.breakdown.as_dict().items()})
            if self._at_setup is not None:
                self.setup_account = self._setup_account(pl_module)
                metrics.update({f"memory/setup/{name}_gib": size for name, size in self.setup_account.items()})
        times = getattr(pl_module, "step_times", None)  # an RLVRModule's parts of the step
        if times is not None:
            peaks = self._sampler.peaks(times.laps)
            for part in dict.fromkeys([*(part for part, _ in times.laps), "other"]):
                rise = (peaks[part] - self._at_start) / GIB if part in peaks else math.nan  # no sample fell in it
                metrics[f"memory/step/{part}_gib"] = rise
                self.part_peaks[part] = max(self.part_peaks.get(part, -math.inf), rise)
        pl_module.log_dict(metrics)

    def _setup_account(self, pl_module: LightningModule) -> dict[str, float]:
        """What the process held when training started (GiB), by what loaded it."""
        engine = getattr(getattr(pl_module, "samples", None), "engine_start_bytes", 0) / GIB
        libraries, weights = self._at_setup / GIB, self.breakdown.weights / GIB
        return {"libraries": libraries, "engine": engine,
                "rest": self._at_start / GIB - libraries - weights - engine}

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # A step that raised never reaches on_train_batch_end: stop its sampling thread here.
        if self._sampler is not None and self._sampler.running:
            self._sampler.stop()

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.steps:
            return  # no training step ran (e.g. resumed at max_steps)
        rows = [
            ("step average (mean over steps)", sum(average for average, _ in self.steps) / len(self.steps)),
            ("step peak (max over steps)", max(peak for _, peak in self.steps)),
            *((name, size / GIB) for name, size in self.breakdown.as_dict().items()),
        ]
        if self.setup_account:
            rows += [("at the start: before the model (libraries, data)", self.setup_account["libraries"]),
                     ("at the start: the policy's weights", self.breakdown.weights / GIB),
                     ("at the start: the engine in this process", self.setup_account["engine"]),
                     ("at the start: the rest of set-up", self.setup_account["rest"])]
        rows += [(f"step, {part}: highest above the start", rise) for part, rise in self.part_peaks.items()]
        lines = [f"| memory of this device, GiB ({len(self.steps)} steps) | |", "|---|---:|"]
        lines += [f"| {name} | {value:.4f} |" for name, value in rows]
        rank_zero_info("\n".join(lines))
