"""Rewards: verifiable ones with TRL's signature, or a class with settings; several, weighted.

- builtin.py         the built-in rewards by name (exact_match, math_answer / MathAnswer)
- reasoning_gym.py   ReasoningGymScore: each task's own scorer on the answer (inside its tags, or after a phrase)
- overlong.py        OverlongPenalty: DAPO's soft over-long penalty as a reward
- reward_model.py    RewardModel: a local sequence classifier as a reward, loaded in the reward's process
- judge.py           LLMJudge: an OpenAI-compatible endpoint by URL (template, verdict pattern, deadline, retries)
- processes.py       each reward in a process of its own with a deadline and an address-space limit; math-verify in a
                     pool of processes with a per-answer timeout
- resolve.py         a config's `model.reward` and `model.scoring.weights` resolved into the rewards the module calls
- scoring.py         the rewards' outputs checked and combined (weights, None as TRL's), per-reward metrics
"""

from lightning_logra.rewards.builtin import (
    BUILTIN,
    DEFAULT_TIMEOUT_S,
    DEFAULT_WORKERS,
    Completion,
    MathAnswer,
    RewardFn,
    RewardName,
    builtin_reward,
    completion_text,
    exact_match,
    extract_final_answer,
    math_answer,
)
from lightning_logra.rewards.judge import LLMJudge
from lightning_logra.rewards.overlong import OverlongPenalty
from lightning_logra.rewards.processes import DEFAULT_MEMORY_GIB, CheckPool, RewardProcess, TimedReward
from lightning_logra.rewards.reasoning_gym import ReasoningGymScore, extract_stated_answer, extract_tagged_answer
from lightning_logra.rewards.resolve import (
    Reward,
    get_reward,
    import_reward,
    resolve_reward,
    resolve_rewards,
    reward_setting,
)
from lightning_logra.rewards.reward_model import RewardModel

__all__ = ["BUILTIN", "DEFAULT_MEMORY_GIB", "DEFAULT_TIMEOUT_S", "DEFAULT_WORKERS", "CheckPool", "Completion",
           "LLMJudge", "MathAnswer", "OverlongPenalty", "ReasoningGymScore", "Reward", "RewardFn", "RewardModel",
           "RewardName", "RewardProcess", "TimedReward", "builtin_reward", "completion_text", "exact_match",
           "extract_final_answer", "extract_stated_answer", "extract_tagged_answer", "get_reward", "import_reward",
           "math_answer", "resolve_reward", "resolve_rewards", "reward_setting"]
