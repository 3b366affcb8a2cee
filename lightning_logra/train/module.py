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
from dataclasses import fields, is_dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.trainer.states import TrainerFn

from lightning_logra.algo.advantages import group_advantages
from lightning_logra.algo.step_size import StepContext, StepSizeController, find_controller
from lightning_logra.algo.update import Update
from lightning_logra.base.batch import Rollout
from lightning_logra.callbacks.export import PolicyExport
from lightning_logra.episodes.metrics import environment_rewards
from lightning_logra.episodes.settings import EpisodeSettings
from lightning_logra.paths import PACKAGE_DIR, model_path
from lightning_logra.rewards import Reward, RewardFn, RewardName, resolve_rewards, reward_setting
from lightning_logra.rewards.scoring import UnlearnableSteps, reward_metrics, score
from lightning_logra.rollout import RolloutEngine, SamplingParams
from lightning_logra.train import resume
from lightning_logra.train.checkpoint import KEY as CHECKPOINT_KEY
from lightning_logra.train.checkpoint import check_resumable, follow_umask, stamp
from lightning_logra.train.digests import write_sums
from lightning_logra.train.dynamic_sampling import Drawn, DynamicSampling
from lightning_logra.train.evaluation import sample_metrics
from lightning_logra.train.modes import TrainingMode, training_mode
from lightning_logra.train.objective import PolicyGradient, TruncationMask
from lightning_logra.train.policy import completions_table, encode_prompts, load_policy, load_reference, stop_token_ids
from lightning_logra.train.rollouts import Rollouts
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
from lightning_logra.train.step_metrics import reward_mean, rollout_metrics, step_tokens, task_rewards
from lightning_logra.train.step_times import StepTimes
from lightning_logra.train.strategies.base import Collectives, collectives_of
from lightning_logra.train.task_metrics import TaskTally, task_index

log = logging.getLogger(__name__)

EVAL_STEP = -1  # the step an evaluation's prompts are seeded with: apart from every training step's


def completion_token_lists(rollout: Rollout) -> list[list[int]]:
    """Each completion's token ids without padding (its stop token included)."""
    mask = rollout.completion_mask.bool().cpu()
    return [row[keep].tolist() for row, keep in zip(rollout.completion_ids.cpu(), mask)]


def check_penalty_placement(beta: float, collectives: Collectives) -> None:
    """The KL penalty's reference is a whole copy of the weights in every process: refused where the weights are
    sharded (it would undo what sharding saves)."""
    if beta > 0 and collectives.shards_weights:
        raise ValueError(
            f"model.loss.beta={beta}: the KL penalty's reference model would be a whole, unsharded copy of the weights "
            "on every rank under SketchFSDPStrategy; train with SketchDDPStrategy, or set model.loss.beta 0")


