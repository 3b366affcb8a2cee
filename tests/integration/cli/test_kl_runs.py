import math

import pytest
import torch

from lightning_logra.callbacks import PredictedKLBudget


def test_a_skipped_step_logs_nan_not_the_last_steps_kl(run_cli):
    # A sketch turned NaN in step 2's backward makes the module skip that update; the controller's metrics for
    # step 2 must say "no step" instead of repeating step 1's α and KL.
    from lightning.pytorch import Callback

    from conftest import PoisonSketchAt

    class Record(Callback):
        def __init__(self):
            self.steps = []

        def on_train_batch_end(self, trainer, pl_module, *_):
            self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()
                               if k.startswith(("kl/", "update/")) or k == "train/update_skipped"})

    # the shipped model and reward, 3 steps of 8 prompts, no validation
    cli = run_cli("tiny_arith", "--trainer.max_steps", "3", "--data.init_args.batch_size", "8",
                  "--trainer.val_check_interval", "1000", fast=False, run=False)
    record = Record()
    cli.trainer.callbacks[:0] = [PoisonSketchAt(1)]
    cli.trainer.callbacks.append(record)  # after PredictedKLBudget: sees what it logged at the step's end
    cli.trainer.fit(cli.model, cli.datamodule)
    first, skipped, third = record.steps
    assert first["train/update_skipped"] == third["train/update_skipped"] == 0.0
    assert skipped["train/update_skipped"] == 1.0
    for key in ("kl/alpha", "kl/q", "kl/predicted", "kl/realized", "kl/acting", "kl/seconds",
                "update/landed_fraction"):
        assert math.isfinite(first[key]) and math.isfinite(third[key]), key
        assert math.isnan(skipped[key]), key
    # the whole check's time is its two parts
    assert first["kl/seconds"] == pytest.approx(first["kl/control_s"] + first["kl/realized_s"])
    # kl/acting says whether the budget, not α_max (4 in this config), set the step
    for step in (first, third):
        assert step["kl/acting"] == float(step["kl/alpha"] < 4.0)


@pytest.mark.parametrize("config, extra", [
    ("tiny_arith_dense_all", ["--trainer.strategy.init_args.dense.lr", "1e-4"]),
    # no sketches at all: AdamW on every parameter
    ("tiny_arith", ["--trainer.strategy.init_args.sketch.train_rest", "true",
                    "--trainer.strategy.init_args.sketch.rest_lr", "1e-3"]),  # sketches + dense AdamW
])
def test_alpha_scales_the_whole_update_dense_parameters_included(run_cli, config, extra):
    # One step with the controller must move every trained parameter by α times the step the same run takes
    # without it (same batch, same gradient, AdamW's first step): dense parameters are not left unscaled.
    def one_step(controlled: bool):
        # the shipped model and reward, one step of 4 prompts, no validation
        cli = run_cli(config, "--trainer.max_steps", "1", "--trainer.val_check_interval", "1000",
                      "--data.init_args.batch_size", "4", "--model.training.max_grad_norm", "null", *extra, fast=False,
                      run=False)
        cli.trainer.callbacks = [cb for cb in cli.trainer.callbacks if not isinstance(cb, PredictedKLBudget)]
        if controlled:  # a budget small enough that it binds: α < α_max
            cli.trainer.callbacks.append(PredictedKLBudget(budget=2e-3, alpha_max=1.0, subset=4))
        cli.model.configure_model()
        before = {n: p.detach().clone() for n, p in cli.model.policy.named_parameters()}
        cli.trainer.fit(cli.model, cli.datamodule)
        after = {n: p.detach().clone() for n, p in cli.model.policy.named_parameters()}
        return before, after, cli.trainer.callback_metrics

    before, free, _ = one_step(False)
    _, controlled, metrics = one_step(True)
    alpha = float(metrics["kl/alpha"])
    assert 0 < alpha < 0.5
    moved = [n for n in before if not torch.equal(free[n], before[n])]
    assert any("norm" in n for n in moved) and any("q_proj.weight" in n for n in moved)
    for name in moved:
        step = alpha * (free[name].double() - before[name].double())
        error = (controlled[name].double() - before[name].double() - step).abs()
        # what fp32 can resolve: θ + α·Δ is rounded to the weight's precision once (half an ulp of |θ|)
        resolution = before[name].double().abs() * torch.finfo(torch.float32).eps
        assert float(error.norm()) <= 1e-3 * float(step.norm()) + float(resolution.norm()), name
        assert float(step.norm()) > 20 * float(resolution.norm()), name  # a step fp32 resolves: the check has teeth
    assert float(metrics["kl/realized"]) == pytest.approx(float(metrics["kl/predicted"]), rel=0.3)
