"""Toggleable pieces of a run; each owns only its own schedule and state, and the run works without it."""

from lightning_logra.callbacks.kl_budget import PredictedKLBudget
from lightning_logra.callbacks.kl_from_start import KLFromStart
from lightning_logra.callbacks.memory import MemoryProfiler
from lightning_logra.callbacks.progress import StepProgressBar
from lightning_logra.callbacks.run_directory import RunDirectory
from lightning_logra.callbacks.signals import SaveOnSignal
from lightning_logra.callbacks.summary import SketchModelSummary
from lightning_logra.callbacks.weight_sync import RolloutWeightSync

__all__ = ["KLFromStart", "MemoryProfiler", "PredictedKLBudget", "RolloutWeightSync", "RunDirectory", "SaveOnSignal",
           "SketchModelSummary", "StepProgressBar"]
