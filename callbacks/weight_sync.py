"""RolloutWeightSync: keep a rollout engine's own copy of the weights (vLLM) equal to the trainer's.

A full load once at the start; then, after every applied update, only what changed: for each sketched matrix the
factor F = α·η·U (d×r) and the seed of A, from which the engine regenerates A and merges W −= F·A itself; densely
trained parameters, if any, as full tensors. Every `check_every` syncs the engine's fingerprints are compared with
the trainer's and a drift past `tolerance` is repaired by a full load, as is a restarted engine.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_logra.rollout import HFEngine, SyncPayload, fingerprint
from lightning_logra.sketch.optim import SketchOptimizer


class RolloutWeightSync(Callback):
    """
    F travels in the dtype the sketch optimizer merged it in (`sketch.factor_dtype`), with the key of its stochastic
    rounding into low-precision weights, so the engine's merge reproduces the trainer's bit for bit.

    Args:
        check_every: compare fingerprints every this many syncs (None: never, except on demand with `check`).
        tolerance: the largest |fingerprint difference| accepted before a full resync (fingerprints are W·v for a
            seeded ±1 vector v, so one entry off by ε shows as ε).
        seed: seeds the fingerprint vectors (a new vector at every check).
    """

    def __init__(
        self,
        check_every: int | None = 50,
        tolerance: float = 1e-4,
        seed: int = 0,
    ) -> None:
        if check_every is not None and check_every < 1:
            raise ValueError(f"RolloutWeightSync: check_every must be a positive number of syncs or None, "
                             f"got {check_every}")
        if tolerance < 0:
            raise ValueError(f"RolloutWeightSync: tolerance must be >= 0, got {tolerance}")
        self.check_every, self.tolerance, self.seed = check_every, tolerance, seed
        self.syncs = 0  # compact syncs sent (its checkpointed state, so checks keep their rhythm across resumes)
        self.full_loads = 0
        self._in_sync = False
        self._module: LightningModule | None = None

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
        if isinstance(engine, HFEngine) and engine.model is pl_module.policy:
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

    # ---- what is synced -------------------------------------------------------------------------------------------

    def _optimizers(self, pl_module: LightningModule) -> list[torch.optim.Optimizer]:
        optimizers = pl_module.trainer.optimizers
        return [getattr(opt, "optimizer", opt) for opt in optimizers]

    def _trained_names(self, pl_module: LightningModule) -> tuple[list[str], list[str]]:
        """(sketched weight names, densely trained parameter names), as the policy names them."""
        sketched, dense = [], []
        params = {id(p): name for name, p in pl_module.policy.named_parameters()}
        for opt in self._optimizers(pl_module):
            if isinstance(opt, SketchOptimizer):
                sketched += [f"{layer.name}.weight" for layer in opt.layers]
            else:
                dense += [params[id(p)] for group in opt.param_groups for p in group["params"] if id(p) in params]
        return sketched, dense

    def payload(self, pl_module: LightningModule) -> SyncPayload:
        """The last step's update: low-rank deltas of the sketched weights, current values of dense ones."""
        payload = SyncPayload()
        if not pl_module.last_update_applied:
            return payload
        for opt in self._optimizers(pl_module):
            if isinstance(opt, SketchOptimizer):
                payload.low_rank.update({f"{name}.weight": delta for name, delta in opt.last_updates.items()})
        params = dict(pl_module.policy.named_parameters())
        payload.dense.update({name: params[name].detach() for name in self._trained_names(pl_module)[1]})
        return payload

    # ---- sync, check, repair ----------------------------------------------------------------------------------------

    def full_sync(self) -> int:
        """Load every parameter of the policy into the engine (its sketch carriers B are not parameters of the
        model's files and are left out); returns the bytes sent."""
        pl_module = self._module
        params = {name: p.detach() for name, p in pl_module.policy.named_parameters() if ".sketch_param" not in name}
        sent = pl_module.engine.load_weights(params)
        self.full_loads += 1
        self._in_sync = True
        return sent

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        payload = self.payload(pl_module)
        if not payload:
            return  # the update was skipped: the weights did not change
        start = time.perf_counter()
        sent = pl_module.engine.apply_update(payload)
        seconds = time.perf_counter() - start
        self.syncs += 1
        params = dict(pl_module.policy.named_parameters())
        dense_bytes = sum(params[n].numel() * params[n].element_size() for n in payload.low_rank)
        dense_bytes += sum(t.numel() * t.element_size() for t in payload.dense.values())
        if self.check_every is not None and self.syncs % self.check_every == 0:
            diff = self.check()
            # Straight to the loggers: through self.log, Lightning would repeat the last value at every later step.
            for logger in trainer.loggers:
                logger.log_metrics({"sync/max_abs_diff": diff}, step=trainer.global_step)
        pl_module.log_dict({"sync/bytes": float(sent), "sync/dense_bytes": float(dense_bytes),
                            "sync/seconds": seconds, "sync/restarts": float(pl_module.engine.restarts),
                            "sync/full_loads": float(self.full_loads)})

    def max_abs_diff(self) -> float:
        """max |fingerprint(engine W) − fingerprint(trainer W)| over every trained tensor."""
        pl_module = self._module
        sketched, dense = self._trained_names(pl_module)
        names = sketched + dense
        seed = self.seed * 1_000_003 + self.syncs
        theirs = pl_module.engine.fingerprints(names, seed)
        params = dict(pl_module.policy.named_parameters())
        diffs = [torch.zeros((), dtype=torch.float64)]
        for name in names:
            ours = fingerprint(params[name], seed).cpu()
            diffs.append((theirs[name][: ours.shape[0]] - ours).abs().max())
        return float(torch.stack(diffs).max())  # NaN anywhere stays NaN

    def check(self) -> float:
        """Compare fingerprints; past the tolerance, load the full weights. Returns the difference found."""
        diff = self.max_abs_diff()
        if not diff <= self.tolerance:  # NaN counts as drift too
            self.full_sync()
        return diff

    def state_dict(self) -> dict[str, Any]:
        return {"syncs": self.syncs}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.syncs = state_dict["syncs"]
