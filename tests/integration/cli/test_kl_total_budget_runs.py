"""PredictedKLBudget's total_budget: the Σ kl/realized of a whole run, spread at each step over the steps left."""

import glob
import logging
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_logra.callbacks import PredictedKLBudget

# ---- a. settings ---------------------------------------------------------------------------------------------------


class Steps(Callback):
    """The policy's parameters as training starts (sketches, LoRA adapters installed) and at its end, and each
    step's metrics."""

    def __init__(self):
        self.steps = []

    @staticmethod
    def _weights(pl_module) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in pl_module.policy.named_parameters()
                if not n.endswith("sketch_param")}  # a sketch's carrier, not a weight

    def on_train_start(self, trainer, pl_module):
        self.start = self._weights(pl_module)

    def on_train_batch_end(self, trainer, pl_module, *_):
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()
                           if k.startswith("kl/") or k in ("train/update_skipped", "train/effective_lr")})

    def on_train_end(self, trainer, pl_module):
        self.end = self._weights(pl_module)


@pytest.mark.parametrize("config", ["tiny_arith", "tiny_arith_bf16", "tiny_arith_dense_all", "tiny_arith_lora"])
def test_a_spent_budget_takes_every_step_at_alpha_0_weights_unchanged(run_cli, config, caplog):
    # α = 0 is a step taken at zero scale, not a skipped one: sketches (fp32, and bf16 with stochastic rounding),
    # dense AdamW and LoRA must all leave every weight exactly where it was, and report a step of nothing.
    cli = run_cli(config, "--trainer.val_check_interval", "1000", steps=2, run=False)
    control = PredictedKLBudget(total_budget=1e-3, alpha_max=8.0, subset=8)
    control.load_state_dict({"spent": 1e-3})  # as a resumed run whose budget was spent before its checkpoint
    record = Steps()
    cli.trainer.callbacks = [cb for cb in cli.trainer.callbacks if not isinstance(cb, PredictedKLBudget)]
    cli.trainer.callbacks += [control, record]
    with caplog.at_level(logging.WARNING, logger="lightning_logra"):
        cli.trainer.fit(cli.model, cli.datamodule)
    assert record.start.keys() == record.end.keys()
    assert all(torch.equal(record.start[n], record.end[n]) for n in record.start)
    assert len(record.steps) == 2
    for step in record.steps:
        assert step["kl/alpha"] == step["kl/budget"] == step["kl/realized"] == step["train/effective_lr"] == 0.0
        assert step["train/update_skipped"] == 0.0 and step["kl/q"] > 0
        assert step["kl/spent"] == pytest.approx(1e-3)
    spent = [r.getMessage() for r in caplog.records if "is spent" in r.getMessage()]
    assert len(spent) == 1 and "2 of trainer.max_steps=2 steps left" in spent[0], spent


def _controller_config(path: Path, **init_args) -> str:
    """A config whose callbacks are a checkpoint after every step and PredictedKLBudget(`init_args`)."""
    path.write_text(yaml.safe_dump({"trainer": {"callbacks": [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"save_last": True, "every_n_train_steps": 1}},
        {"class_path": "lightning_logra.callbacks.PredictedKLBudget", "init_args": init_args}]}}))
    return str(path)


def _scalars(root: Path) -> dict[str, list[float]]:
    (log,) = glob.glob(str(root / "**" / "events.out.tfevents.*"), recursive=True)
    events = EventAccumulator(log)
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_a_run_spends_its_total_budget(run_cli, tmp_path):
    # 20 steps of the tiny model at T = 0.02: about 1e-3 a step, which α ≈ 0.2-0.5 of the sketch Adam's proposals
    # realize, far from α_max = 8: the budget, not α_max, sets every step.
    total, steps = 0.02, 20
    config = _controller_config(tmp_path / "budget.yaml", total_budget=total, alpha_max=8.0, subset=16)
    run_cli("tiny_arith", "--config", config, "--trainer.val_check_interval", "1000", steps=steps,
            root=tmp_path / "run")
    logged = _scalars(tmp_path / "run")
    realized, spent, budget = logged["kl/realized"], logged["kl/spent"], logged["kl/budget"]
    print(f"spent Σ kl/realized = {sum(realized):.5g} of total_budget {total} over {steps} steps "
          f"(kl/acting {sum(logged['kl/acting']):.0f}/{steps}, α {min(logged['kl/alpha']):.3g}-"
          f"{max(logged['kl/alpha']):.3g})")
    assert len(realized) == steps and sum(logged["kl/acting"]) >= 0.9 * steps
    assert sum(realized) == pytest.approx(total, rel=0.10)
    # each step's budget was its share of what the steps before it left (TensorBoard keeps float32)
    assert budget[0] == pytest.approx(total / steps, rel=1e-6)
    for s in range(1, steps):
        assert budget[s] == pytest.approx((total - spent[s - 1]) / (steps - s), rel=1e-5), s
    assert spent[-1] == pytest.approx(sum(realized), rel=1e-5)
    assert logged["kl/total_budget"] == [pytest.approx(total)] * steps


class StopAfter(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, *_):
        trainer.should_stop = trainer.global_step >= self.step


def _fit_recorded(cli, ckpt_path=None) -> list[tuple]:
    """Fits `cli`'s run; returns (step, δ, α, spent after it) of each step at full precision, as the controller
    chose them."""
    (control,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, PredictedKLBudget)]
    record, choose, applied = [], control.choose_alpha, control.applied

    def choose_alpha(proposal, rollout, context):
        alpha = choose(proposal, rollout, context)
        record.append((context.step, control.budget_at(context.step), alpha))
        return alpha

    def applied_and_spent(update):
        metrics = applied(update)
        record[-1] += (control.spent,)
        return metrics

    control.choose_alpha, control.applied = choose_alpha, applied_and_spent
    cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=ckpt_path)
    return record


def test_a_resumed_run_spends_as_the_uninterrupted_one(run_cli, tmp_path):
    # Stopped after step 3 of 6 (not a 3-step run: max_steps is what the budget is spread over), then resumed: with
    # `spent` restored the α of steps 4-6 and the final weights are those of the run that never stopped.
    steps, stop = 6, 3
    config = _controller_config(tmp_path / "budget.yaml", total_budget=6e-3, alpha_max=8.0, subset=16)

    def cli(root):
        return run_cli("tiny_arith", "--config", config, "--trainer.val_check_interval", "1000", steps=steps,
                       root=tmp_path / root, run=False)

    straight = cli("a")
    uninterrupted = _fit_recorded(straight)
    first = cli("b")
    first.trainer.callbacks.insert(0, StopAfter(stop))
    before = _fit_recorded(first)
    (checkpoint,) = glob.glob(str(tmp_path / "b" / "**" / "checkpoints" / "last.ckpt"), recursive=True)
    saved = torch.load(checkpoint, weights_only=False)
    assert saved["global_step"] == stop and saved["callbacks"]["PredictedKLBudget"]["spent"] == before[-1][3]
    resumed = cli("c")
    after = _fit_recorded(resumed, checkpoint)
    assert [s for s, *_ in uninterrupted] == list(range(steps)) and [s for s, *_ in after] == list(range(stop, steps))
    assert before + after == uninterrupted  # δ, α and spent, bit for bit
    assert all(alpha < 8.0 for _, _, alpha, _ in uninterrupted)  # the budget set α: a wrong `spent` would show
    a, b = straight.model.policy.state_dict(), resumed.model.policy.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