class RLVRModule(LightningModule):
    """RLVR on a causal language model: each training step generates, scores, and trains every selected weight
    (`training_step`); validate and test sample and score (`evaluate`). How the weights train (dense, LoGRA's
    sketches, LoRA) and with which optimizer is the Trainer's strategy's; where the samples come from, `Rollouts`.

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
        # The groups as built (a dict given by hand made into its dataclass); a reward function by name (checkpoints
        # hold none); the engine is a live object, kept apart.
        self.save_hyperparameters({"model": model, "reward": reward_setting(reward), "dtype": dtype,
                                   "chat_template": chat_template, **groups,
                                   "rollouts": without_engine(groups["rollouts"]), "episodes": episodes})
        _check_model(model)
        self.automatic_optimization = False
        sampling, evaluation = groups["sampling"], groups["evaluation"]
        self.sampling = SamplingParams(sampling.temperature, sampling.top_p, sampling.max_new_tokens)
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
        self.rollouts = Rollouts(self, groups["rollouts"].engine)
        # An evaluation set's metrics per task, summed over its batches (data whose rows name their task)
        self.tally: TaskTally | None = None

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
        self.rollouts.start_engine()

    def configure_callbacks(self) -> list[Callback]:
        export = self.hparams.export
        return [] if export.dir is None else [PolicyExport(export.dir, export.every)]

    @property
    def engine(self) -> RolloutEngine | None:
        """The rollout engine (`model.rollouts.engine`; once set up, the in-process one when none was given)."""
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

    def completion_tokens(self) -> int:
        """The most completion-side tokens of a training sample: an episode's, or one completion's."""
        episodes, max_new_tokens = self.hparams.episodes, self.hparams.sampling.max_new_tokens
        return episodes.tokens(max_new_tokens) if episodes is not None else max_new_tokens

    def prompt_token_limit(self, stage: str) -> tuple[int, str] | None:
        """The longest prompt, in tokens, that leaves room in the model's context for the completions of `stage`
        ("fit": model.sampling.max_new_tokens; "validate", "test": the evaluation's), with where the limit comes from
        (for the data module's messages). The context is the engine's max_model_len when set, else the policy's
        max_position_embeddings; None when neither states one. The data module asks for it when
        data.max_prompt_length is unset: a prompt past the context would grow generation's memory without bound."""
        max_model_len = self.engine.max_model_len() if self.engine is not None else None
        if max_model_len is not None:
            context, context_key, longer = max_model_len, "model.rollouts.engine's max_model_len", "raise it"
        else:
            context = getattr(self.policy.config, "max_position_embeddings", None)
            context_key, longer = "model.model's max_position_embeddings", "use a model with a longer one"
            if context is None:  # a model without a fixed context (state-space models)
                return None
        evaluating = stage != "fit" and self.hparams.evaluation.max_new_tokens is not None
        new_tokens_key = "model.evaluation.max_new_tokens" if evaluating else "model.sampling.max_new_tokens"
        new_tokens = (self.sampling if stage == "fit" else self.eval_sampling).max_new_tokens
        if self.hparams.episodes is not None:  # an episode's turns and answers follow the prompt
            new_tokens_key, new_tokens = "model.episodes.max_tokens", self.completion_tokens()
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
        n = hp.sampling.num_generations
        rollout, version, waited = self.rollouts.draw(batch, step)  # the step's samples, drawn with `version`'s weights
        times.took("wait", waited)
        rewards, per_reward = self.score(batch, rollout, n)  # (N,), (N, rewards)
        times.lap("score")
        drawn = Drawn(batch, rollout, rewards, per_reward, torch.full_like(rewards, float(step - version)))
        sampled: dict[str, float] = {}
        if hp.rollouts.dynamic_sampling:  # more rounds until the batch's groups are learnable (time counts as waiting)
            drawn, sampled = self.dynamic_sampling().fill(drawn, partial(self.rollouts.draw_round, step))
            times.lap("wait")
        batch, rollout, rewards, per_reward = drawn.batch, drawn.rollout, drawn.rewards, drawn.per_reward
        self.unlearnable.add(rewards.view(-1, n), self.sum_over_ranks)
        advantages = group_advantages(rewards, n, hp.loss.scale_rewards, self.sum_over_ranks)  # (N,)
        trained = self.trained_tokens(rollout)  # model.loss.mask_truncated_completions: cut ones count for nothing
        loss, mismatch, metrics = self.accumulate_gradients(trained, advantages)
        grad_norm = self.mode.reduce_and_clip(hp.training.max_grad_norm)
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
            **task_rewards(self.task_names(), batch.get("task", []), rollout, rewards, n, self.sum_over_ranks),
            **mismatch, **self.mode.metrics, **self.collectives.reduction_metrics(), **synced, **controlled})
        return {"loss": loss, "update": update}

    def dynamic_sampling(self) -> DynamicSampling:
        hp = self.hparams
        return DynamicSampling(hp.rollouts.max_generation_rounds, hp.sampling.num_generations, self.global_rank,
                               self.trainer.world_size, self.sum_over_ranks, self.device)

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

    def accumulate_gradients(self, rollout: Rollout, advantages: torch.Tensor
                             ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The gradient of the batch's loss into the parameters' .grad (`PolicyGradient.accumulate`)."""
        return self.objective().accumulate(rollout, advantages)

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

    def step_size(self, proposal: Update | None, rollout: Rollout, step: int,
                  positions: torch.Tensor | None) -> float:
        """α for the proposal: the controller's, 1 without one, NaN when there is nothing to take (skipped).
        `positions`: where the rows stand in one process's batch (dynamic sampling's `Drawn.positions`)."""
        if proposal is None:
            return math.nan
        if self.controller is None:
            return 1.0
        context = StepContext(self.policy, self.hparams.sampling.temperature, step, self.global_rank,
                              self.trainer.world_size, self.sum_over_ranks, positions)
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
        """Log this step's learning rates (`train/lr`: the sketch optimizer's or the dense one's; `train/rest_lr`: the
        AdamW of `sketch.train_rest`), then advance the schedules — after an applied update only: a skipped one
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

    def log_step(self, rollout: Rollout, rewards: torch.Tensor, per_reward: torch.Tensor, step: int, step_s: float,
                 metrics: dict[str, Any]) -> None:
        """The step's metrics (`train.step_metrics`), and every `rollouts.log_completions_every` steps a few
        completions as text."""
        hp = self.hparams
        self.num_tokens += step_tokens(rollout, self.sum_over_ranks)
        metrics = {**rollout_metrics(rollout, rewards, hp.sampling.num_generations, self.stop_token_ids(), step_s),
                   "train/num_tokens": float(self.num_tokens),
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

    # ---- evaluation: pass@1, or pass@k, mean@k and maj@k (train/evaluation.py) ----------------------------------

    def evaluate(self, batch: dict[str, list[Any]], stage: str) -> None:
        """`model.evaluation.num_samples` completions of each prompt at its temperature, scored: `<stage>/pass@1`
        for one, and with more, pass@k for k = 1, 2, 4, … and mean@k, maj@k (`evaluation.sample_metrics`); for data
        whose rows name their task, each also per task at the set's end (`<stage>/<task>/pass@1`)."""
        n = self.hparams.evaluation.num_samples
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

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_KEY] = {**stamp(self.weights_dtype(), self.mode.stamp()), "num_tokens": self.num_tokens,
                                      **self.rollouts.state()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Runs before any state is restored. Evaluating or exporting a checkpoint under other settings is fine (its
        # weights load, cast to this run's dtype); resuming training from state taken under other settings is not.
        fitting = self._trainer is not None and self.trainer.state.fn == TrainerFn.FITTING
        saved = checkpoint.get(CHECKPOINT_KEY, {})
        if fitting:
            check_resumable(checkpoint, stamp(self.weights_dtype(), self.mode.stamp()))
            self.num_tokens = saved.get("num_tokens", 0)
        self.rollouts.restore(saved, fitting)
        # This run's settings apply, not the checkpoint's (lightning_logra.cli): say where they differ.
        for key, (recorded, value) in _changed_settings(checkpoint.get("hyper_parameters", {}), self.hparams).items():
            log.warning("model.%s: the checkpoint was made with %r, this run uses %r", key, recorded, value)

    def on_fit_end(self) -> None:
        max_steps = self.trainer.max_steps
        if not self._trained and 0 <= max_steps <= self.global_step:  # Lightning ends such a fit without a word
            log.warning("nothing to train: the checkpoint resumed from has done %d steps, and trainer.max_steps=%d; "
                        "raise trainer.max_steps to train further", self.global_step, max_steps)

    def teardown(self, stage: str) -> None:
        self.rollouts.close()


def _changed_settings(recorded: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{key: (recorded, current)} for each setting that differs, a group's by field (`loss.beta`)."""
    changed = {}
    for key, value in current.items():
        if key not in recorded or recorded[key] == value:
            continue
        before = recorded[key]
        if is_dataclass(value) and is_dataclass(before):
            for field in fields(value):
                old, new = getattr(before, field.name, None), getattr(value, field.name)
                if old != new:
                    changed[f"{key}.{field.name}"] = (old, new)
        else:
            changed[key] = (before, value)
    return changed


def _check_model(model: str) -> None:
    """A hub id is "org/name"; anything else that does not exist locally is a mistyped path."""
    if not Path(model_path(model)).exists() and (model.startswith((".", "/", "~")) or model.count("/") > 1):
        raise FileNotFoundError(f"model.model: no such model directory {model!r} (looked for from {Path.cwd()}, "
                                f"and for a `lightning_logra/...` path in the installed package {PACKAGE_DIR})")
