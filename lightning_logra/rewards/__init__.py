"""Rewards: the built-in verifiable ones (`builtin`), reasoning-gym's scorers (`reasoning_gym`), DAPO's over-long
penalty (`overlong`), a sequence classifier (`reward_model`) and an LLM judge by URL (`judge`) as rewards, the
processes every reward runs in (`processes`), a config's ``model.reward`` resolved (`resolve`), and their outputs
checked and combined (`scoring`)."""

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
