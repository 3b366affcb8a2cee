"""PredictedKLBudget: scale every update so that its predicted KL stays within a (scheduled) budget δ, or within its
share of a total KL budget for the whole run."""

from __future__ import annotations

import logging
import math
import time
from typing import Literal

import torch
from lightning.pytorch import Callback

from lightning_logra.algo.kl import (
    NextTokens,
    StateRecorder,
    intended_kl,
    predicted_kl,
    realized_kl,
    recording,
    step_scale,
)
from lightning_logra.algo.step_size import StepContext, StepSizeController
from lightning_logra.algo.update import Update
from lightning_logra.base.batch import Rollout
from lightning_logra.base.settings import check_positive
from lightning_logra.sketch.rounding import LOW_PRECISION

Schedule = Literal["constant", "linear", "cosine", "exponential"]

log = logging.getLogger(__name__)

DEFAULT_BUDGET = 2e-4  # δ when neither budget nor total_budget is set


def spread_budget(total: float, spent: float, steps_left: int) -> float:
    """δ_s of a total budget: what is left of `total` after `spent`, spread evenly over `steps_left` steps (this one
    included); 0 once nothing is left. A step that spent more than its share leaves less for every later one."""
    if steps_left < 1:
        raise ValueError(f"spread_budget: no step is left to spend on (steps_left={steps_left})")
    left = total - spent
    # `left > 0`, not `left <= 0` for the other branch: a NaN spent (a step whose KL could not be measured) spends
    # nothing more, where NaN would otherwise reach step_scale.
    return left / steps_left if left > 0 else 0.0


