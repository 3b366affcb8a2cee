"""The module's settings, grouped by concern: `model.sampling`, `model.loss`, `model.training`, `model.scoring`,
`model.evaluation`, `model.rollouts`, `model.export` (and `model.episodes`, `lightning_logra.episodes.settings`).

Each group is a dataclass that checks itself when it is built (before any weights load), each refusal naming its
key (`model.loss.beta`) and the fix, and documents its fields (`--help` and `--print_config` show them). How the
weights train, and the optimizer's settings, are the strategy's (`trainer.strategy.init_args.sketch` / `lora` /
`dense`). `MOVED` maps each key of the flat settings before these groups to where it lives now, for the command
line's error on an old config.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from lightning_logra.algo.advantages import ScaleRewards, estimator
from lightning_logra.algo.losses import CorrectionMode, LossType, check_correction, get_loss
from lightning_logra.base.child import DEFAULT_MEMORY_GIB, check_memory_gib
from lightning_logra.base.settings import check_at_least, check_positive, is_number, yaml_as_mappings
from lightning_logra.rollout import RolloutEngine

MIN_TEMPERATURE = 0.01  # model.sampling.temperature and a positive model.evaluation.temperature


@dataclass
class SamplingSettings:
    """How the training rollouts are sampled.

    Args:
        num_generations: completions sampled per prompt (the group size G).
        temperature: the sampling temperature of the rollouts; the loss's log-probs are taken at it too.
        top_p: nucleus sampling of the rollouts: sample from the smallest set of tokens with this much probability
            (1 samples from all).
        max_new_tokens: the longest completion sampled in training.
        seed: seeds the sampling: each prompt's completions are a function of (seed, step, prompt index).
    """

    num_generations: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        check_positive("model.sampling.num_generations", self.num_generations, integer=True)
        if self.num_generations < 2:
            raise ValueError("model.sampling.num_generations must be at least 2: advantages compare samples of one "
                             "prompt")
        check_positive("model.sampling.max_new_tokens", self.max_new_tokens, integer=True)
        # Sampling and every log-prob divide the logits by it: at 1e-40 the quotients overflowed (garbage samples, NaN
        # kl/predicted). Below 0.01 sampling is greedy decoding in all but name.
        check_at_least("model.sampling.temperature", self.temperature, MIN_TEMPERATURE, "finite number",
                       why="sampling divides the logits by it (for greedy evaluation set "
                           "model.evaluation.temperature: 0)")
        if not (is_number(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"model.sampling.top_p must be in (0, 1], got {self.top_p}")


@dataclass
class LossSettings:
    """The policy-gradient objective.

    Args:
        type: the policy-gradient loss, one of `lightning_logra.algo.losses.LOSSES`: `dapo` (token-level mean over
            the batch), `grpo` (mean per sequence, then over sequences), `dr_grpo` (sum over tokens / (sequences ×
            max_new_tokens)), `gspo` (a clipped sequence-level ratio to the sampler, grpo's mean) or `cispo` (capped
            token ratios to the sampler, dapo's mean).
        scale_rewards: what each group's mean-centered rewards are divided by (TRL's `scale_rewards`, one of
            `lightning_logra.algo.advantages.ADVANTAGES`): `group` (true: the group's reward standard deviation,
            GRPO), `batch` (the whole batch's), or `none` (false: nothing, Dr. GRPO).
        epsilon: gspo's clip range, [1 − epsilon, 1 + epsilon_high] around its sequence ratio (TRL's `epsilon`; the
            GSPO paper's is 3e-4 with epsilon_high 4e-4).
        epsilon_high: the upper end of gspo's clip range (None: epsilon); for cispo the cap on its token ratio
            itself, as in TRL (None: 5.0).
        beta: the weight β of a KL penalty to the starting policy (TRL's `beta`): each completion token's loss gains
            β·kl_t, the k3 estimate between the policy's log-prob and a frozen reference's (`losses.reference_kl`),
            weighted per token as `type` weighs the policy-gradient term; `train/kl` logs its mean per token. 0 (the
            default) turns it off and loads nothing; above 0 a fit keeps a frozen copy of the starting weights on
            every process (refused under `SketchFSDPStrategy`), and every sample goes through the backward passes.
        entropy_coef: the weight of an entropy bonus (verl's `entropy_coeff`): the loss subtracts entropy_coef × the
            policy's token entropy, weighed per token as the policy-gradient term. 0: off.
        mask_truncated_completions: completions cut at max_new_tokens (no stop token) count for nothing in the loss
            (TRL's `mask_truncated_completions`); they still take part in their group's advantages.
    """

    type: LossType = "dapo"
    scale_rewards: ScaleRewards = True
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    entropy_coef: float = 0.0
    mask_truncated_completions: bool = False

    def __post_init__(self) -> None:
        get_loss(self.type)  # one of the registered losses
        estimator(self.scale_rewards)  # one of the registered advantage estimators, or true / false
        check_positive("model.loss.epsilon", self.epsilon)
        check_positive("model.loss.epsilon_high", self.epsilon_high, null="the loss's own default")
        check_at_least("model.loss.beta", self.beta, 0, "finite number",
                       why="set 0 for no KL penalty, or a small weight such as 0.04")
        check_at_least("model.loss.entropy_coef", self.entropy_coef, 0, "finite number",
                       why="0 turns the entropy bonus off; verl's examples use about 0.001")


@dataclass
class TrainingSettings:
    """How each step's backward passes run.

    Args:
        micro_batch_size: completions per forward/backward pass; their gradients accumulate into one update.
        logprob_chunk_tokens: completion log-probs are computed this many tokens at a time, so that the micro-batch's
            full-vocabulary logits never exist at once (forward and backward); None builds them as one (m, C, V)
            tensor.
        gradient_checkpointing: recompute activations in the backward pass instead of keeping them (less memory,
            more compute).
        max_grad_norm: clip the norm of all gradients (sketches included: E‖G·Aᵀ‖² = ‖G‖²) before each update; None
            does not clip.
    """

    micro_batch_size: int = 8
    logprob_chunk_tokens: int | None = 256
    gradient_checkpointing: bool = False
    max_grad_norm: float | None = 1.0

    def __post_init__(self) -> None:
        check_positive("model.training.micro_batch_size", self.micro_batch_size, integer=True)
        check_positive("model.training.logprob_chunk_tokens", self.logprob_chunk_tokens, integer=True,
                       null="the whole completion at once")
        check_positive("model.training.max_grad_norm", self.max_grad_norm, null="no clipping")


@dataclass
class ScoringSettings:
    """How the rewards of `model.reward` are combined and run.

    Args:
        weights: one weight per reward of `model.reward`'s list (None: 1.0 each); the total reward of a completion is
            Σ w_i·r_i over the rewards that did not return None for it (TRL's `reward_weights`).
        timeout_s: the rewards run in a process of their own, and a batch not scored within this many seconds
            scores None (nothing learned from it) while the process is replaced. None calls them in this process
            without a deadline.
        memory_gib: the address space, in GiB, that process may map beyond what it holds once started (default: 8,
            or a quarter of the machine's memory if less); a batch that needs more scores None and the process is
            replaced. None: no limit (a reward that runs on a GPU may need it).
        max_unlearnable_steps: stop with an error after this many training steps in a row with nothing to learn (in
            every group the rewards were equal, None or NaN); None never stops.
    """

    weights: list[float] | None = None
    timeout_s: float | None = 600.0
    memory_gib: float | None = DEFAULT_MEMORY_GIB
    max_unlearnable_steps: int | None = None

    def __post_init__(self) -> None:
        check_positive("model.scoring.timeout_s", self.timeout_s, "number of seconds", null="no deadline")
        check_memory_gib(self.memory_gib, "model.scoring.memory_gib")
        check_positive("model.scoring.max_unlearnable_steps", self.max_unlearnable_steps, "number of steps",
                       integer=True, null="never stop")


@dataclass
class EvalSettings:
    """How validate and test sample (`lightning_logra.train.evaluation`).

    Args:
        temperature: the sampling temperature; 0 (the default) is greedy decoding, whose one completion per prompt
            gives greedy pass@1.
        num_samples: completions per prompt (k, verl's `val_kwargs.n`; needs temperature > 0 when above 1): each set
            then logs the unbiased pass@k for k = 1, 2, 4, … up to it and at it, mean@k and maj@k.
        max_new_tokens: the longest completion; None takes `model.sampling.max_new_tokens`.
    """

    temperature: float = 0.0
    num_samples: int = 1
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        check_positive("model.evaluation.num_samples", self.num_samples, "number of completions", integer=True)
        if self.num_samples > 1 and self.temperature == 0:
            raise ValueError(f"model.evaluation.num_samples={self.num_samples} with model.evaluation.temperature=0: "
                             "greedy decoding draws the same completion every time; set model.evaluation.temperature "
                             "(e.g. 0.6 or 1.0), or model.evaluation.num_samples: 1 for greedy pass@1")
        if self.temperature != 0:
            check_at_least("model.evaluation.temperature", self.temperature, MIN_TEMPERATURE, "finite number",
                           why="0 decodes greedily; a positive one divides the logits")
        check_positive("model.evaluation.max_new_tokens", self.max_new_tokens, integer=True,
                       null="model.sampling.max_new_tokens")


@dataclass
class RolloutSettings:
    """Where the samples come from, how stale they may be, and how the loss corrects for their sampler.

    Args:
        engine: the rollout engine; None generates in this process with the policy itself. An engine with its own
            weights (`lightning_logra.rollout.VLLMEngine`, `RemoteEngine`) is kept in step by `RolloutWeightSync`.
        max_staleness: 0 (the default) generates each step's samples with the weights the step trains. k > 0
            overlaps generation with the update: step t's samples come from the weights of step max(0, t − k).
            Needs an engine that runs beside the trainer (VLLMEngine with its own process); `rollout/staleness`
            logs how stale they were (docs/overlap.md).
        is_cap: the sampler correction's cap: with the default `is_mode`, truncated importance sampling, each token's
            loss is weighted by min(π_θ/π_sampler, is_cap). None turns the correction off; the mismatch is logged
            either way (`rollout/*`).
        is_mode: the correction's ratio and what happens past the cap (TRL's `vllm_importance_sampling_mode`, one of
            `lightning_logra.algo.losses.CORRECTIONS`): `token_truncate`, `token_mask`, `sequence_truncate` or
            `sequence_mask`. gspo and cispo take no correction: their ratio is against the sampler already.
        dynamic_sampling: DAPO's dynamic sampling (verl's `algorithm.filter_groups`): groups whose rewards are all
            equal are left out and more prompts generated until the step has data.batch_size learnable groups. Needs
            a data module of `lightning_logra.data`.
        max_generation_rounds: the most rounds of generation a step makes with dynamic_sampling (verl's
            `max_num_gen_batches`), the first included.
        log_completions_every: every this many steps, log a few prompts, completions and rewards as text
            (TensorBoard's Text tab); None never does.
    """

    engine: RolloutEngine | None = None
    max_staleness: int = 0
    is_cap: float | None = 2.0
    is_mode: CorrectionMode = "token_truncate"
    dynamic_sampling: bool = False
    max_generation_rounds: int = 10
    log_completions_every: int | None = 50

    def __post_init__(self) -> None:
        check_at_least("model.rollouts.max_staleness", self.max_staleness, 0, "whole number of steps", integer=True,
                       why="0 generates each step's samples with its own weights, 1 overlaps generation with the "
                           "update")
        check_positive("model.rollouts.is_cap", self.is_cap, null="the correction off")
        check_correction(self.is_mode)
        check_positive("model.rollouts.max_generation_rounds", self.max_generation_rounds, "number of rounds",
                       integer=True)
        check_positive("model.rollouts.log_completions_every", self.log_completions_every, "number of steps",
                       integer=True, null="never")


@dataclass
class ExportSettings:
    """Transformers folders of the policy, written by `lightning_logra.callbacks.PolicyExport`.

    Args:
        dir: at the end of fit, save the policy and tokenizer there with `save_pretrained` (a checkpoint exports
            later with `lightning-logra export`); None: no export.
        every: also export every this many steps, to `dir/step-NNNNNN` (needs dir).
    """

    dir: str | None = None
    every: int | None = None

    def __post_init__(self) -> None:
        check_positive("model.export.every", self.every, "number of steps", integer=True, null="never")
        if self.every is not None and self.dir is None:
            raise ValueError("model.export.every needs model.export.dir: the folder the step-NNNNNN exports go into")


# The module's groups by key (`model.episodes` apart: None when single-turn)
GROUPS = {"sampling": SamplingSettings, "loss": LossSettings, "training": TrainingSettings,
          "scoring": ScoringSettings, "evaluation": EvalSettings, "rollouts": RolloutSettings,
          "export": ExportSettings}
yaml_as_mappings(*GROUPS.values())



def as_group(kind: type, value: Any, key: str) -> Any:
    """`value` as the group `kind`: a copy of it (a default is one instance shared by every module), or built from a
    dict of its fields (a module made by hand)."""
    if isinstance(value, kind):
        return replace(value)
    if isinstance(value, dict):
        return kind(**value)
    raise TypeError(f"model.{key} must be a {kind.__name__} or a dict of its fields, got {type(value).__name__}")


def without_engine(rollouts: RolloutSettings) -> RolloutSettings:
    """What hyper-parameters and checkpoints keep of the rollout settings: the engine is a live object."""
    return replace(rollouts, engine=None)


# Each key of the flat settings before the groups, and where it lives now.
_DENSE = "trainer.strategy.init_args.dense"
MOVED: dict[str, str] = {
    **{f"model.{key}": f"model.sampling.{key}" for key in ("num_generations", "temperature", "top_p",
                                                            "max_new_tokens", "seed")},
    "model.loss_type": "model.loss.type",
    **{f"model.{key}": f"model.loss.{key}" for key in ("scale_rewards", "epsilon", "epsilon_high", "beta",
                                                        "entropy_coef", "mask_truncated_completions")},
    **{f"model.{key}": f"model.training.{key}" for key in ("micro_batch_size", "logprob_chunk_tokens",
                                                            "gradient_checkpointing", "max_grad_norm")},
    "model.reward_weights": "model.scoring.weights",
    "model.reward_timeout_s": "model.scoring.timeout_s",
    "model.reward_memory_gib": "model.scoring.memory_gib",
    "model.max_unlearnable_steps": "model.scoring.max_unlearnable_steps",
    "model.eval_temperature": "model.evaluation.temperature",
    "model.eval_num_samples": "model.evaluation.num_samples",
    "model.eval_max_new_tokens": "model.evaluation.max_new_tokens",
    **{f"model.{key}": f"model.rollouts.{key}" for key in ("engine", "max_staleness", "is_cap", "is_mode",
                                                            "dynamic_sampling", "max_generation_rounds",
                                                            "log_completions_every")},
    **{f"model.{key}": f"model.episodes.{key}" for key in ("max_turns", "tools", "environment_factory",
                                                            "tool_timeout_s", "invalid_tool_call")},
    "model.max_episode_tokens": "model.episodes.max_tokens",
    "model.episode_timeout_s": "model.episodes.timeout_s",
    "model.environment_workers": "model.episodes.workers",
    "model.environment_memory_gib": "model.episodes.memory_gib",
    "model.export_dir": "model.export.dir",
    "model.export_every": "model.export.every",
    **{f"model.{key}": f"{_DENSE}.{key} (with DenseStrategy; a sketch or LoRA strategy's own settings otherwise)"
       for key in ("lr", "weight_decay", "optimizer", "lr_schedule", "target_modules")},
}
