"""Multi-turn episodes: the model's turns and an environment's answers (tools, observations), carried as token ids
and trained on the sampled tokens alone (docs/multi-turn.md)."""

from lightning_logra.episodes.environment import GymAdapter
from lightning_logra.episodes.runner import EpisodeRunner

__all__ = ["EpisodeRunner", "GymAdapter"]
