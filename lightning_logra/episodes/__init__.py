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

from lightning_logra.episodes.environment import GymAdapter
from lightning_logra.episodes.runner import EpisodeRunner

__all__ = ["EpisodeRunner", "GymAdapter"]
