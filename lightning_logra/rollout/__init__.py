"""Rollout engines: who generates the completions the policy is trained on."""

from lightning_logra.rollout.engine import Rollout, RolloutEngine, SamplingParams, prompt_seeds
from lightning_logra.rollout.hf import HFEngine

__all__ = ["HFEngine", "Rollout", "RolloutEngine", "SamplingParams", "prompt_seeds"]