class PredictedKLBudget(Callback, StepSizeController):
    """Before each update, measure q = KL(π_θ ‖ π_{θ+Δ}) of the proposal on a few responses and take the step
    α = min(α_max, √(δ/q)); after it, log the realized KL on the same responses beside the prediction.

    Δ is the whole update: the sketched matrices' low-rank steps and, when parameters are trained densely
    (`sketch.train_rest` / `train_bias`, or a dense run without sketches), their optimizer's step, held back by the
    module until α is chosen (one extra copy of those parameters meanwhile). α scales all of it.

    The budget governs the KL of the intended update, α·Δ. With bf16/fp16 weights the merge rounds stochastically,
    and the realized KL (`kl/realized`) also holds that rounding noise; `kl/intended` is then logged beside it: the
    exact KL of α·Δ without any rounding (one more forward pass of the subset). `kl/acting` is 1 on steps where the
    budget bound the step (α < α_max), 0 where α_max did: a run whose control never acts is not controlled.
    `kl/spent` is Σ `kl/realized` over the updates applied so far (saved in checkpoints: a resume continues it).

    A total budget (`total_budget` T) replaces the per-step δ: a user knows how far from the start they are willing
    to move over the run more readily than what per-token KL one step may spend. At step s (0 first), with
    spent = Σ `kl/realized` of the updates applied before it and max_steps the Trainer's,

        δ_s = (T − spent) / (max_steps − s)

    what is left, spread evenly over the steps left. Each step is charged what it realized, not what was predicted,
    so a step that overspent (the KL is not exactly quadratic in α) is paid back by smaller later ones, and one that
    underspent (α capped by α_max) leaves more for them; with bf16 weights the rounding noise in `kl/realized` is
    charged too. Once nothing is left the remaining steps are taken at α = 0. T counts the sum of the per-step KLs,
    not the KL from the start policy: steps that point the same way compound (k equal steps of KL δ move about k²·δ
    from the start, not k·δ), and steps that undo each other count both ways. A run ended before max_steps
    (max_epochs, max_time, a stop) leaves the rest unspent.

    Args:
        budget: δ₀, the budget at step 0 (default 2e-4 unless total_budget is set; not with total_budget).
        final_budget: δ₁, reached after `anneal_steps` (required unless the schedule is constant).
        schedule: constant, or linear / cosine / exponential (geometric) interpolation from δ₀ to δ₁.
        anneal_steps: steps from δ₀ to δ₁; δ₁ is kept afterwards.
        alpha_max: the largest scale of a proposal (stops tiny-q proposals from blowing up).
        subset: how many responses D to measure on: a count (int) or a fraction of the global batch (float ≤ 1).
        seed: the subset of step s is drawn from the global batch by a generator seeded with (seed, s), the same
            responses whatever the number of processes.
        total_budget: T, the Σ `kl/realized` to spend over the run's trainer.max_steps steps, instead of a per-step
            budget (no final_budget / schedule / anneal_steps with it).
    """

    def __init__(
        self,
        budget: float | None = None,
        final_budget: float | None = None,
        schedule: Schedule = "constant",
        anneal_steps: int | None = None,
        alpha_max: float = 1.0,
        subset: int | float = 8,
        seed: int = 0,
        total_budget: float | None = None,
    ) -> None:
        for key, value in (("budget", budget), ("final_budget", final_budget), ("alpha_max", alpha_max),
                           ("total_budget", total_budget)):
            # NaN passes a `<= 0` check and inf turns the control off: both would reach the weights.
            check_positive(f"PredictedKLBudget: {key}", value, "finite number", null="unset")
        if schedule not in ("constant", "linear", "cosine", "exponential"):
            raise ValueError(f"PredictedKLBudget: schedule must be constant/linear/cosine/exponential, "
                             f"got {schedule!r}")
        if total_budget is not None:
            if budget is not None:
                raise ValueError(f"PredictedKLBudget: budget={budget} (δ per step) and total_budget={total_budget} "
                                 f"(the KL of the whole run) were both set; keep one of them")
            # Checked before the schedule's own needs: "schedule='linear' needs final_budget" would send the user
            # the wrong way.
            scheduled = [f"{key}={value!r}" for key, value in (("final_budget", final_budget),
                                                               ("anneal_steps", anneal_steps)) if value is not None]
            scheduled += [f"schedule={schedule!r}"] if schedule != "constant" else []
            if scheduled:
                raise ValueError(f"PredictedKLBudget: total_budget sets each step's budget itself (what is left, "
                                 f"spread over the steps left); {', '.join(scheduled)} would schedule another: "
                                 f"remove {'them' if len(scheduled) > 1 else 'it'}, or set budget instead of "
                                 f"total_budget")
        elif budget is None:
            budget = DEFAULT_BUDGET
        if schedule != "constant" and (final_budget is None or not anneal_steps or anneal_steps < 1):
            raise ValueError(f"PredictedKLBudget: schedule={schedule!r} needs final_budget and anneal_steps >= 1")
        if subset <= 0 or (isinstance(subset, float) and subset > 1):
            raise ValueError(f"PredictedKLBudget: subset is a count >= 1 or a fraction in (0, 1], got {subset}")
        self.budget, self.final_budget, self.schedule = budget, final_budget, schedule
        self.anneal_steps, self.alpha_max, self.subset, self.seed = anneal_steps, alpha_max, subset, seed
        self.total_budget = total_budget
        self.max_steps: int | None = None  # trainer.max_steps, read when fitting starts (total_budget only)
        self.spent = 0.0  # Σ kl/realized of the updates applied so far: checkpointed (state_dict)
        self._restored = False  # whether `spent` came from a checkpoint
        self._warned_spent = False
        self._pending: tuple[Rollout, NextTokens, StepContext] | None = None  # the measured subset, until applied
        self._metrics: dict[str, float] = {}  # this step's, returned once the update is applied
        self._logged: set[str] = set()  # the per-step metrics returned so far (NaN on skipped steps)

    def budget_at(self, step: int) -> float:
        """δ at a step: δ₀ → δ₁ over anneal_steps by the schedule, δ₁ afterwards; with a total budget, what is left
        of it spread over the steps left (`spread_budget`), which depends on what the steps before spent."""
        if self.total_budget is not None:
            if self.max_steps is None:
                raise RuntimeError("PredictedKLBudget: total_budget is spread over trainer.max_steps, which is read "
                                   "when fitting starts (on_fit_start); it was not called")
            return spread_budget(self.total_budget, self.spent, self.max_steps - step)
        if self.schedule == "constant":
            return self.budget
        t = min(step / self.anneal_steps, 1.0)
        d0, d1 = self.budget, self.final_budget
        if self.schedule == "linear":
            return d0 + (d1 - d0) * t
        if self.schedule == "cosine":
            return d1 + (d0 - d1) * 0.5 * (1.0 + math.cos(math.pi * t))
        return d0 * (d1 / d0) ** t  # exponential: a constant ratio per step

    # ---- Lightning's hooks and the checkpointed state ------------------------------------------------------------

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.total_budget is None:
            return
        max_steps = trainer.max_steps
        # Lightning's -1 means no limit: there would be no "steps left" to spread the budget over.
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"PredictedKLBudget: total_budget is spread over trainer.max_steps, which is "
                             f"{max_steps}: set trainer.max_steps to the run's length in steps (a positive number)")
        self.max_steps = max_steps

    def on_train_start(self, trainer, pl_module) -> None:
        # A resume from a checkpoint without this callback's state (a run without it): what was spent is unknown.
        if self.total_budget is not None and trainer.global_step > 0 and not self._restored:
            log.warning("PredictedKLBudget: resuming at step %d from a checkpoint without this callback's state: "
                        "total_budget=%g counts only the KL spent from this step on", trainer.global_step,
                        self.total_budget)

    def state_dict(self) -> dict:
        # `logged` too: a resumed run's first skipped step logs NaN for the same metrics the uninterrupted run would.
        return {"spent": self.spent, "logged": sorted(self._logged)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.spent = float(state_dict["spent"])
        self._logged = set(state_dict.get("logged", ()))
        self._restored = True

    # ---- the module asks for α once the step's update is proposed (lightning_logra.algo.step_size) ---------------

    def recorder(self, rollout: Rollout, context: StepContext) -> StateRecorder | None:
        # The current policy's pass comes from the update's (fp32 weights and a plain head; `StateRecorder`).
        return StateRecorder(self._drawn(rollout, context)) if recording(context.policy) else None

    def _select(self, rollout: Rollout, context: StepContext) -> Rollout:
        """This rank's rows of the step's subset D (`_drawn`); a rank none of whose rows were drawn still runs the
        check's forward passes (a collective under FSDP) on one row whose tokens all count zero."""
        mine = self._drawn(rollout, context)
        chosen = rollout.select(mine if mine.numel() else torch.zeros(1, dtype=torch.int64, device=mine.device))
        return chosen if mine.numel() else chosen.emptied()

    def _drawn(self, rollout: Rollout, context: StepContext) -> torch.Tensor:
        """(m,) this rank's rows of the step's subset D, ascending. D is drawn from the global batch as one process
        holds it (every rank's rows rank-major, or where `context.positions` places them), so that 1 and several
        processes measure q on the same responses."""
        device = rollout.completion_ids.device
        positions = context.positions
        n = rollout.completion_ids.shape[0] if positions is None else positions.numel()  # this rank's rows
        counts = torch.zeros(context.world_size, dtype=torch.float64, device=device)
        counts[context.rank] = n
        if context.world_size > 1:
            counts = context.sum_over_ranks(counts)
        if positions is None:
            positions = int(counts[: context.rank].sum()) + torch.arange(n)
        total = int(counts.sum())
        size = self.subset if isinstance(self.subset, int) else max(1, round(self.subset * total))
        drawn = torch.randperm(total, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + context.step))
        return torch.isin(positions.cpu(), drawn[:size]).nonzero().squeeze(-1).to(device)  # in one process's order

    def choose_alpha(self, proposal: Update, rollout: Rollout, context: StepContext) -> float:
        start = time.perf_counter()
        recorded = context.recorded
        responses = self._select(rollout, context)
        current = None if recorded is None else recorded.current(context.policy, responses)
        q, current = predicted_kl(context.policy, proposal, responses, context.temperature, current)
        # Every rank must take the same α: q over the tokens of every rank's subset before deciding.
        q = _over_ranks(context, q, responses)
        budget = self.budget_at(context.step)
        if budget > 0:
            alpha = step_scale(q, budget, self.alpha_max)
        else:
            # The total budget is spent: α = 0, a step taken at zero scale rather than a skipped one. Every training
            # mode takes it as any α ≥ 0 and no weight moves, bit for bit (a sketch merge subtracts 0·A, a bf16 one
            # then rounds a value it already holds; AdamW and LoRA steps are θ + 0·(θ' − θ)). The rest is what a
            # taken step does: the optimizer state took the gradient when the step was proposed (a skipped step's
            # does too), the learning-rate schedule advances, and `train/update_skipped` stays 0: it keeps meaning
            # a fault (a non-finite gradient or step), not a budget doing its job. The step logs α = 0, its q and
            # a realized KL of 0.
            alpha = 0.0
            if not self._warned_spent:
                self._warned_spent = True
                log.warning("PredictedKLBudget: total_budget=%g is spent (Σ kl/realized = %g) with %d of "
                            "trainer.max_steps=%d steps left: they are taken at α = 0, the weights unchanged",
                            self.total_budget, self.spent, self.max_steps - context.step, self.max_steps)
        self._pending = (responses, current, context)
        metrics = {"kl/q": q, "kl/alpha": alpha, "kl/budget": budget, "kl/predicted": alpha**2 * q,
                   "kl/acting": float(alpha < self.alpha_max)}
        if any(p.dtype in LOW_PRECISION for p in context.policy.parameters()):
            intended = intended_kl(context.policy, proposal, responses, current, alpha, context.temperature)
            metrics["kl/intended"] = _over_ranks(context, intended, responses)
        self._metrics = {**metrics, "kl/control_s": time.perf_counter() - start}
        return alpha

    def applied(self, update: Update | None) -> dict[str, float]:
        # Every metric at every step: a step whose update was skipped (or that asked for no α) logs NaN, not the last
        # step's values (which Lightning would repeat).
        pending, self._pending = self._pending, None
        if pending is None or update is None:
            return {key: math.nan for key in sorted(self._logged)}
        start = time.perf_counter()
        responses, before, context = pending
        realized = _over_ranks(context, realized_kl(context.policy, responses, before, context.temperature),
                               responses)
        # The same on every rank (a mean over every rank's tokens): so is every rank's `spent`, and δ of the next step.
        self.spent += realized
        metrics = {**self._metrics, "kl/realized": realized, "kl/spent": self.spent,
                   "kl/realized_s": time.perf_counter() - start}
        if self.total_budget is not None:
            metrics["kl/total_budget"] = self.total_budget
        metrics["kl/seconds"] = metrics["kl/control_s"] + metrics["kl/realized_s"]  # the whole check's share of a step
        self._logged.update(metrics)
        return metrics


def _over_ranks(context: StepContext, kl: torch.Tensor, responses: Rollout) -> float:
    """A mean KL over the tokens of this rank's responses, made the mean over the tokens of every rank's: since D is
    drawn from the global batch, what one process measures on the same global batch."""
    if context.world_size == 1:
        return float(kl)
    tokens = responses.loss_mask.sum().to(kl.dtype)
    return float(context.sum_over_ranks(kl * tokens) / context.sum_over_ranks(tokens))
