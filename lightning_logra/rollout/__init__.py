"""Rollout engines: who generates the completions the policy is trained on, and how their weights follow."""

from lightning_logra.base.batch import Rollout
from lightning_logra.rollout.engine import RolloutEngine, SamplingParams
from lightning_logra.rollout.hf import HFEngine
from lightning_logra.rollout.remote import RemoteEngine
from lightning_logra.rollout.sync import WeightSync, find_sync, fingerprint
from lightning_logra.rollout.vllm import VLLMEngine

__all__ = ["HFEngine", "RemoteEngine", "Rollout", "RolloutEngine", "SamplingParams", "VLLMEngine", "WeightSync",
           "find_sync", "fingerprint"]
