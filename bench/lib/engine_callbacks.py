"""Callbacks a benchmark's CLI runs load by class path (`bench.lib.engine_callbacks.ProcessTimes`; `python cli.py`
runs with the repository on its sys.path): the CPU time of the trainer's and the engine's processes, and the engine's
threads bound to a core of their own (bench.overlap)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from lightning.pytorch import Callback


def engine_processes(engine) -> list:
    """The processes an engine computes in: a colocated vLLM engine's, or the process trees of the servers a
    RemoteEngine launched."""
    import psutil

    if hasattr(engine, "_engine_processes"):
        return engine._engine_processes()
    roots = [psutil.Process(s.process.pid) for s in getattr(engine, "servers", []) if s.process is not None]
    return [p for root in roots for p in [root, *root.children(recursive=True)]]


class ProcessTimes(Callback):
    """Writes, at the end of training, the wall time and the CPU seconds (user + system) the trainer's process and
    the engine's processes spent between the first step's start and the last step's end, to `path` (JSON)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _times(self, pl_module) -> dict[str, float]:
        import psutil

        processes = engine_processes(pl_module.engine)
        own = psutil.Process().cpu_times()
        return {"wall": time.perf_counter(), "trainer": own.user + own.system,
                "engine": sum(sum(p.cpu_times()[:2]) for p in processes)}

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = self._times(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == trainer.max_steps:  # before the last validation
            end = self._times(pl_module)
            Path(self.path).write_text(json.dumps({key: end[key] - self.start[key] for key in end}))


class PinEngine(Callback):
    """Binds every thread of the engine's processes to `core` once it has started. Its worker's compute threads are
    bound there already (VLLM_CPU_OMP_THREADS_BIND); its engine core, the scheduler process that polls the worker,
    inherits the trainer's core from `taskset`, where it would take the trainer's time."""

    def __init__(self, core: int) -> None:
        self.core = core

    def on_fit_start(self, trainer, pl_module) -> None:
        for process in engine_processes(pl_module.engine):
            for thread in process.threads():
                os.sched_setaffinity(thread.id, {self.core})
