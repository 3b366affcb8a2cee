"""The RLVR LightningModule: one training step is one RL iteration, read top to bottom in `training_step`.

Manual optimization, because one step generates G completions for each prompt of the batch, scores them with
verifiable rewards, and accumulates the loss of every micro-batch into one update (`train.objective`). What is trained
and how (densely, with LoGRA sketches, with LoRA adapters) is the run's training mode (`lightning_logra.train.modes`),
picked from its strategy; the step size is the run's `StepSizeController` (the predicted-KL budget), and an engine
with weights of its own is kept in step by the run's `WeightSync`: each a component the step calls, found among the
callbacks. The settings come in groups (`train.settings`).
"""

from __future__ import annotations

import logging
import math
from functools import partial
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.trainer.states import TrainerFn

from lightning_logra.algo.advantages import group_advantages
from lightning_logra.algo.kl import StateRecorder
from lightning_logra.algo.step_size import StepContext, StepSizeController, find_controller
from lightning_logra.algo.update import Update
from lightning_logra.base.batch import Rollout
from lightning_logra.callbacks.export import PolicyExport
from lightning_logra.episodes.settings import EpisodeSettings
from lightning_logra.rewards import Reward, RewardFn, RewardName, resolve_rewards, reward_setting
from lightning_logra.rewards.scoring import UnlearnableSteps, reward_metrics
from lightning_logra.rollout import RolloutEngine, SamplingParams, find_sync
from lightning_logra.train import resume
from lightning_logra.train.checkpoint import StampedCheckpoints
from lightning_logra.train.context import prompt_token_limit
from lightning_logra.train.dynamic_sampling import Drawn, DynamicSampling
from lightning_logra.train.evaluation import EvaluationSteps
from lightning_logra.train.modes import TrainingMode, training_mode
from lightning_logra.train.objective import PolicyGradient, TruncationMask
from lightning_logra.train.policy import (
    PromptCodec,
    check_model_path,
    check_penalty_placement,
    completions_table,
    encode_prompts,
    load_policy,
    load_reference,
)
from lightning_logra.train.sample_source import Placement, SampleSource, sequences_per_call
from lightning_logra.train.scoring import score_rollout
from lightning_logra.train.settings import (
    GROUPS,
    EvalSettings,
    ExportSettings,
    LossSettings,
    RolloutSettings,
    SamplingSettings,
    ScoringSettings,
    TrainingSettings,
    as_group,
    without_engine,
)
from lightning_logra.train.step_metrics import reward_mean, rollout_metrics, task_rewards
from lightning_logra.train.step_times import StepTimes
from lightning_logra.train.strategies.base import Collectives, collectives_of
from lightning_logra.train.throughput import Throughput

log = logging.getLogger(__name__)

