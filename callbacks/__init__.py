"""Toggleable pieces of a run; each owns only its own schedule and state, and the run works without it."""

from callbacks.kl_budget import PredictedKLBudget
from callbacks.memory import MemoryProfiler
from callbacks.weight_sync import RolloutWeightSync

__all__ = ["MemoryProfiler", "PredictedKLBudget", "RolloutWeightSync"]
