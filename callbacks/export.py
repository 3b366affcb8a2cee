"""Transformers folders of the policy during and at the end of a fit, as `ModelCheckpoint` writes checkpoints."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_logra.base.settings import check_positive
from lightning_logra.train.policy import export_policy


class PolicyExport(Callback):
    """Exports the policy and tokenizer (`policy.export_policy`) to `dirpath` at the end of fit and, with
    `every_n_train_steps`, also to `dirpath/step-NNNNNN` every that many steps. The module adds one for
    `model.export.dir` (`RLVRModule.configure_callbacks`); a sharded policy is gathered first (every rank takes part),
    and rank 0 writes."""

    def __init__(self, dirpath: str, every_n_train_steps: int | None = None) -> None:
        check_positive("PolicyExport's every_n_train_steps", every_n_train_steps, "number of steps", integer=True,
                       null="at the end of fit only")
        self.dirpath, self.every = Path(dirpath), every_n_train_steps

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if self.every is not None and trainer.global_step % self.every == 0:
            self._export(trainer, pl_module, self.dirpath / f"step-{trainer.global_step:06d}")

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._export(trainer, pl_module, self.dirpath)

    @staticmethod
    def _export(trainer: Trainer, pl_module: LightningModule, path: Path) -> None:
        state_dict = pl_module.collectives.whole_policy_state()  # a collective where the weights are sharded
        if trainer.is_global_zero:
            export_policy(pl_module.policy, pl_module.tokenizer, path, state_dict)
