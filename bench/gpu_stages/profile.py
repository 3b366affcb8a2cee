"""profile: one step per method under torch.profiler at the first shape: the ops that took the most device time, and
the time inside the sketch's own ranges (projections x·Aᵀ, contractions δᵀz)."""

from __future__ import annotations

from bench.gpu_stages.plan import Plan, Progress
from bench.gpu_stages.rows import measure_rows


def profile(plan: Plan, progress: Progress) -> dict:
    """Where a step's time goes (bench.memory --profile): per method, the ops that took the most device time, and
    the sketch's own ranges (projections x·Aᵀ, contractions δᵀz), one profiled step after the timed ones."""
    shape = next(iter(plan.memory))
    return measure_rows(plan, progress, {shape: plan.profile_methods}, ["--profile", "--steps", "2"])
