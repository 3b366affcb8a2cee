"""PredictedKLBudget's total_budget: the Σ kl/realized of a whole run, spread at each step over the steps left."""

import glob
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from lightning.pytorch import Callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import SKETCH_TARGETS, make_tiny_qwen2
from lightning_logra.algo.kl import step_scale
from lightning_logra.algo.step_size import StepContext
from lightning_logra.algo.update import Update
from lightning_logra.base.batch import Rollout
from lightning_logra.callbacks import PredictedKLBudget
from lightning_logra.callbacks.kl_budget import spread_budget
from lightning_logra.sketch import install_sketches
from lightning_logra.sketch.update import LowRankDelta

# ---- a. settings ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [0.0, -1e-3, math.nan, math.inf])
def test_total_budget_must_be_a_positive_finite_number(value):
    with pytest.raises(ValueError, match="PredictedKLBudget: total_budget must be a positive finite number"):
        PredictedKLBudget(total_budget=value)


@pytest.mark.parametrize("kwargs, named", [
    ({"budget": 2e-4}, r"budget=0.0002 .*total_budget=0.01 .*keep one of them"),
    ({"final_budget": 1e-5}, r"final_budget=1e-05 would schedule another: remove it"),
    ({"anneal_steps": 10}, r"anneal_steps=10 would schedule another: remove it"),
    ({"schedule": "cosine"}, r"schedule='cosine' would schedule another"),
    # what the per-step schedule would say ("needs final_budget") is not the fix here
    ({"schedule": "linear", "final_budget": 1e-5, "anneal_steps": 10},
     r"final_budget=1e-05, anneal_steps=10, schedule='linear' would schedule another: remove them"),
])
def test_total_budget_refuses_a_per_step_budget_or_schedule_beside_it(kwargs, named):
    with pytest.raises(ValueError, match=f"PredictedKLBudget: .*{named}"):
        PredictedKLBudget(total_budget=1e-2, **kwargs)


@pytest.mark.parametrize("max_steps", [-1, 0, None])
def test_total_budget_needs_trainer_max_steps(max_steps):
    control = PredictedKLBudget(total_budget=1e-2)
    with pytest.raises(ValueError, match=rf"total_budget is spread over trainer.max_steps, which is {max_steps}: "
                                         r"set trainer.max_steps"):
        control.on_fit_start(SimpleNamespace(max_steps=max_steps), None)
    with pytest.raises(RuntimeError, match="on_fit_start"):  # never a budget from a guessed run length
        control.budget_at(0)
    PredictedKLBudget(budget=1e-3).on_fit_start(SimpleNamespace(max_steps=max_steps), None)  # a per-step δ: no need


def test_the_per_step_budget_keeps_its_default():
    assert PredictedKLBudget().budget_at(0) == PredictedKLBudget().budget_at(500) == 2e-4
    assert PredictedKLBudget(total_budget=1e-2).budget is None


# ---- b. the schedule's arithmetic ----------------------------------------------------------------------------------

def test_what_is_left_is_spread_over_the_steps_left():
    assert spread_budget(1.0, 0.25, 3) == 0.25
    assert spread_budget(0.5, 0.0, 1) == 0.5  # the last step may spend all that is left
    assert spread_budget(0.5, 0.5, 4) == 0.0  # nothing left
    assert spread_budget(0.5, 0.75, 4) == 0.0  # overspent: never a negative budget
    assert spread_budget(0.5, math.nan, 4) == 0.0  # an unmeasurable step: spend nothing more
    with pytest.raises(ValueError, match="steps_left=0"):
        spread_budget(0.5, 0.1, 0)


def test_overspending_steps_are_paid_back_by_the_later_ones():
    # Steps that each realize 1.3× their budget (as the tiny runs' realize a few % more than predicted): charged what
    # they realized, the run spends T and only the last step's excess; a fixed δ = T/N would spend 1.3·T.
    total, steps, spent, last = 1e-2, 30, 0.0, 0.0
    for s in range(steps):
        last = 1.3 * spread_budget(total, spent, steps - s)
        spent += last
    assert spent == pytest.approx(total + 0.3 / 1.3 * last, rel=1e-12)
    assert spent == pytest.approx(total, rel=0.02)


def _responses(n=8, prompt=5, completion=6):
    g = torch.Generator().manual_seed(0)
    ones = torch.ones(n, completion, dtype=torch.long)
    return Rollout(torch.randint(0, 97, (n, prompt), generator=g), torch.ones(n, prompt, dtype=torch.long),
                   torch.randint(0, 97, (n, completion), generator=g), ones, torch.zeros(n, completion))


def test_the_controller_takes_its_share_of_what_is_left_and_alpha_0_once_it_is_spent():
    model = make_tiny_qwen2(dtype=torch.float64)
    handles = install_sketches(model, SKETCH_TARGETS, rank=4)
    g = torch.Generator().manual_seed(1)
    proposal = Update({f"{name}.weight": LowRankDelta(5e-3 * torch.randn(h.out_features, h.rank, generator=g,
                                                                          dtype=torch.float64),
                                                      h.seed, h.distribution, h.in_features)
                       for name, h in handles.items()})
    responses = _responses()
    control = PredictedKLBudget(total_budget=1e-3, alpha_max=8.0, subset=8)
    control.on_fit_start(SimpleNamespace(max_steps=10), None)

    def step(s):
        return control.choose_alpha(proposal, responses, StepContext(model, 1.0, s, 0, 1, lambda t: t))

    control.load_state_dict({"spent": 4e-4})  # what a checkpoint after step 3 holds
    alpha = step(4)
    # the weights unchanged: the realized KL is 0 and nothing more is spent
    metrics = control.applied(proposal)
    assert metrics["kl/budget"] == (1e-3 - 4e-4) / 6
    assert alpha == metrics["kl/alpha"] == step_scale(metrics["kl/q"], (1e-3 - 4e-4) / 6, 8.0) < 8.0  # it binds
    assert metrics["kl/realized"] == 0.0 and metrics["kl/spent"] == control.spent == 4e-4

    # a step applied at α is charged the KL it realized, which the next step's share accounts for
    alpha = step(5)
    before = control.spent
    with torch.no_grad():
        for name, delta in proposal.low_rank.items():
            model.get_parameter(name).sub_(alpha * delta.factor @ delta.projection().to(delta.factor))
    metrics = control.applied(proposal)
    assert metrics["kl/realized"] > 0 and control.spent == metrics["kl/spent"] == before + metrics["kl/realized"]
    assert control.budget_at(6) == (1e-3 - control.spent) / 4

    # a skipped update spends nothing
    step(6)
    assert all(math.isnan(v) for v in control.applied(None).values())
    assert control.spent == metrics["kl/spent"]

    control.load_state_dict({"spent": 1e-3})  # all of it spent
    assert step(7) == 0.0
    metrics = control.applied(proposal)
    assert (metrics["kl/alpha"], metrics["kl/budget"], metrics["kl/predicted"], metrics["kl/acting"]) == (0, 0, 0, 1)
    assert metrics["kl/q"] > 0  # the proposal was measured and declined, not lost


# ---- α = 0 in every training mode ----------------------------------------------------------------------------------

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


@pytest.mark.integration
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


# ---- c. a run spends what it was given -----------------------------------------------------------------------------

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


@pytest.mark.integration
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


# ---- d. a resumed run chooses the α the uninterrupted one would have -----------------------------------------------

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


@pytest.mark.integration
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
