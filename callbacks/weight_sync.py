"""RolloutWeightSync: keep a rollout engine's own copy of the weights (vLLM) equal to the trainer's.

The engine starts from the model's files. At the start the fingerprints of every tensor it holds are compared with
the trainer's, and what differs at all (a resumed checkpoint's weights) is loaded, nothing else. Then, after every
applied update, only what changed: for each sketched matrix the factor F = α·η·U (d×r) and the seed of A, from which
the engine regenerates A and merges W −= F·A itself; densely trained parameters, if any, as whole tensors; a LoRA
run's change of each adapted matrix as a low-rank delta of rank 2r (the training mode makes it:
`lightning_logra.train.modes`). Every `check_every` syncs the fingerprints are compared again and the tensors that
drifted past `tolerance` are loaded; a restarted engine gets every tensor. A sampler whose log-probs stay far from
the trainer's (the step's `rollout/logprob_abs_diff` above `logprob_diff_threshold` for `logprob_diff_steps` steps in
a row) triggers the same check at once. With several ranks, each rank keeps its own engine in step (every rank
applies the same update). Under sharded training (FSDP) each rank holds only its rows of every tensor: the whole F is
all-gathered by the training mode, fingerprints are computed on each rank's rows and all-gathered (d numbers per
matrix), and a tensor an engine needs whole is gathered by every rank together, one at a time; no rank ever holds
the whole model.

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
from torch.distributed.tensor import DTensor

from lightning_logra.algo.update import Update
from lightning_logra.base.settings import check_at_least, check_positive
from lightning_logra.rollout import RolloutEngine, WeightSync
from lightning_logra.rollout.sync import whole, whole_fingerprint

log = logging.getLogger(__name__)

_LOAD_CHUNK_BYTES = 512 * 2**20  # a load gathers and sends this much at a time (or one tensor, if larger)
_SENT_METRICS = ("sync/bytes", "sync/dense_bytes", "sync/seconds")  # NaN when nothing was sent (a skipped update)


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
        check_positive("RolloutWeightSync: check_every", check_every, "number of syncs", integer=True,
                       null="no periodic check")
        check_at_least("RolloutWeightSync: tolerance", tolerance, 0)
        check_positive("RolloutWeightSync: logprob_diff_threshold", logprob_diff_threshold, null="no log-prob trigger")
        check_positive("RolloutWeightSync: logprob_diff_steps", logprob_diff_steps, "number of steps", integer=True)
        self.check_every, self.tolerance, self.seed = check_every, tolerance, seed
        self.logprob_diff_threshold, self.logprob_diff_steps = logprob_diff_threshold, logprob_diff_steps
        self.steps_above_threshold = 0
        self.syncs = 0  # compact syncs sent (its checkpointed state, so checks keep their rhythm across resumes)
        self.loads = 0  # times tensors were loaded into this rank's engine: at the start, repairs, restarts
        self._engine: RolloutEngine | None = None  # the engine kept in step, once attached
        self._tensors: Callable[[], dict[str, torch.Tensor]] = dict
        self._max_over_ranks: Callable[[torch.Tensor], torch.Tensor] = lambda values: values
        self._bytes: dict[str, int] = {}  # each engine tensor's bytes (sync/dense_bytes)

    # ---- the WeightSync the module calls --------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._engine = None  # the engine is (re)started from the model's files when the module is configured

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._engine is not None:  # (kept: its weights can still be checked once the run is over)
            self._engine.reload_after_restart(None)

    def attach(self, engine: RolloutEngine, tensors: Callable[[], dict[str, torch.Tensor]],
               max_over_ranks: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if engine is self._engine:
            return  # in step since this fit, validate or test began (a validation inside fit)
        self._engine, self._tensors, self._max_over_ranks = engine, tensors, max_over_ranks
        current = tensors()
        self._bytes = {name: t.numel() * t.element_size() for name, t in current.items()}
        sharded = any(isinstance(t, DTensor) for t in current.values())
        # A restarted engine starts from the model's files and needs every tensor of the trainer's — which, sharded,
        # only every rank together can gather, and the restart happens on one rank alone.
        engine.reload_after_restart(self._refuse_reload if sharded else self.full_sync)
        if not sharded:
            engine.read_trainer_tensors(tensors)
        # The engine started from the model's files: only what differs from the trainer's weights is loaded (a
        # resumed checkpoint's, weights in another dtype). Any difference at all: the engine must equal the trainer.
        self.repair(tolerance=0.0)

    def full_sync(self) -> int:
        """Load every tensor the engine holds from the trainer (a restarted engine's reload); returns the bytes."""
        return self._load(list(self._tensors()), mine=None)

    def _refuse_reload(self) -> None:
        raise RuntimeError(
            "RolloutWeightSync: this rank's vLLM engine died and was restarted; under sharded training (FSDP) its "
            "weights can only be reloaded with every rank taking part, and the others are elsewhere in the step. "
            "Resume the run from its last checkpoint (--ckpt_path): each engine is compared with the trainer at the "
            "start and what differs is loaded")

    def _load(self, names: list[str], mine: set[str] | None) -> int:
        """Send the named tensors' whole values to this rank's engine — only those in `mine` (None: all) — a chunk
        at a time: sharded tensors are gathered one by one, by every rank (each rank names the same ones), so a rank
        holds at most about `_LOAD_CHUNK_BYTES` of gathered tensors (or the largest one) besides its shards.
        Returns the bytes sent."""
        params = self._tensors()
        sent, chunk, size = 0, {}, 0
        for position, name in enumerate(names):
            tensor = whole(params[name])
            if mine is None or name in mine:
                chunk[name] = tensor
                size += tensor.numel() * tensor.element_size()
            if chunk and (size >= _LOAD_CHUNK_BYTES or position == len(names) - 1):
                sent += self._engine.load_weights(chunk)
                chunk, size = {}, 0
        if mine is None or mine:
            self.loads += 1
        return sent

    def sync(self, update: Update | None, sampler_diff: float) -> dict[str, float]:
        sent = self.send(self.payload(update)) if update else dict.fromkeys(_SENT_METRICS, math.nan)
        return {**sent, **self.after_step(bool(update), sampler_diff)}

    def payload(self, update: Update, copy: bool = False) -> Update:
        # Densely trained values the trainer holds sharded travel whole (every rank gathers them together).
        dense = {name: whole(value) for name, value in update.dense.items()}
        if copy:  # the others are the live parameters: a later step changes them
            dense = {name: value.clone() if value is update.dense[name] else value for name, value in dense.items()}
        return Update(update.low_rank, dense)

    def send(self, update: Update) -> dict[str, float]:
        start = time.perf_counter()
        sent = self._engine.apply_update(update)
        seconds = time.perf_counter() - start
        dense_bytes = sum(self._bytes[n] for n in update.low_rank)
        dense_bytes += sum(t.numel() * t.element_size() for t in update.dense.values())
        return {"sync/bytes": float(sent), "sync/dense_bytes": float(dense_bytes), "sync/seconds": seconds}

    def after_step(self, sent: bool, sampler_diff: float, settle: Callable[[], None] = lambda: None
                   ) -> dict[str, float]:
        due = self._sampler_drifting(sampler_diff)
        if sent:
            self.syncs += 1
            due |= self.check_every is not None and self.syncs % self.check_every == 0
        diff = math.nan  # between checks
        if due:
            # Every rank checks (and repairs) its own engine, all at the same syncs: their count and the log-prob
            # difference behind `due` are the same on every rank.
            settle()
            diff = self.check()
        return {"sync/max_abs_diff": diff, "sync/restarts": float(self._engine.restarts),
                "sync/loads": float(self.loads)}

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

    def differences(self) -> dict[str, float]:
        """{name: max |fingerprint(engine W) − fingerprint(trainer W)|} for every tensor this rank's engine holds:
        the trained ones, and the untrained ones (norms, embeddings, frozen matrices) too, which nothing else would
        ever check. Sharded tensors' fingerprints are all-gathered (d numbers each; a collective)."""
        params = self._tensors()
        seed = self.seed * 1_000_003 + self.syncs  # the same on every rank: sharded fingerprints are gathered
        theirs = self._engine.fingerprints(list(params), seed)
        out = {}
        for name, param in params.items():
            ours = whole_fingerprint(param, seed).cpu()
            out[name] = float((theirs[name][: ours.shape[0]] - ours).abs().max())  # NaN anywhere stays NaN
        return out

    def max_abs_diff(self) -> float:
        """The largest fingerprint difference of this rank's engine (`differences`); 0.0 when it holds nothing."""
        return max(self.differences().values(), default=0.0)

    def repair(self, tolerance: float) -> float:
        """Compare every rank's engine with the trainer; load into each engine the tensors whose difference is past
        `tolerance` (NaN counts as one) — only those. Returns the largest difference of any rank."""
        diffs = self.differences()
        names = list(diffs)
        mine = torch.tensor([diffs[name] for name in names], dtype=torch.float64)
        everyone = self._max_over_ranks(mine.nan_to_num(nan=math.inf)).cpu()  # NaN travels as inf
        # Gathering a sharded tensor takes every rank: each gathers what any rank's engine lacks, and loads its own.
        drifted = [name for name, diff in zip(names, everyone.tolist()) if not diff <= tolerance]
        if drifted:
            ours = {name for name in drifted if not diffs[name] <= tolerance}
            if ours:
                log.warning("RolloutWeightSync: %d tensors of the engine differ from the trainer's by up to %.3g "
                            "(tolerance %.3g; %s...); loading them", len(ours), max(diffs[n] for n in ours),
                            tolerance, sorted(ours)[0])
            self._load(drifted, mine=ours)
        return float(everyone.max()) if names else 0.0

    def check(self) -> float:
        """Compare fingerprints; load what drifted past the tolerance. Returns the largest difference of any rank."""
        return self.repair(self.tolerance)

    def state_dict(self) -> dict[str, Any]:
        return {"syncs": self.syncs}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.syncs = state_dict["syncs"]
