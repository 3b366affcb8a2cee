"""Toggleable pieces of a run; each owns only its own schedule and state, and the run works without it. This folder
installs as `lightning_logra.callbacks` (a top-level `callbacks` package would collide on PyPI).

- export.py          PolicyExport: transformers folders of the policy at the end of fit and every N steps
- kl_budget.py       PredictedKLBudget: the predicted-KL step control, a δ schedule or a total for the run (a
                     StepSizeController)
- kl_from_start.py   KLFromStart: KL(π_t ‖ π_0), measured at every validation
- memory.py          MemoryProfiler: the average and peak memory of every step, and the footprint by category
- weight_sync.py     RolloutWeightSync: a rollout engine's own weights kept equal to the trainer's (a WeightSync)
- progress.py        StepProgressBar: a progress bar that counts optimizer steps (`step 120/600`)
- summary.py         SketchModelSummary: the model summary at the start of fit, counting what a sketched run trains
- run_directory.py   RunDirectory: runs/<name>/latest, the newest run's checkpoints; no folder left by a failed run
- signals.py         SaveOnSignal: SIGTERM / SIGUSR1 save a checkpoint at the next step, then exit 143 / 138
"""

from lightning_logra.callbacks.export import PolicyExport
from lightning_logra.callbacks.kl_budget import PredictedKLBudget
from lightning_logra.callbacks.kl_from_start import KLFromStart
from lightning_logra.callbacks.memory import MemoryProfiler
from lightning_logra.callbacks.progress import StepProgressBar
from lightning_logra.callbacks.run_directory import RunDirectory
from lightning_logra.callbacks.signals import SaveOnSignal
from lightning_logra.callbacks.summary import SketchModelSummary
from lightning_logra.callbacks.weight_sync import RolloutWeightSync

__all__ = ["KLFromStart", "MemoryProfiler", "PolicyExport", "PredictedKLBudget", "RolloutWeightSync", "RunDirectory",
           "SaveOnSignal", "SketchModelSummary", "StepProgressBar"]
