"""RolloutWeightSync: keep a rollout engine's own copy of the weights (vLLM) equal to the trainer's.

A full load once at the start; then, after every applied update, only what changed: for each sketched matrix the
factor F = α·η·U (d×r) and the seed of A, from which the engine regenerates A and merges W −= F·A itself; densely
trained parameters, if any, as full tensors. Every `check_every` syncs the fingerprints of every tensor the engine
holds (trained or not) are compared with the trainer's and a drift past `tolerance` is repaired by a full load, as
is a restarted engine. A sampler whose log-probs stay far from the trainer's (`rollout/logprob_abs_diff` above
`logprob_diff_threshold` for `logprob_diff_steps` steps in a row) triggers the same check at once. With several
ranks, each rank keeps its own engine in step (every rank holds the same weights and applies the same update).

A LoRA run (`lightning_logra.lora.LoRAStrategy`) sends the same compact form: after each update, per adapted matrix
the change of its merged weight W₀ + s·B·A, which has rank at most 2r, as a low-rank delta with an explicit (2r, k)
factor in place of a seed (`lora.low_rank_deltas`; 2r·(d + k) numbers instead of d·k), measured from the adapters as
they were at the last sync (a copy of them is this callback's state); a full load sends the merged weights.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_logra import lora
from lightning_logra.rollout import fingerprint
from lightning_logra.sketch.install import sketch_carriers
from lightning_logra.update import Update

log = logging.getLogger(__name__)


class RolloutWeightSync(Callback):
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
        self._in_sync = False
        self._module: LightningModule | None = None
        self._adapters: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # LoRA: (A, B) as the engine has them
        self._bytes: dict[str, int] = {}  # each engine tensor's bytes (sync/dense_bytes)

    # ---- wiring ---------------------------------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._in_sync = False  # the engine is (re)started from the model's files when the module is configured

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if getattr(pl_module, "engine", None) is not None:
            pl_module.engine.on_restart = None

    def _ensure_synced(self, pl_module: LightningModule) -> None:
        # Runs once the module is configured (engine started); the trainer's weights may be a resumed checkpoint's.
        if self._in_sync:
            return
        engine = pl_module.engine
        if engine.samples_from(pl_module.policy):
            raise ValueError(
                "RolloutWeightSync: the in-process engine generates with the policy's own weights, so there is "
                "nothing to sync; set model.engine (e.g. class_path: lightning_logra.rollout.VLLMEngine) or remove "
                "the callback"
            )
        self._module = pl_module
        engine.on_restart = self.full_sync  # a restarted engine starts from the model's files: reload ours
        self.full_sync()

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._ensure_synced(pl_module)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._ensure_synced(pl_module)

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._ensure_synced(pl_module)

    # ---- sync, check, repair ----------------------------------------------------------------------------------------

    @staticmethod
    def _engine_tensors(pl_module: LightningModule) -> dict[str, torch.Tensor]:
        """Every parameter of the policy, as the engine holds it too (the sketch carriers B are not parameters of the
        model's files and are left out; LoRA adapters are merged into their matrices)."""
        if lora.adapted_layers(pl_module.policy):
            return lora.engine_tensors(pl_module.policy)
        carriers = sketch_carriers(pl_module.policy)
        return {name: p.detach() for name, p in pl_module.policy.named_parameters() if id(p) not in carriers}

    def full_sync(self) -> int:
        """Load every parameter of the policy into the engine; returns the bytes sent."""
        pl_module = self._module
        tensors = self._engine_tensors(pl_module)
        self._adapters = lora.adapter_snapshot(pl_module.policy)  # empty without LoRA adapters
        sent = pl_module.engine.load_weights(tensors)
        self._bytes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
        self.full_loads += 1
        self._in_sync = True
        return sent

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # The module's training step returns the update it applied (None: skipped, the weights did not change).
        update = outputs["update"]
        due = self._sampler_drifting(trainer)
        # NaN when the update was skipped (nothing changed, nothing sent): Lightning would repeat the last values.
        sent = dense_bytes = seconds = math.nan
        if update:
            start = time.perf_counter()
            if self._adapters:  # the module's update holds new adapter values: send the merged weights' change
                update = Update(lora.low_rank_deltas(pl_module.policy, self._adapters))
                self._adapters = lora.adapter_snapshot(pl_module.policy)
            sent = pl_module.engine.apply_update(update)
            seconds = time.perf_counter() - start
            self.syncs += 1
            dense_bytes = sum(self._bytes[n] for n in update.low_rank)
            dense_bytes += sum(t.numel() * t.element_size() for t in update.dense.values())
            due |= self.check_every is not None and self.syncs % self.check_every == 0
        if due:
            diff = self.check()
            # With several ranks each checks (and repairs) its own engine, all at the same syncs: their count and the
            # log-prob metric behind `due` are the same on every rank. The log shows the largest difference of any
            # rank (NaN travels as inf, which MAX keeps).
            if trainer.world_size > 1:
                ours = torch.tensor(diff if not math.isnan(diff) else math.inf, device=pl_module.device)
                diff = float(trainer.strategy.reduce(ours, reduce_op="max"))
            # Straight to the loggers: through self.log, Lightning would repeat the last value at every later step.
            for logger in trainer.loggers:
                logger.log_metrics({"sync/max_abs_diff": diff}, step=trainer.global_step)
        pl_module.log_dict({"sync/bytes": float(sent), "sync/dense_bytes": float(dense_bytes),
                            "sync/seconds": seconds, "sync/restarts": float(pl_module.engine.restarts),
                            "sync/full_loads": float(self.full_loads)})

    def _sampler_drifting(self, trainer: Trainer) -> bool:
        """Whether the sampler's log-probs have been far from the trainer's for `logprob_diff_steps` steps in a row:
        drift in any tensor shows there, between the periodic checks."""
        diff = trainer.callback_metrics.get("rollout/logprob_abs_diff")
        if self.logprob_diff_threshold is None or diff is None:
            return False
        self.steps_above_threshold = self.steps_above_threshold + 1 if diff > self.logprob_diff_threshold else 0
        if self.steps_above_threshold < self.logprob_diff_steps:
            return False
        self.steps_above_threshold = 0
        return True

    def max_abs_diff(self) -> float:
        """max |fingerprint(engine W) − fingerprint(trainer W)| over every tensor the engine holds: the trained ones,
        and the untrained ones (norms, embeddings, frozen matrices) too, which nothing else would ever check."""
        pl_module = self._module
        params = self._engine_tensors(pl_module)
        seed = self.seed * 1_000_003 + self.syncs
        theirs = pl_module.engine.fingerprints(list(params), seed)
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
