"""The RLVR LightningModule: one training step is one RL iteration, read top to bottom in `training_step`.

Manual optimization, because one step generates G completions for each prompt of the batch, scores them with
verifiable rewards, and accumulates the loss of every micro-batch into one update. What is trained and how (densely,
with LoGRA sketches, with LoRA adapters) is the run's training mode (`lightning_logra.train.modes`), picked from its
strategy; the step size is the run's `StepSizeController` (the predicted-KL budget), and an engine with weights of its
own is kept in step by the run's `WeightSync`: each a component the step calls, found among the callbacks.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.states import TrainerFn

from lightning_logra.algo.advantages import ScaleRewards, estimator, group_advantages
from lightning_logra.algo.logprobs import completion_logprobs
from lightning_logra.algo.losses import (
    Clip,
    CorrectionMode,
    LossType,
    check_correction,
    get_loss,
    importance_weights,
    reference_kl,
    token_weights,
)
from lightning_logra.algo.step_size import StepContext, StepSizeController, find_controller
from lightning_logra.algo.update import Update
from lightning_logra.base.batch import Rollout
from lightning_logra.base.schedule import LRSchedule
from lightning_logra.base.settings import check_at_least, check_positive, is_number
from lightning_logra.episodes.metrics import environment_rewards, episode_metrics
from lightning_logra.episodes.settings import check_episode_settings, episode_tokens, multi_turn
from lightning_logra.paths import PACKAGE_DIR, model_path
from lightning_logra.rewards import (
    DEFAULT_MEMORY_GIB,
    Reward,
    RewardFn,
    RewardName,
    resolve_rewards,
    reward_setting,
)
from lightning_logra.rewards.scoring import UnlearnableSteps, reward_metrics, score
from lightning_logra.rollout import RolloutEngine, SamplingParams
from lightning_logra.train import resume
from lightning_logra.train.backward_stats import BackwardStats
from lightning_logra.train.checkpoint import KEY as CHECKPOINT_KEY
from lightning_logra.train.checkpoint import check_resumable, follow_umask, stamp
from lightning_logra.train.digests import write_sums
from lightning_logra.train.dynamic_sampling import Drawn, DynamicSampling
from lightning_logra.train.evaluation import sample_metrics
from lightning_logra.train.modes import TrainingMode, training_mode
from lightning_logra.train.optimizers import OptimizerSpec
from lightning_logra.train.policy import (
    completions_table,
    encode_prompts,
    load_policy,
    load_reference,
    stop_token_ids,
)
from lightning_logra.train.rollouts import Rollouts
from lightning_logra.train.step_times import StepTimes
from lightning_logra.train.strategies.base import Collectives, collectives_of
from lightning_logra.train.task_metrics import TaskTally, task_index, task_means

log = logging.getLogger(__name__)

MIN_TEMPERATURE = 0.01  # model.temperature and a positive model.eval_temperature
EVAL_STEP = -1  # the step an evaluation's prompts are seeded with: apart from every training step's


def _check_settings(hp: Any) -> None:
    """The module's settings, checked before any weights are loaded; each error names its key."""
    for key in ("num_generations", "max_new_tokens", "micro_batch_size", "logprob_chunk_tokens"):
        check_positive(f"model.{key}", hp[key], integer=True)
    for key in ("log_completions_every", "export_every"):
        check_positive(f"model.{key}", hp[key], "number of steps", integer=True, null="never")
    if hp.num_generations < 2:
        raise ValueError("model.num_generations must be at least 2: advantages compare samples of one prompt")
    # Sampling and every log-prob divide the logits by it: at 1e-40 the quotients overflowed (garbage samples, NaN
    # kl/predicted). Below 0.01 sampling is greedy decoding in all but name.
    check_at_least("model.temperature", hp.temperature, MIN_TEMPERATURE, "finite number",
                   why="sampling divides the logits by it (for greedy evaluation set model.eval_temperature: 0)")
    if not (is_number(hp.top_p) and 0 < hp.top_p <= 1):
        raise ValueError(f"model.top_p must be in (0, 1], got {hp.top_p}")
    check_positive("model.is_cap", hp.is_cap, null="the correction off")
    check_correction(hp.is_mode)
    for key in ("epsilon", "epsilon_high"):
        check_positive(f"model.{key}", hp[key], null="the loss's own default" if key == "epsilon_high" else None)
    check_at_least("model.max_staleness", hp.max_staleness, 0, "whole number of steps", integer=True,
                   why="0 generates each step's samples with its own weights, 1 overlaps generation with the update")
    check_at_least("model.beta", hp.beta, 0, "finite number",
                   why="set 0 for no KL penalty, or a small weight such as 0.04")
    check_positive("model.max_generation_rounds", hp.max_generation_rounds, "number of rounds", integer=True)
    check_positive("model.eval_num_samples", hp.eval_num_samples, "number of completions", integer=True)
    if hp.eval_num_samples > 1 and hp.eval_temperature == 0:
        raise ValueError(f"model.eval_num_samples={hp.eval_num_samples} with model.eval_temperature=0: greedy "
                         "decoding draws the same completion every time; set model.eval_temperature (e.g. 0.6 or 1.0), "
                         "or model.eval_num_samples: 1 for greedy pass@1")
    if hp.eval_temperature != 0:
        check_at_least("model.eval_temperature", hp.eval_temperature, MIN_TEMPERATURE, "finite number",
                       why="0 decodes greedily; a positive one divides the logits")
    check_at_least("model.entropy_coef", hp.entropy_coef, 0, "finite number",
                   why="0 turns the entropy bonus off; verl's examples use about 0.001")
    check_positive("model.reward_timeout_s", hp.reward_timeout_s, "number of seconds", null="no deadline")
    check_positive("model.max_unlearnable_steps", hp.max_unlearnable_steps, "number of steps", integer=True,
                   null="never stop")
    OptimizerSpec.parse(hp.get("optimizer"))  # the class imports and takes its init_args
    check_episode_settings(hp)
    if hp.target_modules is not None and not hp.target_modules:
        raise ValueError("model.target_modules is empty: name the linear layers the dense baseline trains, e.g. "
                         "[q_proj, v_proj], or leave it null to train every parameter")
    get_loss(hp.loss_type)  # one of the registered losses
    estimator(hp.scale_rewards)  # one of the registered advantage estimators, or true / false
    if hp.export_every is not None and hp.export_dir is None:
        raise ValueError("model.export_every needs model.export_dir: the folder the step-NNNNNN exports go into")
    # A hub id is "org/name"; anything else that does not exist locally is a mistyped path.
    if not Path(model_path(hp.model)).exists() and (hp.model.startswith((".", "/", "~")) or hp.model.count("/") > 1):
        raise FileNotFoundError(f"model.model: no such model directory {hp.model!r} (looked for from {Path.cwd()}, "
                                f"and for a `lightning_logra/...` path in the installed package {PACKAGE_DIR})")


