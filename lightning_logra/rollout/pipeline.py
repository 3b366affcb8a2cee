"""Overlapped rollouts (`model.rollouts.max_staleness` = k > 0): the engine generates the next steps' samples while the
trainer computes this step's update, so that neither waits for the other.

Step t trains on samples drawn with the weights of step max(start, t − k) — a fixed lag, so that a run is
reproducible: the same seeds and the same k give the same run. With k = 1:

    engine:   generate t+1 (weights of t) | send update t | generate t+2 (weights of t+1) | send update t+1 | ...
    trainer:  score, train, update t      |                 score, train, update t+1       |

One worker thread makes every call to the engine, in the order they were submitted: generations, and the updates the
seed sync sends, so the engine holds exactly the weights of step v while it generates a batch drawn from step v. What
needs every rank (gathering a sharded tensor, comparing fingerprints) stays on the trainer's thread, and so does any
other use of the engine (validation, a drift check, a checkpoint): the worker is drained first, after which the
engine holds the trainer's newest weights (every applied update has been sent).

With an engine that takes updates in flight (`RemoteEngine(in_flight=True)`), updates have a worker thread of their
own and reach the engine as soon as the trainer sends them, while it generates; a generation still starts only once
the updates sent before it was submitted have arrived (its first tokens are drawn with the weights of step v at
least), and its later tokens may be drawn with newer ones (PipelineRL's in-flight updates). With k = 1:

    engine:   generate t+1 (weights of t, then t+1 from where update t landed) | generate t+2 (t+1, then t+2) | ...
    updates:        send update t ↑                                                  send update t+1 ↑

The prompts of the steps ahead come from a second pass over the same training loader, whose batches are a function
of the step alone (`data.module.StepBatchSampler`); each is checked against the batch Lightning then hands the step.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any

from lightning_logra.algo.update import Update
from lightning_logra.base.batch import Rollout
from lightning_logra.base.stop import StopRequested

log = logging.getLogger(__name__)

Batch = dict[str, list[Any]]


@dataclass
class InFlight:
    """A batch submitted to the engine: the step it is for, the step whose weights draw it, its prompts and columns
    (the rewards need them), and the engine's answer."""

    step: int
    version: int
    batch: Batch
    rollout: Future[Rollout]

    @property
    def staleness(self) -> int:
        return self.step - self.version


class EngineLost(RuntimeError):
    """The engine died during overlapped rollouts; its restart left it on the model's files."""


