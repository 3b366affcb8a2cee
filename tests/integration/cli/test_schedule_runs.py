"""Learning-rate schedules: the factor of each update; one schedule over every optimizer of a sketch run (the sketch
optimizer and the AdamW of train_rest), of the dense baseline and of a Fabric run; held on skipped updates; logged
as train/lr; continued exactly by a resumed run."""

import glob

import pytest
import torch
import yaml
from lightning.pytorch import Callback

from conftest import PoisonSketchAt
from lightning_logra.callbacks import PredictedKLBudget
from lightning_logra.sketch import sketched_layers

SKETCH = "--trainer.strategy.init_args.sketch"


class Record(Callback):
    """Per training step: each optimizer's lr as the step starts, the logged train/lr and train/rest_lr, the
    sketches the sketch optimizer is given, and the update applied."""

    def __init__(self) -> None:
        self.lrs, self.logged, self.sketches, self.updates = [], [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs.append([opt.param_groups[0]["lr"] for opt in trainer.optimizers])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # the first optimizer's step only
        self.sketches.append({f"{n}.weight": h.sketch.clone() for n, h in sketched_layers(pl_module.policy).items()
                              if h.sketch is not None})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        metrics = trainer.callback_metrics
        self.logged.append([float(metrics[key]) for key in ("train/lr", "train/rest_lr") if key in metrics])
        self.updates.append(outputs["update"])


def _fit(run_cli, config: str, steps: int, callbacks: list[Callback], *overrides: str):
    """A tiny run of `config` with 4 samples per prompt, no clipping, no validation and no KL control (the schedule
    alone sets each step's size), `callbacks` added; returns its trainer."""
    cli = run_cli(config, "--model.sampling.num_generations", "4", "--model.sampling.max_new_tokens", "4",
                  "--model.training.micro_batch_size",
                  "16", "--model.training.max_grad_norm", "null", "--model.scoring.timeout_s", "null",
                  "--trainer.limit_val_batches", "0", *overrides, steps=steps, run=False)
    cli.trainer.callbacks = [c for c in cli.trainer.callbacks if not isinstance(c, PredictedKLBudget)] + callbacks
    cli.trainer.fit(cli.model, cli.datamodule)
    return cli.trainer


def test_a_sketch_run_schedules_both_optimizers_by_applied_update(run_cli):
    # Warm-up over 2 updates, then linear decay to ½ at update 4: f = ½, 1, 1, ¾, ½. The update of step 1 is skipped
    # (a NaN sketch): it is taken at f(1) but changes nothing, so step 2 is taken at f(1) again, and so on.
    schedule = [f"{SKETCH}.lr_schedule.warmup_steps", "2", f"{SKETCH}.lr_schedule.decay", "linear",
                f"{SKETCH}.lr_schedule.total_steps", "4", f"{SKETCH}.lr_schedule.min_lr_ratio", "0.5"]
    record = Record()
    trainer = _fit(run_cli, "tiny_arith", 5, [PoisonSketchAt(step=1), record], f"{SKETCH}.rank", "8",
                   f"{SKETCH}.optimizer", "lightning_logra.sketch.SketchSGD", f"{SKETCH}.optimizer.lr", "0.1",
                   *schedule, f"{SKETCH}.train_rest", "true", f"{SKETCH}.rest_lr", "1e-3")
    factors = [0.5, 1.0, 1.0, 1.0, 0.75]  # f(0), f(1) skipped, f(1), f(2), f(3)
    assert record.lrs == [[pytest.approx(0.1 * f, rel=1e-12), pytest.approx(1e-3 * f, rel=1e-12)] for f in factors]
    assert record.logged == [pytest.approx(lrs, rel=1e-6) for lrs in record.lrs]  # train/lr, train/rest_lr
    assert [update is None for update in record.updates] == [False, True, False, False, False]
    # The merged factor is the scheduled η times U = S (SketchSGD, α = 1): the schedule is what the update used.
    for factor, sketches, update in zip(factors, record.sketches, record.updates):
        if update is not None:
            for name, delta in update.low_rank.items():
                torch.testing.assert_close(delta.factor, 0.1 * factor * sketches[name], rtol=1e-6, atol=0)
    assert [config.scheduler.last_epoch for config in trainer.lr_scheduler_configs] == [4, 4]  # 4 applied updates


def test_the_dense_baseline_follows_its_own_schedule(run_cli):
    record = Record()
    _fit(run_cli, "tiny_arith_dense_all", 4, [record], "--trainer.strategy.init_args.dense.lr", "1e-2",
         "--trainer.strategy.init_args.dense.lr_schedule.warmup_steps", "3")
    assert record.lrs == [[pytest.approx(1e-2 * f, rel=1e-12)] for f in (1 / 3, 2 / 3, 1.0, 1.0)]
    assert record.logged == [pytest.approx(lrs, rel=1e-6) for lrs in record.lrs]


def _resumable_run(run_cli, root, steps, *extra):
    # tiny_arith.yaml without the KL controller: under a binding KL budget α·η does not depend on η
    # (docs/logra-settings.md, "Learning-rate schedules"), so a wrong learning rate would not show in the weights.
    overrides = root.parent / f"{root.name}.yaml"
    overrides.write_text(yaml.safe_dump({"trainer": {"callbacks": [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"save_last": True, "every_n_train_steps": 1}}]}}))
    return run_cli("tiny_arith", "--config", str(overrides), "--trainer.val_check_interval", "1000",
                   f"{SKETCH}.train_rest", "true", f"{SKETCH}.rest_lr", "1e-3",
                   f"{SKETCH}.lr_schedule.warmup_steps", "2", f"{SKETCH}.lr_schedule.decay", "cosine",
                   f"{SKETCH}.lr_schedule.total_steps", "4", f"{SKETCH}.lr_schedule.min_lr_ratio", "0.1", *extra,
                   steps=steps, root=root)


def test_a_resumed_run_continues_the_schedule_exactly(run_cli, tmp_path):
    straight = _resumable_run(run_cli, tmp_path / "a", 4)
    _resumable_run(run_cli, tmp_path / "b", 2)
    (checkpoint,) = glob.glob(str(tmp_path / "b" / "**" / "checkpoints" / "last.ckpt"), recursive=True)  # not latest/
    resumed = _resumable_run(run_cli, tmp_path / "c", 4, "--ckpt_path", checkpoint)
    for a, b in zip(straight.trainer.lr_scheduler_configs, resumed.trainer.lr_scheduler_configs):
        assert a.scheduler.last_epoch == b.scheduler.last_epoch == 4
        assert a.scheduler.get_last_lr() == b.scheduler.get_last_lr()
    # At update 4 the cosine has reached its floor: 0.1 of the sketch optimizer's 1e-3 and of rest_lr's 1e-3.
    assert [o.param_groups[0]["lr"] for o in resumed.trainer.optimizers] == [pytest.approx(1e-4), pytest.approx(1e-4)]
    a, b = straight.model.policy.state_dict(), resumed.model.policy.state_dict()
    for name in a:
        assert torch.equal(a[name], b[name]), name