def completion_token_lists(rollout: Rollout) -> list[list[int]]:
    """Each completion's token ids without padding (its stop token included)."""
    mask = rollout.completion_mask.bool().cpu()
    return [row[keep].tolist() for row, keep in zip(rollout.completion_ids.cpu(), mask)]


def check_penalty_placement(beta: float, collectives: Collectives) -> None:
    """The KL penalty's reference is a whole copy of the weights in every process: refused where the weights are
    sharded (it would undo what sharding saves)."""
    if beta > 0 and collectives.shards_weights:
        raise ValueError(
            f"model.beta={beta}: the KL penalty's reference model would be a whole, unsharded copy of the weights on "
            "every rank under SketchFSDPStrategy; train with SketchDDPStrategy, or set model.beta 0")


class RLVRModule(LightningModule):
    """RLVR on a causal language model: each training step generates, scores, and trains every selected weight
    (`training_step`); validate and test sample and score (`evaluate`). How the weights train (dense, LoGRA's
    sketches, LoRA) is the Trainer's strategy's; where the samples come from, `Rollouts`.

    Args:
        model: a transformers causal LM: a local directory or a hub name. A path inside the package
            (`lightning_logra/data/tiny_arith`, the embedded model) is found from any working directory.
        reward: a built-in reward name (`exact_match`, `math_answer`), a dotted path to a function
            `fn(prompts, completions, completion_ids, **columns) -> list[float | None]` (TRL's reward
            signature), or a component, `class_path` and `init_args`, whose instances are called so
            (`lightning_logra.rewards.MathAnswer`); or a list of these, whose rewards are summed with
            `reward_weights`. The config's parser checks the names, imports the paths or the classes, and checks
            the init_args against the classes, before anything runs.
        reward_weights: one weight per reward of the list (None: 1.0 each); the total reward of a completion is
            Σ w_i·r_i over the rewards that did not return None for it (TRL's `reward_weights`).
        num_generations: completions sampled per prompt (the group size G).
        temperature: the sampling temperature of the rollouts; the loss's log-probs are taken at it too.
        top_p: nucleus sampling of the rollouts: sample from the smallest set of tokens with this much
            probability (1 samples from all).
        max_new_tokens: the longest completion sampled in training.
        loss_type: the policy-gradient loss, one of `lightning_logra.algo.losses.LOSSES`: `dapo` (token-level
            mean over the batch), `grpo` (mean per sequence, then over sequences), `dr_grpo` (sum over tokens /
            (sequences × max_new_tokens)), `gspo` (a clipped sequence-level ratio to the sampler, grpo's mean) or
            `cispo` (capped token ratios to the sampler, dapo's mean).
        scale_rewards: what each group's mean-centered rewards are divided by (TRL's `scale_rewards`, one of
            `lightning_logra.algo.advantages.ADVANTAGES`): `group` (true: the group's reward standard deviation,
            GRPO), `batch` (the whole batch's), or `none` (false: nothing, Dr. GRPO).
        micro_batch_size: completions per forward/backward pass; their gradients accumulate into one update.
        lr: the learning rate of the dense AdamW of a run without a sketch strategy (the baseline); with a
            sketch strategy the CLI refuses it, and `trainer.strategy.init_args.sketch.optimizer.init_args.lr`
            and `sketch.rest_lr` act.
        weight_decay: the dense AdamW's weight decay (the baseline); under a sketch strategy
            `sketch.rest_weight_decay` acts instead.
        optimizer: another torch optimizer for the dense baseline, or for the adapters under the LoRA strategy,
            by `class_path` and `init_args` (`galore_torch.GaLoreAdamW`, `apollo_torch.APOLLOAdamW`,
            `transformers.optimization.Adafactor`, `bitsandbytes.optim.AdamW8bit`, ...;
            `lightning_logra.train.optimizers`); init_args without `lr` / `weight_decay` take the mode's. None:
            AdamW. A sketch strategy refuses it (`sketch.optimizer` acts).
        lr_schedule: warm-up and decay of the dense AdamW's learning rate, by applied update
            (`lightning_logra.base.schedule.LRSchedule`); under a sketch strategy `sketch.lr_schedule` acts instead.
        target_modules: the dense baseline trains only the weights of these nn.Linear layers (named as
            `sketch.target_modules`: `q_proj` selects every `...self_attn.q_proj`), the parameters a sketch or
            LoRA run trains, and freezes the rest; None trains every parameter.
        max_grad_norm: clip the norm of all gradients (sketches included: E‖G·Aᵀ‖² = ‖G‖²) before each update.
        eval_temperature: the sampling temperature of validate/test; 0 (the default) is greedy decoding, whose
            one completion per prompt gives greedy pass@1.
        eval_num_samples: completions per prompt in validate/test (k, verl's `val_kwargs.n`; needs
            eval_temperature > 0 when above 1): each set then logs the unbiased pass@k (Chen et al. 2021) for k
            = 1, 2, 4, … up to it and at it, mean@k (the mean reward) and maj@k (the reward of the most frequent
            answer; `lightning_logra.train.evaluation`).
        eval_max_new_tokens: the longest completion in validate/test; None takes max_new_tokens.
        dtype: the dtype the policy's weights are loaded in (`bfloat16` with `trainer.precision: bf16-true`).
        chat_template: wrap each text prompt as a user message with the tokenizer's chat template (a
            conversational prompt, a list of messages, always goes through the template); rewards then get each
            completion in conversational form, `[{"role": "assistant", "content": text}]`, as TRL passes it.
        gradient_checkpointing: recompute activations in the backward pass instead of keeping them (less
            memory, more compute).
        seed: seeds the sampling: each prompt's completions are a function of (seed, step, prompt index).
        export_dir: at the end of fit, save the policy and tokenizer there with `save_pretrained` (a checkpoint
            exports later with `python -m lightning_logra.export`).
        export_every: also export every this many steps, to `export_dir/step-NNNNNN` (needs export_dir).
        logprob_chunk_tokens: completion log-probs are computed this many tokens at a time, so that the
            micro-batch's full-vocabulary logits never exist at once (forward and backward); None builds them
            as one (m, C, V) tensor.
        engine: the rollout engine; None generates in this process with the policy itself. An engine with its
            own weights (`lightning_logra.rollout.VLLMEngine`) needs the `RolloutWeightSync` callback.
        is_cap: the sampler correction's cap: with the default `is_mode`, truncated importance sampling, each
            token's loss is weighted by min(π_θ/π_sampler, is_cap), correcting for a sampler whose log-probs differ
            from the trainer's (another engine, other kernels, bf16, a stale engine). None turns the correction
            off; the mismatch is logged either way (`rollout/*`, `sampling/importance_sampling_ratio/*`).
        is_mode: the correction's ratio and what happens past the cap (TRL's `vllm_importance_sampling_mode`, one
            of `lightning_logra.algo.losses.CORRECTIONS`): `token_truncate` (the default here; TRL's is
            `sequence_mask`), `token_mask` (a token past the cap weighs 0), `sequence_truncate`,
            `sequence_mask` (the sequence's ratio, the product of its token ratios, on all its tokens). gspo and
            cispo take no correction: their ratio is against the sampler already.
        epsilon: gspo's clip range, [1 − epsilon, 1 + epsilon_high] around its sequence ratio (TRL's `epsilon`;
            the GSPO paper's is 3e-4 with epsilon_high 4e-4).
        epsilon_high: the upper end of gspo's clip range (None: epsilon); for cispo the cap on its token ratio
            itself, as in TRL (None: 5.0).
        max_staleness: 0 (the default) generates each step's samples with the weights the step trains. k > 0
            overlaps generation with the update: the engine draws step t's samples from the weights of step
            max(0, t − k) while the trainer computes the updates between, so that neither waits on the other.
            Needs an engine that runs beside the trainer (VLLMEngine with its own process); with the in-process
            engine the steps stay serial. The sampler correction (or gspo / cispo's ratio) weighs the stale
            samples towards π_θ; `rollout/staleness` logs how stale they were (docs/overlap.md).
        beta: the weight β of a KL penalty to the starting policy (TRL's `beta`): each completion token's loss
            gains β·kl_t, the k3 estimate exp(r_t − l_t) − (r_t − l_t) − 1 between the policy's log-prob l_t and
            a frozen reference's r_t (`losses.reference_kl`), weighted per token as `loss_type` weighs the
            policy-gradient term (not by the advantage, nor the importance weight); `train/kl` logs its mean per
            token, and `train/loss` includes the penalty. 0 (the default) turns it off and loads nothing. With
            β > 0 a fit keeps the reference, a frozen copy of the starting weights loaded from `model` (a resumed
            run's too): one more copy of the weights in the policy's dtype on every process, and one more forward
            pass of it per micro-batch; every sample goes through the backward passes (a zero advantage no
            longer means a zero gradient). Refused under `SketchFSDPStrategy`, where the reference would be a
            whole, unsharded copy on every rank.
        reward_timeout_s: the reward runs in a process of its own, and a batch it has not scored within this
            many seconds scores None (nothing learned from it) while the process is replaced. None calls it in
            this process without a deadline.
        reward_memory_gib: the address space, in GiB, that process may map beyond what it holds once started
            (default: 8, or a quarter of the machine's memory if less); a batch that needs more scores None and
            the process is replaced, as at the deadline. None: no limit (a reward that runs on a GPU may need it).
        max_unlearnable_steps: stop with an error after this many training steps in a row with nothing to learn
            (in every group the rewards were equal, None or NaN); None never stops. Such steps are warned
            about when no completion got a usable reward at all.
        log_completions_every: every this many steps, log a few prompts, completions and rewards as text
            (TensorBoard's Text tab); None never does.
        dynamic_sampling: DAPO's dynamic sampling (verl's `algorithm.filter_groups`): groups whose rewards are all
            equal are left out and more prompts generated until the step has data.batch_size learnable groups
            (`lightning_logra.train.dynamic_sampling`); logs `rollout/generation_rounds`, `prompts_drawn`,
            `filtered_groups` and `missing_groups`. Needs a data module of `lightning_logra.data`.
        max_generation_rounds: the most rounds of generation a step makes with dynamic_sampling (verl's
            `max_num_gen_batches`), the first included; then the step trains on the learnable groups it has.
        mask_truncated_completions: completions cut at max_new_tokens (no stop token) count for nothing in the
            loss (TRL's `mask_truncated_completions`); they still take part in their group's advantages.
        entropy_coef: the weight of an entropy bonus (verl's `entropy_coeff`): the loss subtracts
            entropy_coef × the policy's token entropy, weighed per token as the policy-gradient term, its
            gradient taken from the same chunks as the log-probs (no full-vocabulary logits). 0: off.
        max_turns: the most turns of a multi-turn episode (docs/multi-turn.md): the model's turns, each followed by
            the environment's answer (tool answers, or an observation), carried as token ids; the loss counts only
            the tokens the engine sampled. 1 (the default) samples one completion per prompt, as without tools.
        tools: plain functions the model may call, by dotted path (`pkg.module.fn`; TRL's `tools`): their type
            hints and docstrings give the schemas the chat template shows. Needs model.max_turns > 1 for the model to
            read their answers.
        environment_factory: a class, by dotted path (or class_path and init_args), one instance of which each
            episode talks to (TRL's `environment_factory`): `reset(**row)` gets the dataset row and may return text
            added to the prompt, its public methods are the tools, and an optional `reward()` is the episode's own
            reward (`model.reward: environment`). `lightning_logra.episodes.GymAdapter` (init_args env, env_args)
            takes a gym-like text environment (`reset(seed, **row)`, `step(action)`). Made and called in environment
            processes, never in the trainer's.
        max_episode_tokens: the most completion-side tokens of an episode, sampled and the environment's together
            (None: max_turns × max_new_tokens); an answer that would not leave room ends the episode.
        tool_timeout_s: the deadline of each tool call (and of an environment's reset, step and reward): past it the
            model reads that the call timed out, and the environment process is replaced.
        episode_timeout_s: after this many seconds a batch's episodes take no further turn (None: no deadline).
        invalid_tool_call: what a call that cannot be read (an unclosed tag, JSON that does not parse) does:
            `answer` (the model reads why, as the call's answer, and goes on) or `end` (the episode ends there);
            counted either way (`episodes/invalid_calls`).
        environment_workers: the environment processes (episodes are shared out over them).
        environment_memory_gib: the address space, in GiB, each environment process may map beyond what it holds
            once started (None: no limit).
    """
    def __init__(
        self,
        model: str,
        # The list first: writing the config back out, the parser takes the first type a value fits, and a list
        # "fits" RewardFn as an unimportable path. (So `--model.reward pkg.Class --model.reward.arg v` parses as a
        # list of one: the same reward.)
        reward: list[RewardName | RewardFn] | RewardName | RewardFn = "exact_match",
        reward_weights: list[float] | None = None,
        num_generations: int = 8,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 256,
        loss_type: LossType = "dapo",
        scale_rewards: ScaleRewards = True,
        micro_batch_size: int = 8,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        optimizer: dict[str, Any] | str | None = None,
        lr_schedule: LRSchedule = LRSchedule(),
        target_modules: list[str] | None = None,
        max_grad_norm: float | None = 1.0,
        eval_temperature: float = 0.0,
        eval_max_new_tokens: int | None = None,
        dtype: Literal["float32", "bfloat16"] = "float32",
        chat_template: bool = False,
        gradient_checkpointing: bool = False,
        seed: int = 0,
        export_dir: str | None = None,
        engine: RolloutEngine | None = None,
        is_cap: float | None = 2.0,
        is_mode: CorrectionMode = "token_truncate",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        max_staleness: int = 0,
        beta: float = 0.0,
        reward_timeout_s: float | None = 600.0,
        reward_memory_gib: float | None = DEFAULT_MEMORY_GIB,
        max_unlearnable_steps: int | None = None,
        log_completions_every: int | None = 50,
        export_every: int | None = None,
        logprob_chunk_tokens: int | None = 256,
        dynamic_sampling: bool = False,
        max_generation_rounds: int = 10,
        mask_truncated_completions: bool = False,
        entropy_coef: float = 0.0,
        eval_num_samples: int = 1,
        max_turns: int = 1,
        tools: list[str] | None = None,
        environment_factory: str | dict[str, Any] | None = None,
        max_episode_tokens: int | None = None,
        tool_timeout_s: float = 30.0,
        episode_timeout_s: float | None = 600.0,
        invalid_tool_call: Literal["answer", "end"] = "answer",
        environment_workers: int = 2,
        environment_memory_gib: float | None = DEFAULT_MEMORY_GIB,
    ) -> None:
        super().__init__()
        # Before save_hyperparameters, which deep-copies the reward: one that cannot be sent to its process is
        # refused here, naming the key.
        self.rewards: list[Reward] = resolve_rewards(reward, reward_weights, reward_timeout_s, reward_memory_gib)
        self.save_hyperparameters(ignore=["engine"])
        self.hparams["reward"] = reward_setting(self.hparams["reward"])  # a function by name: checkpoints hold none
        _check_settings(self.hparams)
        self.automatic_optimization = False
        self.sampling = SamplingParams(temperature, top_p, max_new_tokens)
        self.eval_sampling = SamplingParams(eval_temperature, 1.0, eval_max_new_tokens or max_new_tokens)
        self.policy: torch.nn.Module | None = None
        # π_0 for the KL penalty (model.beta > 0), loaded for a fit by configure_model; never a submodule (below).
        self.reference: torch.nn.Module | None = None
        self.tokenizer = None
        self.lr_schedule = lr_schedule
        self.unlearnable = UnlearnableSteps(max_unlearnable_steps, self.rewards)
        self.num_tokens = 0  # prompt + completion tokens trained on so far, all ranks (checkpointed)
        self._all_cut = 0  # steps whose completions were all cut and masked (mask_truncated_completions)
        # The run's components, found when it is set up: how it trains, over how many processes and who chooses α
        # (None: α = 1); and where its samples come from: the engine, its weight sync, overlapped rollouts.
        self.mode: TrainingMode | None = None
        self.collectives: Collectives = Collectives()
        self.controller: StepSizeController | None = None
        self.rollouts = Rollouts(self, engine)
        # An evaluation set's metrics per task, summed over its batches (data whose rows name their task)
        self.tally: TaskTally | None = None

    # ---- set-up -------------------------------------------------------------------------------------------------

    def configure_model(self) -> None:
        # Loaded here, not in __init__, so that configs can be parsed and checked without loading weights.
        hp = self.hparams
        trainer = self._trainer
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if fitting:  # before any weights are loaded (the CLI checks it before the processes start, too)
            check_penalty_placement(hp.beta, collectives_of(trainer))
        if self.policy is None:
            self.policy, self.tokenizer = load_policy(hp.model, hp.dtype, hp.gradient_checkpointing)
        # Without a Trainer (a module built to export or evaluate by hand) the policy is set up as the dense baseline.
        if trainer is not None:
            self.collectives = collectives_of(trainer)
        if hp.beta > 0 and fitting and self.reference is None:
            # Straight onto the strategy's device and into the dtype the policy's weights will have: the strategy's
            # set-up, which comes after this hook, moves and converts only registered submodules. And not one of
            # those: nn.Module.__setattr__ registers any module assigned to an attribute, which would put the
            # reference into the checkpoint's state_dict, the parameters an optimizer or FSDP could collect, and
            # Lightning's model.train() at fit start; object.__setattr__ keeps it a plain attribute.
            reference = load_reference(hp.model, self.weights_dtype(), trainer.strategy.root_device)
            object.__setattr__(self, "reference", reference)
        self.mode = training_mode(trainer and trainer.strategy, self.collectives, hp, self.lr_schedule)
        self.mode.install(self.policy, fitting=fitting)
        self.mode.bind(self.optimizers)
        self.rollouts.start_engine()

    @property
    def engine(self) -> RolloutEngine | None:
        """The rollout engine (`model.engine`; once set up, the in-process one when none was given)."""
        return self.rollouts.engine

    @engine.setter
    def engine(self, engine: RolloutEngine | None) -> None:
        self.rollouts.engine = engine

    def configure_optimizers(self):
        return self.mode.build_optimizers(self.policy)

    def stop_token_ids(self) -> list[int]:
        return stop_token_ids(self.tokenizer, self.policy)

    def encode_prompts(self, prompts: list[str] | list[list[dict[str, str]]]) -> list[list[int]]:
        """The token ids the rollout engine receives for each prompt (`policy.encode_prompts`)."""
        return encode_prompts(self.tokenizer, prompts, self.hparams.chat_template)

    def prompt_token_limit(self, stage: str) -> tuple[int, str] | None:
        """The longest prompt, in tokens, that leaves room in the model's context for the completions of `stage`
        ("fit": model.max_new_tokens; "validate", "test": the evaluation's), with where the limit comes from (for the
        data module's messages). The context is the engine's max_model_len when set, else the policy's
        max_position_embeddings; None when neither states one. The data module asks for it when
        data.max_prompt_length is unset: a prompt past the context would grow generation's memory without bound."""
        max_model_len = self.engine.max_model_len() if self.engine is not None else None
        if max_model_len is not None:
            context, context_key, longer = max_model_len, "model.engine's max_model_len", "raise it"
        else:
            context = getattr(self.policy.config, "max_position_embeddings", None)
            context_key, longer = "model.model's max_position_embeddings", "use a model with a longer one"
            if context is None:  # a model without a fixed context (state-space models)
                return None
        evaluating = stage != "fit" and self.hparams.eval_max_new_tokens is not None
        new_tokens_key = "model.eval_max_new_tokens" if evaluating else "model.max_new_tokens"
        new_tokens = (self.sampling if stage == "fit" else self.eval_sampling).max_new_tokens
        if multi_turn(self.hparams):  # an episode's turns and answers follow the prompt
            new_tokens_key, new_tokens = "model.max_episode_tokens", episode_tokens(self.hparams)
        if context - new_tokens < 1:
            raise ValueError(f"{new_tokens_key}={new_tokens} leaves no room for a prompt in the model's context of "
                             f"{context} tokens ({context_key}): set {new_tokens_key} below {context}, or {longer}")
        return context - new_tokens, f"{context_key}={context}, less {new_tokens_key}={new_tokens}"

    # ---- one RL iteration ---------------------------------------------------------------------------------------

    def training_step(self, batch: dict[str, list[Any]], batch_idx: int) -> dict[str, Any]:
        """One RL iteration, in order: generate (or take what was generated ahead) and score, advantages, gradients,
        reduce and clip, propose, the step size α, apply, sync the engine, log. Returns {"loss", "update"}: the update
        applied (what a rollout engine with weights of its own receives), or None when the step was skipped (the
        weights unchanged)."""
        hp, step, times = self.hparams, self.global_step, StepTimes()
        rollout, version, waited = self.rollouts.draw(batch, step)  # the step's samples, drawn with `version`'s weights
        times.took("wait", waited)
        rewards, per_reward = self.score(batch, rollout, hp.num_generations)  # (N,), (N, rewards)
        times.lap("score")
        drawn = Drawn(batch, rollout, rewards, per_reward, torch.full_like(rewards, float(step - version)))
        sampled: dict[str, float] = {}
        if hp.dynamic_sampling:  # more rounds until the batch's groups are learnable (their time counts as waiting)
            drawn, sampled = self.dynamic_sampling().fill(drawn, partial(self.rollouts.draw_round, step))
            times.lap("wait")
        batch, rollout, rewards, per_reward = drawn.batch, drawn.rollout, drawn.rewards, drawn.per_reward
        self.unlearnable.add(rewards.view(-1, hp.num_generations), self.sum_over_ranks)
        advantages = group_advantages(rewards, hp.num_generations, hp.scale_rewards, self.sum_over_ranks)  # (N,)
        trained = self.trained_tokens(rollout)  # model.mask_truncated_completions: cut completions count for nothing
        loss, mismatch, metrics = self.accumulate_gradients(trained, advantages)
        grad_norm = self.mode.reduce_and_clip(hp.max_grad_norm)
        proposal = self.mode.propose(grad_norm, measured=self.controller is not None)  # None: skipped
        alpha = self.step_size(proposal, trained, step, drawn.positions)
        lr = self.mode.learning_rates()["train/lr"]  # this step's η, before the schedule advances
        update = self.mode.apply(alpha)  # None: nothing reached the weights
        times.lap("update")
        self.advance_lr_schedules(applied=update is not None)
        synced = self.rollouts.sync(update, float(mismatch["rollout/logprob_abs_diff"]), stale=version < step)
        controlled = self.controller.applied(update) if self.controller is not None else {}
        self.log_step(rollout, rewards, per_reward, step, times.elapsed(), {
            "train/loss": loss, "train/grad_norm": grad_norm, **metrics,
            "train/update_skipped": float(update is None),
            # The step actually taken, α·η (NaN when skipped); with a KL budget that binds, α·η = √(δ/q₁).
            "train/effective_lr": alpha * lr if update is not None else math.nan,
            **times.metrics(), **self.rollouts.staleness_metrics(drawn.staleness, rollout), **sampled,
            **self.task_rewards(batch, rollout, rewards), **mismatch, **self.mode.metrics,
            **self.collectives.reduction_metrics(), **synced, **controlled})
        return {"loss": loss, "update": update}

    def dynamic_sampling(self) -> DynamicSampling:
        return DynamicSampling(self.hparams.max_generation_rounds, self.hparams.num_generations, self.global_rank,
                               self.trainer.world_size, self.sum_over_ranks, self.device)

    def trained_tokens(self, rollout: Rollout) -> Rollout:
        """The rollout as the loss sees it: with model.mask_truncated_completions, completions cut at
        model.max_new_tokens (no stop token) have no token that counts (TRL's `mask_truncated_completions`)."""
        if not self.hparams.mask_truncated_completions:
            return rollout
        kept = rollout.terminated(self.stop_token_ids())[:, None]  # (N, 1): ended with a stop token, not cut
        if not bool(kept.any()):
            self._all_cut += 1
            if self._all_cut in (1, 10) or self._all_cut % 100 == 0:  # said at once, then now and then
                log.warning("every completion of this step (and of %d steps so far) was cut at model.max_new_tokens="
                            "%d, and model.mask_truncated_completions leaves none to train on: raise "
                            "model.max_new_tokens, or set model.mask_truncated_completions: false", self._all_cut,
                            self.hparams.max_new_tokens)
        sampled = None if rollout.sampled_mask is None else rollout.sampled_mask * kept
        return replace(rollout, completion_mask=rollout.completion_mask * kept, sampled_mask=sampled)

    def generate(self, batch: dict[str, list[Any]], n: int, sampling: SamplingParams, step: int) -> Rollout:
        """n completions of each prompt of `batch`, on this process's device (`Rollouts.engine_call`)."""
        return self.rollouts.generate(batch, n, sampling, step)

    def score(self, batch: dict[str, list[Any]], rollout: Rollout, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rewards of the rollout's completions (n per prompt of `batch`), each reward called as TRL calls it."""
        completion_ids = completion_token_lists(rollout)
        columns = {key: values for key, values in batch.items() if key != "prompt_ids"}
        per_sample = None
        if rollout.sampled_mask is not None:  # episodes: each a conversation, its last message the final answer
            completions = self.rollouts.episodes.conversations(rollout)
            per_sample = {"environment_reward": environment_rewards(rollout)}
        else:
            completions = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
            if self.hparams.chat_template or not all(isinstance(prompt, str) for prompt in batch["prompt"]):
                # TRL's conversational form
                completions = [[{"role": "assistant", "content": text}] for text in completions]
        rewards, per_reward = score(self.rewards, columns, completions, completion_ids, n, self.global_step,
                                    per_sample)
        return rewards.to(self.device), per_reward.to(self.device)

    def accumulate_gradients(self, rollout: Rollout, advantages: torch.Tensor
                             ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The gradient of the batch's policy-gradient loss (with model.beta > 0, plus the KL penalty), micro-batch by
        micro-batch, into the parameters' .grad (a sketched layer's: its d×r sketch). Returns the global batch's
        loss, the sampler/trainer log-prob mismatch (`Mismatch.metrics`), and `train/entropy`, the policy's mean
        token entropy on the tokens trained on (NaN: none), with, when beta > 0, `train/kl`: the mean per-token k3
        estimate of KL(π_θ ‖ π_0) (`losses.reference_kl`) over the batch's completion tokens."""
        hp = self.hparams
        # Normalize by the global batch's counts, so that gradients summed over ranks are the global loss's.
        total_tokens = self.sum_over_ranks(rollout.loss_mask.sum().float())  # the sampled ones: what the loss counts
        total_sequences = int(self.sum_over_ranks(torch.tensor(float(len(advantages)), device=self.device)))
        longest = episode_tokens(hp) if multi_turn(hp) else hp.max_new_tokens  # dr_grpo's constant normalizer
        weights = token_weights(rollout.loss_mask, hp.loss_type, longest, total_tokens,
                                total_sequences)  # (N, C)
        # A sample with zero advantage contributes exactly zero policy gradient: leave it out of the backward passes —
        # unless every pass is a collective (a DDP wrapper, FSDP), where all ranks must run the same number of them,
        # or a KL penalty acts, whose gradient β·Σ w·∂kl/∂θ every sample carries whatever its advantage.
        every_row = self.collectives.lockstep or hp.beta > 0 or hp.entropy_coef > 0
        active = torch.arange(len(advantages), device=self.device) if every_row else advantages.nonzero().squeeze(-1)
        micro = list(active.split(hp.micro_batch_size)) if active.numel() else []
        passes = len(micro)
        if self.collectives.lockstep:  # as many passes on every rank, though ranks may hold more rows than others
            passes = int(self.max_over_ranks(torch.tensor([float(passes)]))[0])
        stats = BackwardStats.zeros(self.device)
        for index in range(passes):
            if index < len(micro):
                rows = micro[index]
                stats = stats.add(self.forward_backward(rollout.select(rows), weights[rows], advantages[rows]))
            else:  # this rank's rows ran out (dynamic sampling kept fewer here): a row whose tokens count zero
                idle = rollout.select(torch.zeros(1, dtype=torch.long, device=self.device)).emptied()  # (1, w ≥ 1)
                stats = stats.add(self.forward_backward(idle, torch.zeros_like(weights[:1]), advantages[:1] * 0))
        stats = stats.reduce(self.sum_over_ranks, self.max_over_ranks)
        metrics = {"train/entropy": stats.entropy / stats.tokens}
        if get_loss(hp.loss_type).own_ratio:
            # Over every completion token of the batch (a sample left out for its zero advantage has none binding)
            metrics["clip_ratio/region_mean"] = stats.clipped / total_tokens.clamp(min=1)
        if hp.beta > 0:
            metrics["train/kl"] = stats.kl / stats.tokens.clamp(min=1)  # 0 for a batch without completion tokens
        return stats.loss, stats.mismatch.metrics(), metrics

    def forward_backward(self, micro: Rollout, weights: torch.Tensor, advantages: torch.Tensor) -> BackwardStats:
        """One micro-batch's forward and backward pass: its loss's gradient added into the parameters' .grad.
        `micro`: m rows, right padding trimmed to width w; `weights` (m, C): the loss's per-token weights of those
        rows in the global batch; `advantages` (m,)."""
        hp = self.hparams
        objective, clip = get_loss(hp.loss_type), Clip(hp.epsilon, hp.epsilon_high)
        # gspo and cispo take their ratio against the sampler themselves: no second correction on top
        is_cap = None if objective.own_ratio else hp.is_cap
        # (m, w) the tokens the policy reads (attention) and, of them, those it sampled (every token sum counts these)
        present, mask, width = micro.completion_mask, micro.loss_mask, micro.completion_ids.shape[1]
        if hp.beta > 0:
            # The reference's log-probs first: its forward pass's transients are gone before the policy's, whose
            # activations are kept for the backward pass, are built. Same tokens, temperature and chunking.
            with torch.no_grad():
                ref_logprobs, _ = completion_logprobs(self.reference, micro.prompt_ids, micro.prompt_mask,
                                                      micro.completion_ids, present, hp.temperature,
                                                      hp.logprob_chunk_tokens)  # (m, w)
        # (m, w) each; the (m, w, V) logits exist a chunk of tokens at a time (lightning_logra/algo/logprobs.py)
        logprobs, token_entropy = completion_logprobs(self.policy, micro.prompt_ids, micro.prompt_mask,
                                                      micro.completion_ids, present, hp.temperature,
                                                      hp.logprob_chunk_tokens, entropy_grad=hp.entropy_coef > 0)
        is_weight, mismatch = importance_weights(logprobs.detach(), micro.sampler_logprobs, mask, is_cap,
                                                 hp.is_mode)  # (m, w)
        # (m, w) each: the loss's per-token objective (its gradient the policy gradient), where its clip binds
        surrogate, binds = objective.surrogate(logprobs, micro.sampler_logprobs, mask, advantages, clip)
        loss = -(weights[:, :width] * is_weight * surrogate).sum()
        kl_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        if hp.beta > 0:
            # (m, w), 0 on padding; differentiable through the policy's log-probs (the reference's have no graph)
            kl = reference_kl(logprobs, ref_logprobs, mask)
            # The same per-token weights as the policy-gradient term, but neither the advantage nor the importance
            # weight: the penalty is a distance to the reference, not a reward (TRL adds it the same way).
            loss = loss + hp.beta * (weights[:, :width] * kl).sum()
            kl_sum = kl.detach().sum()
        if hp.entropy_coef > 0:
            # verl's entropy bonus: the entropy weighed per token as the policy-gradient term, subtracted (raised)
            loss = loss - hp.entropy_coef * (weights[:, :width] * token_entropy).sum()
        self.manual_backward(loss * self.collectives.loss_scale)
        return BackwardStats(loss.detach(), binds.sum().float(), (token_entropy.detach() * mask).sum(), mask.sum(),
                             kl_sum, mismatch)

    def step_size(self, proposal: Update | None, rollout: Rollout, step: int,
                  positions: torch.Tensor | None) -> float:
        """α for the proposal: the controller's, 1 without one, NaN when there is nothing to take (skipped).
        `positions`: where the rows stand in one process's batch (dynamic sampling's `Drawn.positions`)."""
        if proposal is None:
            return math.nan
        if self.controller is None:
            return 1.0
        context = StepContext(self.policy, self.hparams.temperature, step, self.global_rank, self.trainer.world_size,
                              self.sum_over_ranks, positions)
        return self.controller.choose_alpha(proposal, rollout, context)

    def sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        return self.trainer.strategy.reduce(value, reduce_op="sum")

    def max_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """Elementwise the largest of every rank's `values` (NaN travels as inf, which the maximum keeps)."""
        values = values.to(self.device).nan_to_num(nan=math.inf)
        if self.trainer.world_size == 1:
            return values
        return self.trainer.strategy.reduce(values, reduce_op="max")

    def advance_lr_schedules(self, applied: bool) -> None:
        """Log this step's learning rates (`train/lr`: the sketch optimizer's or the dense AdamW's; `train/rest_lr`:
        the AdamW of `sketch.train_rest`), then advance the schedules — after an applied update only: a skipped one
        changed no weight, so it spends none of the warm-up or decay."""
        self.log_dict(self.mode.learning_rates())
        schedulers = self.lr_schedulers()
        if applied and schedulers is not None:
            for scheduler in schedulers if isinstance(schedulers, list) else [schedulers]:
                scheduler.step()

    def task_names(self) -> list[str]:
        """The tasks the data's rows belong to (`RLVRDataModule.task_names`); empty: one task."""
        datamodule = self.trainer.datamodule
        return datamodule.task_names() if hasattr(datamodule, "task_names") else []

    def task_rewards(self, batch: dict[str, list[Any]], rollout: Rollout, rewards: torch.Tensor
                     ) -> dict[str, torch.Tensor]:
        """`reward/<task>/mean` over every rank's samples of each task (`train.task_metrics`), for data whose rows
        name their task; NaN for a task the step drew no prompt of."""
        names = self.task_names()
        if not names:
            return {}
        index = task_index(names, batch["task"], self.device).repeat_interleave(self.hparams.num_generations)
        real = rollout.completion_mask.sum(-1) > 0  # not a row dynamic sampling left this rank without tokens
        return task_means(names, index[real], rewards[real], self.sum_over_ranks, "reward/<task>/mean")

    def log_step(self, rollout: Rollout, rewards: torch.Tensor, per_reward: torch.Tensor, step: int, step_s: float,
                 metrics: dict[str, Any]) -> None:
        """The step's metrics (TRL's names where TRL has them), and every `log_completions_every` steps a few
        completions as text."""
        lengths = rollout.completion_lengths.float()
        terminated = rollout.terminated(self.stop_token_ids()).float()
        groups = rewards.view(-1, self.hparams.num_generations)
        # Prompt + completion tokens of every sample, all ranks (TRL's num_tokens).
        self.num_tokens += int(self.sum_over_ranks((rollout.prompt_mask.sum() + lengths.sum()).float()))
        metrics = {
            "train/reward_std": rewards.std(),
            "train/frac_reward_zero_std": (groups.std(1) == 0).float().mean(),
            "train/num_tokens": float(self.num_tokens),
            "completions/mean_length": lengths.mean(),
            "completions/min_length": lengths.min(),
            "completions/max_length": lengths.max(),
            "completions/terminated_ratio": terminated.mean(),  # ended with a stop token
            "completions/clipped_ratio": 1.0 - terminated.mean(),  # cut at model.max_new_tokens
            "train/tokens_per_s": lengths.sum() / step_s,
            "train/step_s": step_s,
            **reward_metrics(per_reward, [reward.key for reward in self.rewards], self.trainer.strategy),
            **episode_metrics(rollout),
            **metrics,
        }
        # Over every rank's samples, exactly: with dynamic sampling the ranks may hold different numbers of them, and
        # a rank's group whose tokens count zero (it kept none) is not one
        real = rollout.completion_mask.sum(-1) > 0
        total, count = self.sum_over_ranks(torch.stack([rewards[real].sum(), real.sum().float()])).unbind()
        self.log("train/reward_mean", total / count, prog_bar=True, batch_size=len(rewards))
        self.log_dict(metrics, batch_size=len(rewards), sync_dist=True)
        every = self.hparams.log_completions_every
        experiment = getattr(self.logger, "experiment", None)
        if every is not None and step % every == 0 and self.trainer.is_global_zero and hasattr(experiment, "add_text"):
            shown = slice(0, 8)  # a few prompts, completions and rewards, rank 0's
            table = completions_table(self.tokenizer, rollout.prompt_ids[shown], rollout.completion_ids[shown],
                                      rewards[shown])
            experiment.add_text("completions", table, global_step=step)

    # ---- evaluation: pass@1, or pass@k, mean@k and maj@k (train/evaluation.py) ----------------------------------

    def evaluate(self, batch: dict[str, list[Any]], stage: str) -> None:
        """`model.eval_num_samples` completions of each prompt at `model.eval_temperature`, scored: `<stage>/pass@1`
        for one, and with more, pass@k for k = 1, 2, 4, … and mean@k, maj@k (`evaluation.sample_metrics`); for data
        whose rows name their task, each also per task at the set's end (`<stage>/<task>/pass@1`)."""
        n = self.hparams.eval_num_samples
        rollout = self.generate(batch, n, self.eval_sampling, EVAL_STEP)
        rewards, _ = self.score(batch, rollout, n)
        if n == 1:
            per_prompt = {f"{stage}/pass@1": rewards}
        else:
            texts = self.tokenizer.batch_decode(completion_token_lists(rollout), skip_special_tokens=True)
            per_prompt = sample_metrics(rewards.view(-1, n), texts, stage)  # {key: (prompts,)}
        for key, values in per_prompt.items():
            self.log(key, values.mean().to(self.device), prog_bar=key == f"{stage}/pass@1", batch_size=len(values),
                     sync_dist=True)
        if self.tally is not None:
            self.tally.add(task_index(self.tally.names, batch["task"]), per_prompt)

    def validation_step(self, batch: dict[str, list[Any]], batch_idx: int) -> None:
        self.evaluate(batch, "val")

    def test_step(self, batch: dict[str, list[Any]], batch_idx: int) -> None:
        self.evaluate(batch, "test")

    def on_validation_epoch_end(self) -> None:
        self._log_task_metrics()

    def on_test_epoch_end(self) -> None:
        self._log_task_metrics()

    def _log_task_metrics(self) -> None:
        if self.tally is not None:  # reduced over ranks already: every rank logs the same values (their mean)
            self.log_dict(self.tally.compute(self.sum_over_ranks, self.device), sync_dist=True)

    # ---- export ---------------------------------------------------------------------------------------------------

    def export(self, path: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Save the policy and tokenizer as a transformers checkpoint (sketched layers keep the original layout);
        `state_dict`: the policy's weights when this process does not hold them whole (gathered from FSDP shards)."""
        self.policy.save_pretrained(path, state_dict=state_dict)
        self.tokenizer.save_pretrained(path)
        follow_umask(Path(path))
        write_sums(Path(path))  # checked when a run loads the folder (`load_policy`); `sha256sum -c SHA256SUMS` too

    def _export_from_every_rank(self, path: str | Path) -> None:
        """Called on every rank: a sharded policy is gathered first (a collective), and rank 0 writes the folder."""
        state_dict = self.collectives.whole_policy_state()
        if self.trainer.is_global_zero:
            self.export(path, state_dict)

    # ---- the run's components -------------------------------------------------------------------------------------

    def on_fit_start(self) -> None:
        if self.hparams.dynamic_sampling and not hasattr(self.trainer.datamodule, "extra_batch"):
            raise ValueError("model.dynamic_sampling draws its extra prompts from the data module's training set: "
                             "give a data module of lightning_logra.data (data.class_path), or set "
                             "model.dynamic_sampling: false")
        clash = set(self.task_names()) & {reward.key for reward in self.rewards}
        if clash:
            raise ValueError(f"data: the tasks {sorted(clash)} have the names of rewards of model.reward, and "
                             "reward/<name>/mean would log both: rename the reward function or class")
        # Asked for α between each step's proposal and its application (lightning_logra.algo.step_size).
        self.controller = find_controller(self.trainer.callbacks)
        self.rollouts.find_sync()
        # What the optimizers were built with, before a checkpoint's state replaces it (on_train_start puts it back).
        self._configured = resume.configured(self.trainer.optimizers)
        self._trained = False  # whether training began (a resume already at trainer.max_steps never does)
        # The mode's settings beside the module's own hyperparameters, so that runs differ by them in the loggers
        if self.mode.hparams():
            for logger in self.loggers:
                logger.log_hyperparams(self.mode.hparams())

    def on_train_start(self) -> None:
        # Only now are the weights a resumed checkpoint's under every strategy: FSDP's are restored after on_fit_start
        # (Lightning's restore_checkpoint_after_setup), the others' before. (A sanity validation attaches it first, in
        # on_validation_start, which also comes after the restore.)
        self._trained = True
        self.rollouts.attach()
        self.rollouts.start()
        # After a resume, the optimizers hold the checkpoint's settings: this run's config wins, and says so.
        schedulers = [config.scheduler for config in self.trainer.lr_scheduler_configs]
        for change in resume.reapply(self.trainer.optimizers, schedulers, self._configured, self.mode.config_key):
            log.warning("resuming: %s; training on with this run's value", change)

    def on_validation_start(self) -> None:
        self.rollouts.finish_queued()  # the engine is used here: it first finishes what it was given
        self.rollouts.find_sync()
        self.rollouts.attach()
        self.tally = self._new_tally()

    def on_test_start(self) -> None:
        self.rollouts.find_sync()
        self.rollouts.attach()
        self.tally = self._new_tally()

    def _new_tally(self) -> TaskTally | None:
        """An evaluation's metrics per task, when the data names tasks."""
        names = self.task_names()
        return TaskTally(names) if names else None

    # ---- checkpoints say what they are (train/checkpoint.py) ------------------------------------------------------

    def weights_dtype(self) -> str:
        """The dtype the policy's weights are held in during the run: a "-true" precision's, which the strategy's set-up
        converts them to; otherwise ("-mixed" ones, no Trainer) model.dtype's."""
        if self._trainer is None:
            return self.hparams.dtype
        precision = str(self.trainer.precision)
        return {"bf16-true": "bfloat16", "16-true": "float16", "64-true": "float64"}.get(precision, self.hparams.dtype)

    def _stamp(self) -> dict[str, Any]:
        mode = self.mode.stamp()
        return {**stamp(self.weights_dtype(), mode.pop("training")), **mode}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_KEY] = {**self._stamp(), "num_tokens": self.num_tokens, **self.rollouts.state()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Runs before any state is restored. Evaluating or exporting a checkpoint under other settings is fine (its
        # weights load, cast to this run's dtype); resuming training from state taken under other settings is not.
        fitting = self._trainer is not None and self.trainer.state.fn == TrainerFn.FITTING
        saved = checkpoint.get(CHECKPOINT_KEY, {})
        if fitting:
            check_resumable(checkpoint, self._stamp())
            self.num_tokens = saved.get("num_tokens", 0)
        self.rollouts.restore(saved, fitting)
        # This run's settings apply, not the checkpoint's (lightning_logra.cli): say where they differ.
        recorded = checkpoint.get("hyper_parameters", {})
        for key, value in self.hparams.items():
            if key in recorded and recorded[key] != value:
                log.warning("model.%s: the checkpoint was made with %r, this run uses %r", key, recorded[key], value)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        every = self.hparams.export_every
        if every is not None and self.global_step % every == 0:
            self._export_from_every_rank(Path(self.hparams.export_dir) / f"step-{self.global_step:06d}")

    def on_fit_end(self) -> None:
        max_steps = self.trainer.max_steps
        if not self._trained and 0 <= max_steps <= self.global_step:  # Lightning ends such a fit without a word
            log.warning("nothing to train: the checkpoint resumed from has done %d steps, and trainer.max_steps=%d; "
                        "raise trainer.max_steps to train further", self.global_step, max_steps)
        if self.hparams.export_dir is not None:
            self._export_from_every_rank(self.hparams.export_dir)

    def teardown(self, stage: str) -> None:
        self.rollouts.close()
