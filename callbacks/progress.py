"""StepProgressBar: a progress bar that counts optimizer steps, `step 120/600`, on runs that stop at max_steps.

Lightning's bars count the batches of an epoch and name the epoch against max_epochs - 1. An RL run is step-based
(max_steps, an endless prompt sampler, max_epochs -1), so they read "Epoch 0/-2", and a resumed run's bar counts
from 0 towards the steps left. This bar shows the global step against max_steps, resumed runs included; on an
epoch-based run it is Lightning's TQDM bar unchanged. The command line uses it unless the config names a bar.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar

# tqdm's default layout with the step count in front and "step/s" as the rate.
_STEP_FORMAT = "step {n_fmt}/{total_fmt} {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


def _step_based(trainer: Trainer) -> bool:
    return trainer.max_steps > 0 and trainer.max_epochs in (None, -1)


class StepProgressBar(TQDMProgressBar):
    """Args: those of Lightning's `TQDMProgressBar` (refresh_rate, process_position, leave)."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A run resumed from a checkpoint taken inside an epoch starts no epoch: its bar is set up here too, or
        # Lightning's own would show ("Training: 6/?").
        super().on_train_start(trainer, pl_module)
        self._count_steps(trainer)

    def on_train_epoch_start(self, trainer: Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self._count_steps(trainer)

    def _count_steps(self, trainer: Trainer) -> None:
        """The bar counts optimizer steps against trainer.max_steps, from the step the run starts at."""
        if _step_based(trainer):
            bar = self.train_progress_bar
            bar.reset(total=trainer.max_steps)
            bar.n = bar.initial = trainer.global_step  # the rate counts only the steps of this run
            bar.unit = "step"
            bar.bar_format = _STEP_FORMAT
            bar.set_description("")
            bar.refresh()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not _step_based(trainer):
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        bar, step = self.train_progress_bar, trainer.global_step
        if self.is_enabled and (step % self.refresh_rate == 0 or step == bar.total):
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar
