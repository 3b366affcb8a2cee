"""RolloutWeightSync: keep a rollout engine's own copy of the weights (vLLM) equal to the trainer's.

A full load once at the start; then, after every applied update, only what changed: for each sketched matrix the
factor F = α·η·U (d×r) and the seed of A, from which the engine regenerates A and merges W −= F·A itself; densely
trained parameters, if any, as full tensors; a LoRA run's change of each adapted matrix as a low-rank delta of rank
2r (the training mode makes it: `lightning_logra.train.modes`). Every `check_every` syncs the fingerprints of every
tensor the engine holds (trained or not) are compared with the trainer's and a drift past `tolerance` is repaired by
a full load, as is a restarted engine. A sampler whose log-probs stay far from the trainer's (the step's
`rollout/logprob_abs_diff` above `logprob_diff_threshold` for `logprob_diff_steps` steps in a row) triggers the same
check at once. With several ranks, each rank keeps its own engine in step (every rank holds the same weights and
applies the same update).

It is the run's `lightning_logra.rollout.WeightSync`: the module attaches the engine to it before generation starts and
calls `sync` at the end of every training step.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_logra.algo.update import Update
from lightning_logra.rollout import RolloutEngine, WeightSync, fingerprint

log = logging.getLogger(__name__)


class RolloutWeightSync(Callback, WeightSync):
    """
    F travels in the dtype the sketch optimizer merged it in (`sketch.optimizer.factor_dtype`), with the key of its
    stochastic rounding into low-precision weights, so the engine's merge reproduces the trainer's bit for bit.

    Args:
        check_every: compare fingerprints every this many syncs (None: never, except on demand with `check`).
        tolerance: the largest |fingerprint difference| accepted before a full resync (fingerprints are W·v for a
            seeded ±1 vector v, so one entry off by ε shows as ε).
        seed: seeds the fingerprint vectors (a new vector at every check).
        logprob_diff_threshold: a mean |log π_sampler − log π_θ| per token (`rollout/logprob_abs_diff`) above which
            the engine is suspected of drift; None never checks on that account. Other kernels alone gave 3.6e-7
            on the tiny fp32 vLLM run; a norm of the engine shifted by 0.5 gave 0.1.
        logprob_diff_steps: how many steps in a row above the threshold trigger a check; after a check it takes as
            many again, so a sampler that differs for other reasons costs one check per that many steps.
    """

    def __init__(
        self,
        check_every: int | None = 50,
        tolerance: float = 1e-4,
        seed: int = 0,
        logprob_diff_threshold: float | None = 0.05,
        logprob_diff_steps: int = 10,
    ) -> None:
        if check_every is not None and check_every < 1:
            raise ValueError(f"RolloutWeightSync: check_every must be a positive number of syncs or None, "
                             f"got {check_every}")
        if tolerance < 0:
            raise ValueError(f"RolloutWeightSync: tolerance must be >= 0, got {tolerance}")
        if logprob_diff_threshold is not None and not logprob_diff_threshold > 0:
            raise ValueError(f"RolloutWeightSync: logprob_diff_threshold must be positive (or null), "
                             f"got {logprob_diff_threshold}")
        if logprob_diff_steps < 1:
            raise ValueError(f"RolloutWeightSync: logprob_diff_steps must be a positive number of steps, "
                             f"got {logprob_diff_steps}")
        self.check_every, self.tolerance, self.seed = check_every, tolerance, seed
        self.logprob_diff_threshold, self.logprob_diff_steps = logprob_diff_threshold, logprob_diff_steps
        self.steps_above_threshold = 0
        self.syncs = 0  # compact syncs sent (its checkpointed state, so checks keep their rhythm across resumes)
        self.full_loads = 0
        self._engine: RolloutEngine | None = None  # the engine kept in step, once attached
        self._tensors: Callable[[], dict[str, torch.Tensor]] = dict
        self._max_over_ranks: Callable[[float], float] = float
        self._bytes: dict[str, int] = {}  # each engine tensor's bytes (sync/dense_bytes)

    # ---- the WeightSync the module calls --------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._engine = None  # the engine is (re)started from the model's files when the module is configured

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._engine is not None:  # (kept: its weights can still be checked once the run is over)
            self._engine.reload_after_restart(None)

    def attach(self, engine: RolloutEngine, tensors: Callable[[], dict[str, torch.Tensor]],
               max_over_ranks: Callable[[float], float]) -> None:
        if engine is self._engine:
            return  # in step since this fit, validate or test began (a validation inside fit)
        self._engine, self._tensors, self._max_over_ranks = engine, tensors, max_over_ranks
        engine.reload_after_restart(self.full_sync)  # a restarted engine starts from the model's files
        self.full_sync()

    def full_sync(self) -> int:
        """Load every tensor the engine holds from the trainer; returns the bytes sent."""
        tensors = self._tensors()
        sent = self._engine.load_weights(tensors)
        self._bytes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
        self.full_loads += 1
        return sent

    def sync(self, update: Update | None, sampler_diff: float) -> dict[str, float]:
        due = self._sampler_drifting(sampler_diff)
        # NaN when the update was skipped (nothing changed, nothing sent), and between checks.
        sent = dense_bytes = seconds = diff = math.nan
        if update:
            start = time.perf_counter()
            sent = self._engine.apply_update(update)
            seconds = time.perf_counter() - start
            self.syncs += 1
            dense_bytes = sum(self._bytes[n] for n in update.low_rank)
            dense_bytes += sum(t.numel() * t.element_size() for t in update.dense.values())
            due |= self.check_every is not None and self.syncs % self.check_every == 0
        if due:
            # With several ranks each checks (and repairs) its own engine, all at the same syncs: their count and the
            # log-prob difference behind `due` are the same on every rank. The log shows the largest difference of
            # any rank (NaN travels as inf, which the maximum keeps).
            diff = self._max_over_ranks(self.check())
        return {"sync/bytes": float(sent), "sync/dense_bytes": float(dense_bytes), "sync/seconds": seconds,
                "sync/max_abs_diff": diff, "sync/restarts": float(self._engine.restarts),
                "sync/full_loads": float(self.full_loads)}

    def _sampler_drifting(self, diff: float) -> bool:
        """Whether the sampler's log-probs have been far from the trainer's for `logprob_diff_steps` steps in a row:
        drift in any tensor shows there, between the periodic checks."""
        if self.logprob_diff_threshold is None or math.isnan(diff):
            return False
        self.steps_above_threshold = self.steps_above_threshold + 1 if diff > self.logprob_diff_threshold else 0
        if self.steps_above_threshold < self.logprob_diff_steps:
            return False
        self.steps_above_threshold = 0
        return True

    def max_abs_diff(self) -> float:
        """max |fingerprint(engine W) − fingerprint(trainer W)| over every tensor the engine holds: the trained ones,
        and the untrained ones (norms, embeddings, frozen matrices) too, which nothing else would ever check."""
        params = self._tensors()
        seed = self.seed * 1_000_003 + self.syncs
        theirs = self._engine.fingerprints(list(params), seed)
        diffs = [torch.zeros((), dtype=torch.float64)]
        for name, param in params.items():
            ours = fingerprint(param, seed).cpu()
            diffs.append((theirs[name][: ours.shape[0]] - ours).abs().max())
        return float(torch.stack(diffs).max())  # NaN anywhere stays NaN

    def check(self) -> float:
        """Compare fingerprints; past the tolerance, load the full weights. Returns the difference found."""
        diff = self.max_abs_diff()
        if not diff <= self.tolerance:  # NaN counts as drift too
            log.warning("RolloutWeightSync: the engine's weights drifted from the trainer's by %.3g (tolerance %.3g); "
                        "loading the full weights", diff, self.tolerance)
            self.full_sync()
        return diff

    def state_dict(self) -> dict[str, Any]:
        return {"syncs": self.syncs}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.syncs = state_dict["syncs"]