class RolloutPipeline:
    """
    Args:
        max_staleness: k ≥ 1.
        generate: (batch, step) → the engine call that draws the step's Rollout (on the CPU): made on the trainer's
            thread (it may tokenize), the call it returns runs on the worker.
        send: an update (as the engine receives it) → the sync's metrics; called on the worker thread.
        reload: loads the trainer's weights into the engine (the sync's full load; under sharded training, which
            needs every rank, an error saying to resume), on the trainer's thread, after the engine was restarted.
        batches: the training loader's batches from step `start` on (a second pass over it).
        start: the first step this pipeline serves (0, or the step a run resumed at).
        last_step: the run's last step (None: no limit); nothing is generated past it.
        in_flight: send updates from a thread of their own, while the engine generates (`updates_in_flight`).
    """

    def __init__(self, max_staleness: int, generate: Callable[[Batch, int], Callable[[], Rollout]],
                 send: Callable[[Update], dict[str, float]], reload: Callable[[], object], batches: Iterator[Batch],
                 start: int, last_step: int | None, in_flight: bool = False) -> None:
        self.max_staleness, self.start, self.last_step, self.in_flight = max_staleness, start, last_step, in_flight
        self._generate, self._send, self._reload, self._batches = generate, send, reload, batches
        self._next_batch = start  # the step of the next batch `batches` yields
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouts")
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="updates") if in_flight else self._worker
        self._threads: set[threading.Thread] = set()  # the threads engine calls run on
        self._in_flight: dict[int, InFlight] = {}
        self._sends: list[Future[dict[str, float]]] = []
        self._lost = False  # set on the worker when the engine was restarted: what follows would be wrong
        self._taken = start - 1  # the last step whose samples were taken

    # ---- the trainer's side -----------------------------------------------------------------------------------

    def take(self, batch: Batch, step: int) -> tuple[Rollout, int, float]:
        """Step `step`'s samples (of `batch`, which Lightning handed the step), after submitting every batch up to
        step + k; returns (rollout, the step whose weights drew it, seconds spent waiting for it)."""
        self._submit_up_to(step + self.max_staleness, batch, step)
        pending = self._in_flight.pop(step)
        if pending.batch["prompt"] != batch["prompt"]:
            raise RuntimeError(
                f"model.rollouts.max_staleness: the prompts generated ahead for step {step} are not those the training "
                "loader gave the step; overlapped rollouts need a loader whose batches depend on the step alone (the "
                "data modules of lightning_logra.data)")
        if pending.staleness > self.max_staleness:  # never trained on (only a bug could get here)
            raise RuntimeError(f"a batch drawn at step {pending.version} reached step {step}: staler than "
                               f"model.rollouts.max_staleness={self.max_staleness}")
        start, self._taken = time.perf_counter(), step
        if isinstance(pending.rollout.exception(), EngineLost):
            self._in_flight[step] = pending
            self._recover(version=step)
            pending = self._in_flight.pop(step)
        return pending.rollout.result(), pending.version, time.perf_counter() - start

    def call_now(self, call: Callable[[], Rollout], step: int) -> Rollout:
        """`call` (an engine call drawing more samples for step `step`, whose batch was taken: dynamic sampling's
        later rounds) on the worker, after everything submitted so far, and its answer: drawn with the weights of step
        `step`, the trainer's own (every update before it was sent first)."""
        future = self._worker.submit(self._guarded, self._after_sends(call))
        if isinstance(future.exception(), EngineLost):
            self._recover(version=step)  # the trainer holds the weights of step `step`: loaded, then drawn again
            future = self._worker.submit(self._guarded, call)
        return future.result()

    def send(self, update: Update) -> None:
        """Queue the step's update for the engine: after the generations already submitted, or (in flight) at once."""
        self._sends.append(self._sender.submit(self._guarded, self._send, update))

    def sent_metrics(self) -> dict[str, float]:
        """The sync metrics of the sends finished since the last call (bytes and seconds summed; NaN: none)."""
        # A send that failed (the engine lost) is not counted; the generation after it fails too, and recovers
        done = [future for future in self._sends if future.done() and future.exception() is None]
        self._sends = [future for future in self._sends if not future.done()]
        metrics: dict[str, float] = {}
        for future in done:
            for key, value in future.result().items():
                metrics[key] = value if math.isnan(metrics.get(key, math.nan)) else metrics[key] + value
        return metrics

    def drain(self) -> None:
        """Wait until the engine has done everything submitted: it then holds the weights of every update sent."""
        futures = [*self._sends, *(p.rollout for p in self._in_flight.values())]
        if any(isinstance(future.exception(), EngineLost) for future in futures):
            self._recover(version=self._taken + 1)  # between steps: the trainer holds the next step's weights
            return self.drain()
        for future in futures:
            future.result()

    def state(self) -> list[dict[str, Any]]:
        """The batches in flight, finished (for a checkpoint): a resumed run trains on them as this one would. When a
        signal stopped the engine first (`base/stop.py`), those it had finished: the resumed run draws the others
        again, from the saved step's weights."""
        try:
            self.drain()
        except StopRequested as stop:
            log.warning("%s: the checkpoint holds the batches in flight the engine finished; the resumed run "
                        "generates the others again", stop)
        finished = [p for p in self._in_flight.values() if p.rollout.done() and p.rollout.exception() is None]
        return [{"step": p.step, "version": p.version, "batch": p.batch,
                 "rollout": {f.name: getattr(p.rollout.result(), f.name) for f in fields(Rollout)}}
                for p in sorted(finished, key=lambda p: p.step)]

    def restore(self, saved: list[dict[str, Any]]) -> None:
        """Take a checkpoint's batches in flight (`state`); those staler than this run's bound are dropped and drawn
        again (a run resumed with a smaller model.rollouts.max_staleness)."""
        for item in saved:
            if item["step"] - item["version"] > self.max_staleness or item["step"] < self.start:
                log.warning("model.rollouts.max_staleness=%d: the checkpoint's batch for step %d, drawn at step %d, is "
                            "generated again", self.max_staleness, item["step"], item["version"])
                continue
            done: Future[Rollout] = Future()
            done.set_result(Rollout(**item["rollout"]))
            self._in_flight[item["step"]] = InFlight(item["step"], item["version"], item["batch"], done)

    def close(self) -> None:
        """Finish what was submitted (an engine call cannot be interrupted) and stop the workers."""
        self._worker.shutdown(wait=True, cancel_futures=True)
        self._sender.shutdown(wait=True, cancel_futures=True)

    def on_worker(self) -> bool:
        return threading.current_thread() in self._threads

    # ---- internals --------------------------------------------------------------------------------------------

    def _submit_up_to(self, last: int, batch: Batch, step: int) -> None:
        if self.last_step is not None:
            last = min(last, self.last_step)
        for ahead in range(step, last + 1):
            if ahead in self._in_flight:
                continue
            prompts = batch if ahead == step else self._batch_at(ahead)
            version = max(self.start, ahead - self.max_staleness)  # the weights of that step exist by now
            future = self._worker.submit(self._guarded, self._after_sends(self._generate(prompts, ahead)))
            self._in_flight[ahead] = InFlight(ahead, version, prompts, future)

    def _after_sends(self, call: Callable[[], Rollout]) -> Callable[[], Rollout]:
        """In flight: `call` once the updates sent so far have reached the engine (they run on the other worker)."""
        if not self.in_flight:
            return call  # the one worker runs them in order already
        sends = list(self._sends)

        def after() -> Rollout:
            for send in sends:
                send.result()
            return call()

        return after

    def _recover(self, version: int) -> None:
        """The engine died and was restarted on the worker, where the trainer's weights (a later step's than the
        batches in flight need) cannot be loaded: load them here, and draw every batch in flight again from them,
        the weights of step `version`. Those batches are fresher than the fixed lag; the run goes on, no longer equal
        to an undisturbed one."""
        log.warning("overlapped rollouts: the engine was restarted; loading the weights of step %d into it and "
                    "generating the %d batches in flight again from them", version, len(self._in_flight))
        for future in [*self._sends, *(p.rollout for p in self._in_flight.values())]:
            future.exception()  # wait: those after the loss fail at once
        self._sends, self._lost = [], False
        self._reload()
        for item in list(self._in_flight.values()):
            future = self._worker.submit(self._guarded, self._generate(item.batch, item.step))
            self._in_flight[item.step] = InFlight(item.step, version, item.batch, future)

    def _batch_at(self, step: int) -> Batch:
        """The training loader's batch of `step` (a second pass over it; the steps restored in flight skipped)."""
        while self._next_batch <= step:
            batch, self._next_batch = next(self._batches), self._next_batch + 1
        return batch

    def _guarded(self, call: Callable[..., Any], *args: Any) -> Any:
        self._threads.add(threading.current_thread())
        if self._lost:
            raise EngineLost("the rollout engine was restarted during overlapped rollouts; its weights are the "
                             "model's files, not the step's")
        try:
            return call(*args)
        except EngineLost:
            self._lost = True
            raise
