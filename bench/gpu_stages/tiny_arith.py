"""tiny_arith: configs/tiny_arith.yaml trained on the GPU for 50 steps through the command line itself (its parser,
module, data, sketch strategy and callbacks), reward at the start and at the end."""

from __future__ import annotations

import tempfile
import time

from lightning.pytorch import Callback

from bench.gpu_stages.plan import Plan, Progress, through_cli


class Record(Callback):
    """Each step's reward and whether the KL control acted (listed after PredictedKLBudget, which logs it)."""

    def __init__(self) -> None:
        self.rewards: list[float] = []
        self.acting: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        metrics = trainer.callback_metrics
        self.rewards.append(float(metrics["train/reward_mean"]))
        if "kl/acting" in metrics:
            self.acting.append(float(metrics["kl/acting"]))


def max_time(seconds: float) -> str:
    """The Trainer's max_time as the command line takes it, DD:HH:MM:SS."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    return f"{days:02d}:{hours:02d}:{minutes:02d}:{secs:02d}"


def tiny_arith(plan: Plan, progress: Progress) -> dict:
    """`fit` of configs/tiny_arith.yaml for `arith_steps` steps on `plan.device` through `lightning_logra.cli.main`,
    with `Record` added to its callbacks; no logger, no validation, its checkpoints and saved config in a temporary
    folder."""
    from lightning_logra.callbacks.memory import MemoryProfiler

    with tempfile.TemporaryDirectory() as root:
        start = time.perf_counter()
        cli = through_cli(
            "tiny_arith.yaml", "--trainer.accelerator", "gpu" if plan.device == "cuda" else "cpu",
            "--trainer.max_steps", str(plan.arith_steps), "--trainer.max_time", max_time(plan.arith_budget_s),
            "--trainer.logger", "false", "--trainer.default_root_dir", root, "--trainer.limit_val_batches", "0",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            f"--trainer.callbacks+={Record.__module__}.Record", fit=True)
        seconds = time.perf_counter() - start
    trainer = cli.trainer
    record = next(c for c in trainer.callbacks if type(c).__name__ == "Record")
    profiler = next((c for c in trainer.callbacks if isinstance(c, MemoryProfiler)), None)
    tenth = max(1, len(record.rewards) // 10)
    return dict(
        steps=trainer.global_step, seconds=seconds, rewards=record.rewards,
        reward_first=sum(record.rewards[:tenth]) / tenth, reward_last=sum(record.rewards[-tenth:]) / tenth,
        kl_acting_rate=sum(record.acting) / len(record.acting) if record.acting else None,
        peak_gib=max(peak for _, peak in profiler.steps) if profiler and profiler.steps else None,
    )
