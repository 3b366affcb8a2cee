"""PredictedKLBudget: scale every update so that its predicted KL stays within a (scheduled) budget δ."""

from __future__ import annotations

import math
import time
from typing import Literal

import torch
from lightning.pytorch import Callback

from lightning_logra.algo.kl import NextTokens, intended_kl, predicted_kl, realized_kl, step_scale
from lightning_logra.algo.step_size import StepContext, StepSizeController
from lightning_logra.algo.update import Update
from lightning_logra.base.batch import Rollout
from lightning_logra.sketch.rounding import LOW_PRECISION

Schedule = Literal["constant", "linear", "cosine", "exponential"]


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

    Args:
        budget: δ₀, the budget at step 0.
        final_budget: δ₁, reached after `anneal_steps` (required unless the schedule is constant).
        schedule: constant, or linear / cosine / exponential (geometric) interpolation from δ₀ to δ₁.
        anneal_steps: steps from δ₀ to δ₁; δ₁ is kept afterwards.
        alpha_max: the largest scale of a proposal (stops tiny-q proposals from blowing up).
        subset: how many responses D to measure on: a count (int) or a fraction of the global batch (float ≤ 1).
        seed: the subset of step s is drawn from the global batch by a generator seeded with (seed, s), the same
            responses whatever the number of processes.
    """

    def __init__(
        self,
        budget: float = 2e-4,
        final_budget: float | None = None,
        schedule: Schedule = "constant",
        anneal_steps: int | None = None,
        alpha_max: float = 1.0,
        subset: int | float = 8,
        seed: int = 0,
    ) -> None:
        for key, value in (("budget", budget), ("final_budget", final_budget), ("alpha_max", alpha_max)):
            # NaN passes a `<= 0` check and inf turns the control off: both would reach the weights.
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"PredictedKLBudget: {key} must be a positive finite number, got {value}")
        if schedule not in ("constant", "linear", "cosine", "exponential"):
            raise ValueError(f"PredictedKLBudget: schedule must be constant/linear/cosine/exponential, "
                             f"got {schedule!r}")
        if schedule != "constant" and (final_budget is None or not anneal_steps or anneal_steps < 1):
            raise ValueError(f"PredictedKLBudget: schedule={schedule!r} needs final_budget and anneal_steps >= 1")
        if subset <= 0 or (isinstance(subset, float) and subset > 1):
            raise ValueError(f"PredictedKLBudget: subset is a count >= 1 or a fraction in (0, 1], got {subset}")
        self.budget, self.final_budget, self.schedule = budget, final_budget, schedule
        self.anneal_steps, self.alpha_max, self.subset, self.seed = anneal_steps, alpha_max, subset, seed
        self._pending: tuple[Rollout, NextTokens, StepContext] | None = None  # the measured subset, until applied
        self._metrics: dict[str, float] = {}  # this step's, returned once the update is applied
        self._logged: set[str] = set()  # the per-step metrics returned so far (NaN on skipped steps)

    def budget_at(self, step: int) -> float:
        """δ at a step: δ₀ → δ₁ over anneal_steps by the schedule, δ₁ afterwards."""
        if self.schedule == "constant":
            return self.budget
        t = min(step / self.anneal_steps, 1.0)
        d0, d1 = self.budget, self.final_budget
        if self.schedule == "linear":
            return d0 + (d1 - d0) * t
        if self.schedule == "cosine":
            return d1 + (d0 - d1) * 0.5 * (1.0 + math.cos(math.pi * t))
        return d0 * (d1 / d0) ** t  # exponential: a constant ratio per step

    # ---- the module asks for α once the step's update is proposed (lightning_logra.algo.step_size) ---------------

    def _select(self, rollout: Rollout, step: int, rank: int, world_size: int) -> Rollout:
        """This rank's rows of the step's subset D. D is drawn from the global batch (every rank's rows, rank-major,
        as one process holds them), so that 1 and several processes measure q on the same responses; a rank none of
        whose rows were drawn still runs the check's forward passes (a collective under FSDP) on one row whose tokens
        all count zero."""
        n = rollout.completion_ids.shape[0]  # this rank's rows; every rank holds as many
        total = n * world_size
        size = self.subset if isinstance(self.subset, int) else max(1, round(self.subset * total))
        drawn = torch.randperm(total, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + step))[:size]
        mine = drawn[(drawn >= rank * n) & (drawn < (rank + 1) * n)].sort().values - rank * n
        device = rollout.completion_ids.device
        chosen = rollout.select((mine if mine.numel() else torch.zeros(1, dtype=torch.int64)).to(device))
        if not mine.numel():
            chosen.completion_mask = torch.zeros_like(chosen.completion_mask)
        return chosen

    def choose_alpha(self, proposal: Update, rollout: Rollout, context: StepContext) -> float:
        start = time.perf_counter()
        responses = self._select(rollout, context.step, context.rank, context.world_size)
        q, current = predicted_kl(context.policy, proposal, responses, context.temperature)
        # Every rank must take the same α: q over the tokens of every rank's subset before deciding.
        q = _over_ranks(context, q, responses)
        budget = self.budget_at(context.step)
        alpha = step_scale(q, budget, self.alpha_max)
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
        realized = realized_kl(context.policy, responses, before, context.temperature)
        metrics = {**self._metrics, "kl/realized": _over_ranks(context, realized, responses),
                   "kl/realized_s": time.perf_counter() - start}
        metrics["kl/seconds"] = metrics["kl/control_s"] + metrics["kl/realized_s"]  # the whole check's share of a step
        self._logged.update(metrics)
        return metrics


def _over_ranks(context: StepContext, kl: torch.Tensor, responses: Rollout) -> float:
    """A mean KL over the tokens of this rank's responses, made the mean over the tokens of every rank's: since D is
    drawn from the global batch, what one process measures on the same global batch."""
    if context.world_size == 1:
        return float(kl)
    tokens = responses.completion_mask.sum().to(kl.dtype)
    return float(context.sum_over_ranks(kl * tokens) / context.sum_over_ranks(tokens))