class RLVRModule(EvaluationSteps, StampedCheckpoints, LightningModule):
    """RLVR on a causal language model: each training step generates, scores, and trains every selected weight
    (`training_step`); validate and test sample and score (`evaluate`). How the weights train (dense, LoGRA's
    sketches, LoRA) and with which optimizer is the Trainer's strategy's; where the samples come from, `SampleSource`.

    Args:
        model: a transformers causal LM: a local directory or a hub name. A path inside the package
            (`lightning_logra/data/tiny_arith`, the embedded model) is found from any working directory.
        reward: a built-in reward name (`exact_match`, `math_answer`), a dotted path to a function
            `fn(prompts, completions, completion_ids, **columns) -> list[float | None]` (TRL's reward signature), or
            a component, `class_path` and `init_args`, whose instances are called so; or a list of these, whose
            rewards are summed with `scoring.weights`. The parser checks them before anything runs.
        dtype: the dtype the policy's weights are loaded in (`bfloat16` with `trainer.precision: bf16-true`).
        chat_template: wrap each text prompt as a user message with the tokenizer's chat template (a conversational
            prompt, a list of messages, always goes through it); rewards then get each completion in conversational
            form, `[{"role": "assistant", "content": text}]`, as TRL passes it.
        sampling: how the training rollouts are sampled (`SamplingSettings`).
        loss: the policy-gradient objective (`LossSettings`).
        training: how each step's backward passes run (`TrainingSettings`).
        scoring: how the rewards are combined and run (`ScoringSettings`).
        evaluation: how validate and test sample (`EvalSettings`).
        rollouts: the engine, staleness and the sampler correction (`RolloutSettings`).
        episodes: multi-turn episodes with tools or an environment (`EpisodeSettings`); None: one completion per
            prompt.
        export: transformers folders of the policy during and at the end of fit (`ExportSettings`).
    """

    def __init__(
        self,
        model: str,
        # The list first: writing the config back out, the parser takes the first type a value fits, and a list
        # "fits" RewardFn as an unimportable path. (So `--model.reward pkg.Class --model.reward.arg v` parses as a
        # list of one: the same reward.)
        reward: list[RewardName | RewardFn] | RewardName | RewardFn = "exact_match",
        dtype: Literal["float32", "bfloat16"] = "float32",
        chat_template: bool = False,
        sampling: SamplingSettings = SamplingSettings(),
        loss: LossSettings = LossSettings(),
        training: TrainingSettings = TrainingSettings(),
        scoring: ScoringSettings = ScoringSettings(),
        evaluation: EvalSettings = EvalSettings(),
        rollouts: RolloutSettings = RolloutSettings(),
        episodes: EpisodeSettings | None = None,
        export: ExportSettings = ExportSettings(),
    ) -> None:
        super().__init__()
        given = {"sampling": sampling, "loss": loss, "training": training, "scoring": scoring,
                 "evaluation": evaluation, "rollouts": rollouts, "export": export}
        groups = {name: as_group(kind, given[name], name) for name, kind in GROUPS.items()}
        episodes = None if episodes is None else as_group(EpisodeSettings, episodes, "episodes")
        scoring = groups["scoring"]
        # Before save_hyperparameters, which deep-copies the reward: one that cannot be sent to its process is
        # refused here, naming the key.
        self.rewards: list[Reward] = resolve_rewards(reward, scoring.weights, scoring.timeout_s, scoring.memory_gib)
        # The arguments as given (the command line's: a reward component as its class_path and init_args), then the
        # groups as built (a dict given by hand made into its dataclass), a reward function by name (checkpoints hold
        # none), and the rollout settings without the engine, a live object.
        self.save_hyperparameters(ignore=["rollouts"])
        self.save_hyperparameters({**self.hparams, "reward": reward_setting(self.hparams["reward"]), **groups,
                                   "rollouts": without_engine(groups["rollouts"]), "episodes": episodes})
        check_model_path(model)
        self.automatic_optimization = False
        sampling, evaluation = groups["sampling"], groups["evaluation"]
        self.eval_sampling = SamplingParams(evaluation.temperature, 1.0,
                                            evaluation.max_new_tokens or sampling.max_new_tokens)
        self.policy: torch.nn.Module | None = None
        # π_0 for the KL penalty (model.loss.beta > 0), loaded for a fit by configure_model; never a submodule (below).
        self.reference: torch.nn.Module | None = None
        self.tokenizer = None
        self.unlearnable = UnlearnableSteps(scoring.max_unlearnable_steps, self.rewards)
        self.truncation = TruncationMask(groups["loss"].mask_truncated_completions, sampling.max_new_tokens)
        self.num_tokens = 0  # prompt + completion tokens trained on so far, all ranks (checkpointed)
        # The run's components, found when it is set up: how it trains, over how many processes and who chooses α
        # (None: α = 1); and where its samples come from: the engine, its weight sync, overlapped rollouts.
        self.mode: TrainingMode | None = None
        self.collectives: Collectives = Collectives()
        self.controller: StepSizeController | None = None
        self.throughput: Throughput | None = None  # perf/* (made at fit start, on the policy's device)
        self.step_times: StepTimes | None = None  # the last training step's
        self.samples = SampleSource(groups["rollouts"].engine, groups["rollouts"], sampling, episodes)
        self.sampling = self.samples.sampling  # the training rollouts' sampling parameters
        self.codec: PromptCodec | None = None  # the tokenizer's part in generation, once the policy is loaded

    # ---- set-up -------------------------------------------------------------------------------------------------

    def configure_model(self) -> None:
        # Loaded here, not in __init__, so that configs can be parsed and checked without loading weights.
        hp = self.hparams
        trainer = self._trainer
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if fitting:  # before any weights are loaded (the CLI checks it before the processes start, too)
            check_penalty_placement(hp.loss.beta, collectives_of(trainer))
        if self.policy is None:
            self.policy, self.tokenizer = load_policy(hp.model, hp.dtype, hp.training.gradient_checkpointing)
        # Without a Trainer (a module built to export or evaluate by hand) the policy is set up as the dense baseline.
        if trainer is not None:
            self.collectives = collectives_of(trainer)
        if hp.loss.beta > 0 and fitting and self.reference is None:
            # Straight onto the strategy's device and into the dtype the policy's weights will have: the strategy's
            # set-up, which comes after this hook, moves and converts only registered submodules. And not one of
            # those: nn.Module.__setattr__ registers any module assigned to an attribute, which would put the
            # reference into the checkpoint's state_dict, the parameters an optimizer or FSDP could collect, and
            # Lightning's model.train() at fit start; object.__setattr__ keeps it a plain attribute.
            reference = load_reference(hp.model, self.weights_dtype(), trainer.strategy.root_device)
            object.__setattr__(self, "reference", reference)
        self.mode = training_mode(trainer and trainer.strategy, self.collectives)
        self.mode.install(self.policy, fitting=fitting)
        self.mode.bind(self.optimizers)
        self.codec = PromptCodec.of(self.tokenizer, self.policy, hp.chat_template)
        # (the log folder is asked for only where an engine may launch processes that log: a collective under DDP)
        log_dir = trainer.log_dir if trainer is not None and self.samples.engine is not None else None
        placement = Placement(device=self.device) if trainer is None else Placement(
            self.global_rank, trainer.world_size, trainer.strategy.root_device, log_dir)
        self.samples.bind(self.codec, self.collectives, placement)
        sequences = sequences_per_call(trainer, hp.sampling, hp.evaluation, fitting)  # sizes vLLM's KV cache
        self.samples.start_engine(self.policy, hp.model, sequences)

    def configure_callbacks(self) -> list[Callback]:
        export = self.hparams.export
        return [] if export.dir is None else [PolicyExport(export.dir, export.every)]

    @property
    def engine(self) -> RolloutEngine | None:
        """The rollout engine (`model.rollouts.engine`; once set up, the in-process one when none was given)."""
        return self.samples.engine

    @engine.setter
    def engine(self, engine: RolloutEngine | None) -> None:
        self.samples.engine = engine

    def engine_tensors(self) -> dict[str, torch.Tensor]:
        """What a full load of an engine with weights of its own sends (the training mode's `engine_tensors`)."""
        return self.mode.engine_tensors(self.policy)

    def configure_optimizers(self):
        return self.mode.build_optimizers(self.policy)

    def stop_token_ids(self) -> list[int]:
        return self.codec.stop_token_ids

    def encode_prompts(self, prompts: list[str] | list[list[dict[str, str]]]) -> list[list[int]]:
        """The token ids the rollout engine receives for each prompt (`policy.encode_prompts`)."""
        return encode_prompts(self.tokenizer, prompts, self.hparams.chat_template)

    def completion_tokens(self) -> int:
        """The most completion-side tokens of a training sample: an episode's, or one completion's."""
        episodes, max_new_tokens = self.hparams.episodes, self.hparams.sampling.max_new_tokens
        return episodes.tokens(max_new_tokens) if episodes is not None else max_new_tokens

    def prompt_token_limit(self, stage: str) -> tuple[int, str] | None:
        """The longest prompt that leaves room for `stage`'s completions, and where the limit comes from
        (`context.prompt_token_limit`; the data module asks for it)."""
        hp = self.hparams
        new_tokens = (self.sampling if stage == "fit" else self.eval_sampling).max_new_tokens
        return prompt_token_limit(stage, self.engine, self.policy, new_tokens, hp.evaluation.max_new_tokens,
                                  self.completion_tokens() if hp.episodes is not None else None)

    # ---- one RL iteration ---------------------------------------------------------------------------------------

    def training_step(self, batch: dict[str, list[Any]], batch_idx: int) -> dict[str, Any]:
        """One RL iteration, in order: generate (or take what was generated ahead) and score, advantages, gradients,
        reduce and clip, propose, the step size α, apply, sync the engine, log. Returns {"loss", "update"}: the update
        applied (what a rollout engine with weights of its own receives), or None when the step was skipped (the
        weights unchanged)."""
        hp, step, times = self.hparams, self.global_step, StepTimes()
        self.step_times = times  # read by MemoryProfiler for the memory of each part
        n = hp.sampling.num_generations
        rollout, version, waited = self.samples.draw(batch, step)  # the step's samples, drawn with `version`'s weights
        times.took("wait", waited)
        rewards, per_reward = self.score(batch, rollout, n)  # (N,), (N, rewards)
        times.lap("score")
        drawn = Drawn(batch, rollout, rewards, per_reward, torch.full_like(rewards, float(step - version)))
        sampled: dict[str, float] = {}
        if hp.rollouts.dynamic_sampling:  # more rounds until the batch's groups are learnable (time counts as waiting)
            rounds = DynamicSampling(hp.rollouts.max_generation_rounds, n, self.global_rank, self.trainer.world_size,
                                     self.sum_over_ranks, self.device)
            drawn, sampled = rounds.fill(drawn, partial(self.draw_round, step))
            times.lap("wait")
        batch, rollout, rewards, per_reward = drawn.batch, drawn.rollout, drawn.rewards, drawn.per_reward
        self.unlearnable.add(rewards.view(-1, n), self.sum_over_ranks)
        advantages = group_advantages(rewards, n, hp.loss.scale_rewards, self.sum_over_ranks)  # (N,)
        trained = self.trained_tokens(rollout)  # model.loss.mask_truncated_completions: cut ones count for nothing
        context = StepContext(self.policy, hp.sampling.temperature, step, self.global_rank, self.trainer.world_size,
                              self.sum_over_ranks, drawn.positions)
        # the rows the KL check measures keep their states from the update's forward passes
        context.recorded = self.controller.recorder(trained, context) if self.controller is not None else None
        loss, mismatch, metrics = self.accumulate_gradients(trained, advantages, context.recorded)
        grad_norm = self.mode.reduce_and_clip(hp.training.max_grad_norm)
        proposal = self.mode.propose(grad_norm, measured=self.controller is not None)  # None: skipped
        alpha = self.step_size(proposal, trained, context)
        lr = self.mode.learning_rates()["train/lr"]  # this step's η, before the schedule advances
        update = self.mode.apply(alpha)  # None: nothing reached the weights
        times.lap("update")
        self.log_dict(self.mode.learning_rates())  # train/lr (the sketch optimizer's or the dense one's), rest_lr
        self.mode.advance_schedules(self.lr_schedulers(), applied=update is not None)
        synced = self.samples.sync(update, float(mismatch["rollout/logprob_abs_diff"]), stale=version < step)
        times.lap("sync")
        controlled = self.controller.applied(update) if self.controller is not None else {}
        self.log_step(rollout, rewards, per_reward, step, times.elapsed(), {
            "train/loss": loss, "train/grad_norm": grad_norm, **metrics,
            "train/update_skipped": float(update is None),
            # The step actually taken, α·η (NaN when skipped); with a KL budget that binds, α·η = √(δ/q₁).
            "train/effective_lr": alpha * lr if update is not None else math.nan,
            **times.metrics(), **self.samples.staleness_metrics(drawn.staleness, rollout), **sampled,
            **task_rewards(self.task_names(), batch.get("task", []), rollout, rewards, n, self.sum_over_ranks),
            **mismatch, **self.mode.metrics, **self.collectives.reduction_metrics(), **synced, **controlled})
        return {"loss": loss, "update": update}

    def draw_round(self, step: int, round: int) -> Drawn:
        """Round `round` ≥ 1 of the step's dynamic sampling: the data module's extra prompts, generated now with the
        trainer's weights, and scored."""
        batch = self.trainer.datamodule.extra_batch(step, round)
        rollout = self.samples.draw_now(batch, step, round)
        rewards, per_reward = self.score(batch, rollout, self.hparams.sampling.num_generations)
        return Drawn(batch, rollout, rewards, per_reward, torch.zeros_like(rewards))

    def trained_tokens(self, rollout: Rollout) -> Rollout:
        """The rollout as the loss sees it (`objective.TruncationMask`)."""
        return self.truncation(rollout, self.stop_token_ids())

    def objective(self) -> PolicyGradient:
        """The step's policy-gradient objective over this process's policy (`train.objective`)."""
        hp = self.hparams
        return PolicyGradient(self.policy, self.reference, hp.loss, hp.training, hp.rollouts,
                              hp.sampling.temperature, self.completion_tokens(), self.manual_backward,
                              self.sum_over_ranks, self.max_over_ranks, self.collectives.lockstep,
                              self.collectives.loss_scale)

    def accumulate_gradients(self, rollout: Rollout, advantages: torch.Tensor,
                             recorder: StateRecorder | None = None
                             ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The gradient of the batch's loss into the parameters' .grad (`PolicyGradient.accumulate`)."""
        return self.objective().accumulate(rollout, advantages, recorder)

    def generate(self, batch: dict[str, list[Any]], n: int, sampling: SamplingParams, step: int) -> Rollout:
        """n completions of each prompt of `batch`, on this process's device (`SampleSource.engine_call`)."""
        return self.samples.generate(batch, n, sampling, step)

    def score(self, batch: dict[str, list[Any]], rollout: Rollout, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rewards of the rollout's completions (n per prompt of `batch`; `scoring.score_rollout`)."""
        return score_rollout(self.rewards, self.codec, self.samples.episodes, batch, rollout, n, self.global_step)

    def step_size(self, proposal: Update | None, rollout: Rollout, context: StepContext) -> float:
        """α for the proposal: the controller's, 1 without one, NaN when there is nothing to take (skipped)."""
        if proposal is None:
            return math.nan
        if self.controller is None:
            return 1.0
        return self.controller.choose_alpha(proposal, rollout, context)

    def sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        return self.collectives.sum_over_ranks(value)

    def max_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        return self.collectives.max_over_ranks(values)

    def task_names(self) -> list[str]:
        """The tasks the data's rows belong to (`RLVRDataModule.task_names`); empty: one task."""
        datamodule = self.trainer.datamodule
        return datamodule.task_names() if hasattr(datamodule, "task_names") else []

    def log_step(self, rollout: Rollout, rewards: torch.Tensor, per_reward: torch.Tensor, step: int, step_s: float,
                 metrics: dict[str, Any]) -> None:
        """The step's metrics (`train.step_metrics`), and every `rollouts.log_completions_every` steps a few
        completions as text."""
        hp = self.hparams
        perf, tokens = self.throughput.metrics(rollout, self.sum_over_ranks, step_s, metrics)
        self.num_tokens += tokens
        metrics = {**rollout_metrics(rollout, rewards, hp.sampling.num_generations, self.stop_token_ids(), step_s),
                   "train/num_tokens": float(self.num_tokens), **perf,
                   **reward_metrics(per_reward, [reward.key for reward in self.rewards], self.trainer.strategy),
                   **metrics}
        self.log("train/reward_mean", reward_mean(rollout, rewards, self.sum_over_ranks), prog_bar=True,
                 batch_size=len(rewards))
        self.log_dict(metrics, batch_size=len(rewards), sync_dist=True)
        every = hp.rollouts.log_completions_every
        experiment = getattr(self.logger, "experiment", None)
        if every is not None and step % every == 0 and self.trainer.is_global_zero and hasattr(experiment, "add_text"):
            shown = slice(0, 8)  # a few prompts, completions and rewards, rank 0's
            table = completions_table(self.tokenizer, rollout.prompt_ids[shown], rollout.completion_ids[shown],
                                      rewards[shown])
            experiment.add_text("completions", table, global_step=step)

    # ---- the run's components -------------------------------------------------------------------------------------

    def on_fit_start(self) -> None:
        if self.hparams.rollouts.dynamic_sampling and not hasattr(self.trainer.datamodule, "extra_batch"):
            raise ValueError("model.rollouts.dynamic_sampling draws its extra prompts from the data module's training "
                             "set: give a data module of lightning_logra.data (data.class_path), or set "
                             "model.rollouts.dynamic_sampling: false")
        clash = set(self.task_names()) & {reward.key for reward in self.rewards}
        if clash:
            raise ValueError(f"data: the tasks {sorted(clash)} have the names of rewards of model.reward, and "
                             "reward/<name>/mean would log both: rename the reward function or class")
        # Asked for α between each step's proposal and its application (lightning_logra.algo.step_size).
        self.controller = find_controller(self.trainer.callbacks)
        self.throughput = Throughput(self.policy, self.device)
        self.samples.use_sync(find_sync(self.trainer.callbacks), self.policy)
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
        self.samples.attach(self.engine_tensors)
        max_steps = self.trainer.max_steps
        self.samples.start(lambda: iter(self.trainer.train_dataloader), self.global_step,
                           last_step=max_steps - 1 if max_steps > 0 else None)
        # After a resume, the optimizers hold the checkpoint's settings: this run's config wins, and says so.
        schedulers = [config.scheduler for config in self.trainer.lr_scheduler_configs]
        for change in resume.reapply(self.trainer.optimizers, schedulers, self._configured, self.mode.config_key):
            log.warning("resuming: %s; training on with this run's value", change)

    def on_fit_end(self) -> None:
        max_steps = self.trainer.max_steps
        if not self._trained and 0 <= max_steps <= self.global_step:  # Lightning ends such a fit without a word
            log.warning("nothing to train: the checkpoint resumed from has done %d steps, and trainer.max_steps=%d; "
                        "raise trainer.max_steps to train further", self.global_step, max_steps)

    def teardown(self, stage: str) -> None:
        self.samples.close(self.policy)

