"""Multi-turn episodes: the model's turns and an environment's answers (tools, observations), carried as token ids
and trained on the sampled tokens alone (docs/multi-turn.md). Over any engine; imports only base/.

- runner.py        EpisodeRunner: a generate call a turn, token in and token out, the sampled mask
- template.py      the chat template's ids between turns; prefix-preserving templates only
- calls.py         Hermes tool calls read from a turn
- environment.py   the TRL-style contract: tools, environment classes, GymAdapter
- processes.py     EnvironmentPool: environments in processes of their own, deadlines, address-space limits
- settings.py      the module's episode settings, and the run's runner
- metrics.py       episodes/* and the environment's rewards
- calculator.py    a bounded arithmetic tool for real models
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_logra.episodes.environment import GymAdapter
    from lightning_logra.episodes.runner import EpisodeRunner

__all__ = ["EpisodeRunner", "GymAdapter"]
_HOMES = {"EpisodeRunner": "lightning_logra.episodes.runner", "GymAdapter": "lightning_logra.episodes.environment"}


def __getattr__(name: str):
    # Imported when first asked for: an environment's process imports episodes.processes, and with it this package,
    # without the runner's torch and transformers (a worker's start took 5 s more with them, each replacement too).
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
