"""PredictedKLBudget's total_budget: the Σ kl/realized of a whole run, spread at each step over the steps left."""

import math
from types import SimpleNamespace

import pytest
import torch

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
