"""The RLVR LightningModule: rollout → reward → group advantage → micro-batched policy-gradient backward → update.

Manual optimization, because one training step is a whole RL iteration: generate G completions for each prompt of
the batch, score them with a verifiable reward, and accumulate the loss of every micro-batch into one update.
The same module trains densely (any plain strategy: AdamW from `configure_optimizers`) or with sketches
(`SketchStrategy` replaces the optimizers), so baselines compare like with like.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_logra.batch import Rollout
from lightning_logra.checkpoint import KEY as CHECKPOINT_KEY
from lightning_logra.checkpoint import check_resumable, follow_umask, stamp
from lightning_logra.digests import verify_sums, write_sums
from lightning_logra.control import find_controller
from lightning_logra.hashing import prompt_seeds
from lightning_logra.logprobs import completion_logprobs
from lightning_logra.lora import TRAINING as LORA_TRAINING
from lightning_logra.lora import LoRAStrategy
from lightning_logra.loss import (
    LOSS_TYPES,
    LossType,
    group_advantages,
    importance_weights,
    mismatch_metrics,
    token_weights,
)
from lightning_logra.paths import PACKAGE_DIR, check_hub_model, model_path
from lightning_logra import resume
from lightning_logra.rewards import DEFAULT_MEMORY_GIB, Reward, RewardFn, RewardName, resolve_rewards
from lightning_logra.scoring import reward_metrics, reward_tensor
from lightning_logra.rollout import HFEngine, RolloutEngine, SamplingParams
from lightning_logra.schedule import LRSchedule
from lightning_logra.sketch.optim import SketchOptimizer
from lightning_logra.strategy import SketchTraining
from lightning_logra.update import Update, apply_dense_, propose_dense
from lightning_logra.waits import waiting_for

log = logging.getLogger(__name__)


def _check_settings(hp: Any) -> None:
    """The module's settings, checked before any weights are loaded; each error names its key."""
    for key in ("num_generations", "max_new_tokens", "micro_batch_size", "log_completions_every", "export_every",
                "logprob_chunk_tokens"):
        if hp[key] is not None and hp[key] < 1:
            raise ValueError(f"model.{key} must be a positive integer, got {hp[key]}")
    if hp.num_generations < 2:
        raise ValueError("model.num_generations must be at least 2: advantages compare samples of one prompt")
    if hp.temperature <= 0:
        raise ValueError(f"model.temperature must be positive for sampling, got {hp.temperature}")
    if not 0 < hp.top_p <= 1:
        raise ValueError(f"model.top_p must be in (0, 1], got {hp.top_p}")
    if hp.is_cap is not None and hp.is_cap <= 0:
        raise ValueError(f"model.is_cap must be positive (or null to turn the correction off), got {hp.is_cap}")
    if hp.reward_timeout_s is not None and not hp.reward_timeout_s > 0:
        raise ValueError(f"model.reward_timeout_s must be a positive number of seconds (or null: no deadline), "
                         f"got {hp.reward_timeout_s}")
    if hp.max_unlearnable_steps is not None and hp.max_unlearnable_steps < 1:
        raise ValueError(f"model.max_unlearnable_steps must be a positive number of steps (or null: never stop), "
                         f"got {hp.max_unlearnable_steps}")
    if hp.target_modules is not None and not hp.target_modules:
        raise ValueError("model.target_modules is empty: name the linear layers the dense baseline trains, e.g. "
                         "[q_proj, v_proj], or leave it null to train every parameter")
    if hp.loss_type not in LOSS_TYPES:
        raise ValueError(f"model.loss_type must be one of {list(LOSS_TYPES)}, got {hp.loss_type!r}")
    if hp.export_every is not None and hp.export_dir is None:
        raise ValueError("model.export_every needs model.export_dir: the folder the step-NNNNNN exports go into")
    # A hub id is "org/name"; anything else that does not exist locally is a mistyped path.
    if not Path(model_path(hp.model)).exists() and (hp.model.startswith((".", "/", "~")) or hp.model.count("/") > 1):
        raise FileNotFoundError(f"model.model: no such model directory {hp.model!r} (looked for from {Path.cwd()}, "
                                f"and for a `lightning_logra/...` path in the installed package {PACKAGE_DIR})")


class RLVRModule(LightningModule):
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
        scale_rewards: bool = True,
        micro_batch_size: int = 8,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
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
        reward_timeout_s: float | None = 600.0,
        reward_memory_gib: float | None = DEFAULT_MEMORY_GIB,
        max_unlearnable_steps: int | None = None,
        log_completions_every: int | None = 50,
        export_every: int | None = None,
        logprob_chunk_tokens: int | None = 256,
    ) -> None:
        """
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
            loss_type: the policy-gradient loss: `dapo` (token-level mean over the batch), `grpo` (mean per
                sequence, then over sequences) or `dr_grpo` (sum over tokens / (sequences × max_new_tokens)).
            scale_rewards: divide each group's advantages by the group's reward standard deviation (GRPO); false
                only subtracts the group's mean (Dr. GRPO).
            micro_batch_size: completions per forward/backward pass; their gradients accumulate into one update.
            lr: the learning rate of the dense AdamW of a run without a sketch strategy (the baseline); with a
                sketch strategy the CLI refuses it, and `trainer.strategy.init_args.sketch.optimizer.init_args.lr`
                and `sketch.rest_lr` act.
            weight_decay: the dense AdamW's weight decay (the baseline); under a sketch strategy
                `sketch.rest_weight_decay` acts instead.
            lr_schedule: warm-up and decay of the dense AdamW's learning rate, by applied update
                (`lightning_logra.schedule.LRSchedule`); under a sketch strategy `sketch.lr_schedule` acts instead.
            target_modules: the dense baseline trains only the weights of these nn.Linear layers (named as
                `sketch.target_modules`: `q_proj` selects every `...self_attn.q_proj`), the parameters a sketch or
                LoRA run trains, and freezes the rest; None trains every parameter.
            max_grad_norm: clip the norm of all gradients (sketches included: E‖G·Aᵀ‖² = ‖G‖²) before each update.
            eval_temperature: 0 means greedy pass@1 in validate/test.
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
            is_cap: truncated importance sampling: each token's loss is weighted by min(π_θ/π_sampler, is_cap),
                correcting for a sampler whose log-probs differ from the trainer's (another engine, other kernels,
                bf16). None turns the correction off; the mismatch is logged either way.
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
        """
        super().__init__()
        # Before save_hyperparameters, which deep-copies the reward: one that cannot be sent to its process is
        # refused here, naming the key.
        self.rewards: list[Reward] = resolve_rewards(reward, reward_weights, reward_timeout_s, reward_memory_gib)
        self.save_hyperparameters(ignore=["engine"])
        _check_settings(self.hparams)
        self.automatic_optimization = False
        self.unlearnable_steps = 0  # training steps in a row with nothing to learn (max_unlearnable_steps)
        self.sampling = SamplingParams(temperature, top_p, max_new_tokens)
        self.eval_sampling = SamplingParams(eval_temperature, 1.0, eval_max_new_tokens or max_new_tokens)
        self.policy: torch.nn.Module | None = None
        self.tokenizer = None
        self.engine: RolloutEngine | None = engine
        self.lr_schedule = lr_schedule
        self._controller = None  # the run's StepSizeController callback, found when fitting starts
        self.num_tokens = 0  # prompt + completion tokens trained on so far, all ranks (checkpointed)

    # ---- set-up -------------------------------------------------------------------------------------------------

    def configure_model(self) -> None:
        # Loaded here, not in __init__, so that configs can be parsed and checked without loading weights.
        if self.policy is None:
            self._load_policy()
        if not self.engine.samples_from(self.policy):
            if self._trainer is not None and getattr(self.trainer.strategy, "shards_weights", False):
                raise ValueError(
                    f"model.engine: {type(self.engine).__name__} keeps weights of its own, which cannot follow "
                    f"sharded weights yet ({type(self.trainer.strategy).__name__}); use the in-process engine "
                    "(model.engine: null), or SketchDDPStrategy, under which every rank runs an engine of its own")
            if self._trainer is not None and self.trainer.world_size > 1:
                # One engine per rank, beside that rank's trainer: every rank holds the same weights and applies the
                # same update, so each rank's RolloutWeightSync keeps its own engine in step (README: "A vLLM engine
                # per rank").
                self.engine.place(self.global_rank, self.trainer.world_size, self.trainer.strategy.root_device)
            self.engine.start(model_path(self.hparams.model), self._pad_token_id(), self._stop_token_ids())

    def _load_policy(self) -> None:
        path, hp = model_path(self.hparams.model), self.hparams
        if not Path(path).exists():
            check_hub_model(path)
        elif not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(f"model.model: {path!r} has no config.json; point it at a save_pretrained folder")
        else:
            verify_sums(Path(path))  # an export of this project's: its files as they were written
        with waiting_for(f"loading the model {hp.model}", log):  # a hub model may download for minutes first
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.policy = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, hp.dtype)).train()
        if hp.target_modules is not None:
            self._freeze_all_but_targets()
        if hp.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable()
            self.policy.config.use_cache = False
        if self.engine is None:
            self.engine = HFEngine(self.policy, self._stop_token_ids(), self._pad_token_id())

    def _freeze_all_but_targets(self) -> None:
        """The dense baseline on the target matrices only (`model.target_modules`): their weights train, the rest
        (embeddings, norms, biases) is frozen, as a sketch run leaves them."""
        from lightning_logra.sketch.install import select_targets

        try:
            # rank 0: every nn.Linear qualifies (the rank rule is the sketches')
            targets = select_targets(self.policy, self.hparams.target_modules, rank=0)
        except (ValueError, TypeError) as err:
            raise type(err)(f"model.{err}") from None
        trained = {id(linear.weight) for linear in targets.values()}
        for param in self.policy.parameters():
            param.requires_grad_(id(param) in trained)

    def _pad_token_id(self) -> int:
        tokenizer = self.tokenizer
        return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def _stop_token_ids(self) -> list[int]:
        ids = {self.tokenizer.eos_token_id}
        eos = getattr(self.policy.generation_config, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [eos])
        return sorted(i for i in ids if i is not None)

    def configure_optimizers(self):
        # The dense baseline; SketchStrategy replaces it (and its schedule: sketch.lr_schedule).
        params = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        return {"optimizer": optimizer, "lr_scheduler": self.lr_schedule.scheduler(optimizer)}

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
        if context - new_tokens < 1:
            raise ValueError(f"{new_tokens_key}={new_tokens} leaves no room for a prompt in the model's context of "
                             f"{context} tokens ({context_key}): set {new_tokens_key} below {context}, or {longer}")
        return context - new_tokens, f"{context_key}={context}, less {new_tokens_key}={new_tokens}"

    # ---- one RL iteration ---------------------------------------------------------------------------------------

    def encode_prompts(self, prompts: list[str] | list[list[dict[str, str]]]) -> list[list[int]]:
        """The token ids the rollout engine receives for each prompt. A conversation (a list of {"role", "content"}
        messages, TRL's conversational format) goes through the tokenizer's chat template whole, a system message
        included; a text prompt goes in as it is, or as the one user message of a chat with `chat_template`."""
        if not self.hparams.chat_template and all(isinstance(p, str) for p in prompts):
            return self.tokenizer(prompts)["input_ids"]
        chats = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
        return [self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
                for chat in chats]

    def _rollout_and_score(
        self, batch: dict[str, list[Any]], n: int, sampling: SamplingParams, step: int
    ) -> tuple[Rollout, torch.Tensor, torch.Tensor]:
        """Generate n completions per prompt and score them. Returns the rollout, the total rewards (N,) and each
        reward function's rewards (N, F), NaN where it returned None."""
        # Each prompt's sampling depends only on (seed, step, its index in the global batch): a resumed run, or
        # one sharded over several processes, draws what the uninterrupted single-process run would have.
        count = len(batch["prompt"])
        seeds = prompt_seeds(self.hparams.seed, step, self.global_rank * count, count)
        # Token ids come with the batch when the data module tokenized the prompts (data.max_prompt_length).
        batch = dict(batch)
        prompt_ids = batch.pop("prompt_ids", None) or self.encode_prompts(batch["prompt"])
        rollout = self.engine.generate(prompt_ids, n, sampling, seeds).to(self.device)
        # TRL's reward signature: the prompts (whatever the batch's prompt column holds: text, or messages), the
        # completions, their token ids without padding (a stop token included), and every other column, each
        # repeated per sample so that the reward sees lists aligned with the completions.
        mask = rollout.completion_mask.bool().cpu()
        completion_ids = [row[keep].tolist() for row, keep in zip(rollout.completion_ids.cpu(), mask)]
        completions = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        if self.hparams.chat_template or not all(isinstance(prompt, str) for prompt in batch["prompt"]):
            completions = [[{"role": "assistant", "content": text}] for text in completions]  # TRL's conversational form
        columns = {key: [v for v in values for _ in range(n)] for key, values in batch.items()}
        prompts = columns.pop("prompt")
        outputs = [r.fn(prompts, completions, completion_ids=completion_ids, **columns) for r in self.rewards]
        rewards, per_reward, missing, dropped = reward_tensor(outputs, [r.name for r in self.rewards],
                                                              [r.weight for r in self.rewards], count, n)
        name = self._reward_names()
        if missing.all():
            log.warning("model.reward %r gave no usable reward (all None or NaN) for any of the %d completions at "
                        "step %d: nothing is learned from this batch. Check the reward function", name,
                        len(rewards), self.global_step)
        elif dropped.any():
            log.warning("model.reward %r gave NaN or infinite rewards in %d of %d groups at step %d: those groups "
                        "are left out of the update", name, int(dropped.sum()), count, self.global_step)
        if step >= 0:  # a training step
            self._count_unlearnable(rewards.view(count, n))
        return rollout, rewards.to(self.device), per_reward.to(self.device)

    def _reward_names(self) -> str:
        return " + ".join(reward.name for reward in self.rewards)

    def _count_unlearnable(self, groups: torch.Tensor) -> None:
        """Count training steps in a row where no group's rewards differ (every advantage is 0: nothing to learn),
        and stop the run after `max_unlearnable_steps` of them."""
        learnable = (groups.max(1).values > groups.min(1).values).any().float().to(self.device)
        learnable = self.trainer.strategy.reduce(learnable, reduce_op="sum")  # the ranks must stop together
        self.unlearnable_steps = 0 if learnable > 0 else self.unlearnable_steps + 1
        limit = self.hparams.max_unlearnable_steps
        if limit is not None and self.unlearnable_steps >= limit:
            raise RuntimeError(
                f"model.max_unlearnable_steps={limit}: {self.unlearnable_steps} training steps in a row had nothing "
                f"to learn (in every group the rewards were equal, None or NaN). Check model.reward "
                f"{self._reward_names()!r} and the data, or set model.max_unlearnable_steps higher or to null")

    def training_step(self, batch: dict[str, list[Any]], batch_idx: int) -> dict[str, Any]:
        """One RL iteration. Returns {"loss", "update"}: the update applied (an `Update`: low-rank deltas and new
        dense values, what a rollout engine with its own weights needs), or None when the step was skipped. Callbacks
        read it in `on_train_batch_end(outputs=...)`."""
        hp = self.hparams
        step = self.global_step  # of this step (the update below advances it)
        start = time.perf_counter()
        rollout, rewards, per_reward = self._rollout_and_score(batch, hp.num_generations, self.sampling, step)
        generated = time.perf_counter()
        loss, mismatch, entropy = self._backward(rollout, rewards)
        grad_norm, update, alpha = self._update(rollout)
        optimizers = self.optimizers()
        lr = (optimizers[0] if isinstance(optimizers, list) else optimizers).param_groups[0]["lr"]  # this step's η
        self._advance_lr_schedules(applied=update is not None)  # logs train/lr
        elapsed = time.perf_counter() - start
        lengths = rollout.completion_lengths.float()
        terminated = rollout.terminated(self._stop_token_ids()).float()
        groups = rewards.view(-1, hp.num_generations)
        # Prompt + completion tokens of every sample, all ranks (TRL's num_tokens).
        strategy = self.trainer.strategy
        self.num_tokens += int(strategy.reduce((rollout.prompt_mask.sum() + lengths.sum()).float(), reduce_op="sum"))
        metrics = {
            "train/reward_std": rewards.std(),
            "train/frac_reward_zero_std": (groups.std(1) == 0).float().mean(),
            "train/loss": loss,
            "train/grad_norm": grad_norm,
            "train/update_skipped": float(update is None),
            "train/entropy": entropy,  # mean over the tokens trained on (samples with a nonzero advantage)
            "train/num_tokens": float(self.num_tokens),
            # The step actually taken, α·η (NaN when skipped); with a KL budget that binds, α·η = √(δ/q₁).
            "train/effective_lr": alpha * lr,
            "completions/mean_length": lengths.mean(),
            "completions/min_length": lengths.min(),
            "completions/max_length": lengths.max(),
            "completions/terminated_ratio": terminated.mean(),  # ended with a stop token
            "completions/clipped_ratio": 1.0 - terminated.mean(),  # cut at model.max_new_tokens
            "train/tokens_per_s": lengths.sum() / elapsed,
            "train/rollout_s": generated - start,
            "train/step_s": elapsed,
            **mismatch_metrics(mismatch),
            **reward_metrics(per_reward, [reward.key for reward in self.rewards], self.trainer.strategy),
        }
        self.log("train/reward_mean", rewards.mean(), prog_bar=True, batch_size=len(rewards), sync_dist=True)
        self.log_dict(metrics, batch_size=len(rewards), sync_dist=True)
        every = hp.log_completions_every
        if every is not None and step % every == 0:
            self._log_completions(rollout, rewards, step)
        return {"loss": loss, "update": update}

    def _log_completions(self, rollout: Rollout, rewards: torch.Tensor, step: int, count: int = 8) -> None:
        """A few prompts, completions and rewards as a text table (TensorBoard's Text tab), rank 0 only."""
        experiment = getattr(self.logger, "experiment", None)
        if not self.trainer.is_global_zero or not hasattr(experiment, "add_text"):
            return
        rows = torch.arange(min(count, len(rewards)))
        prompts = self.tokenizer.batch_decode(rollout.prompt_ids[rows], skip_special_tokens=True)
        completions = self.tokenizer.batch_decode(rollout.completion_ids[rows], skip_special_tokens=True)

        def cell(text: str) -> str:  # a markdown table cell
            return text.replace("|", "\\|").replace("\n", "<br>")

        table = ["| prompt | completion | reward |", "|---|---|---|"]
        table += [f"| {cell(p)} | {cell(c)} | {float(r):.3g} |" for p, c, r in zip(prompts, completions, rewards)]
        experiment.add_text("completions", "\n".join(table), global_step=step)

    def _backward(self, rollout: Rollout, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Accumulate the gradient of the batch's policy-gradient loss, micro-batch by micro-batch. Returns the
        global batch's loss, the summed sampler/trainer log-prob mismatch (`loss.importance_weights`' stats) and
        the policy's mean token entropy on the tokens trained on (NaN when there were none)."""
        hp = self.hparams
        advantages = group_advantages(rewards, hp.num_generations, hp.scale_rewards)  # (N,), groups stay on one rank
        # Normalize by the global batch's counts, so that gradients summed over ranks are the global loss's.
        strategy = self.trainer.strategy
        total_tokens = strategy.reduce(rollout.completion_mask.sum().float(), reduce_op="sum")
        total_sequences = int(strategy.reduce(torch.tensor(float(len(rewards)), device=self.device), reduce_op="sum"))
        weights = token_weights(rollout.completion_mask, hp.loss_type, hp.max_new_tokens, total_tokens,
                                total_sequences)  # (N, C)
        # A DDP wrapper (the dense baseline on several ranks) averages gradients inside every backward: undo it. The
        # sketch strategies sum them once per step instead (SketchTraining.sum_gradients), and one process needs
        # neither.
        wrapped = isinstance(self.trainer.model, DistributedDataParallel)
        grad_scale = float(self.trainer.world_size) if wrapped else 1.0
        # Under FSDP every forward pass all-gathers weights: every rank must run as many as the others.
        lockstep = wrapped or getattr(strategy, "shards_weights", False)

        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        mismatch = torch.zeros(4, dtype=torch.float32, device=self.device)
        entropy = torch.zeros(2, dtype=torch.float32, device=self.device)  # Σ entropy, tokens: over those trained on
        # A sample with zero advantage contributes exactly zero gradient: leave it out of the backward passes —
        # unless every pass is a collective (a DDP wrapper, FSDP), where all ranks must run the same number of them.
        active = torch.arange(len(rewards), device=self.device) if lockstep else advantages.nonzero().squeeze(-1)
        for rows in active.split(hp.micro_batch_size) if active.numel() else ():
            micro = rollout.select(rows)  # (m, w): right padding trimmed
            # (m, w) each; the (m, w, V) logits exist a chunk of tokens at a time (lightning_logra/logprobs.py)
            logprobs, token_entropy = completion_logprobs(self.policy, micro.prompt_ids, micro.prompt_mask,
                                                          micro.completion_ids, micro.completion_mask,
                                                          hp.temperature, hp.logprob_chunk_tokens)
            is_weight, stats = importance_weights(logprobs.detach(), micro.sampler_logprobs, micro.completion_mask,
                                                  hp.is_cap)  # (m, w), (4,)
            mismatch += stats
            mask = micro.completion_mask
            entropy += torch.stack([(token_entropy * mask).sum(), mask.sum()])
            width = micro.completion_ids.shape[1]
            micro_loss = -(weights[rows, :width] * advantages[rows, None] * is_weight * logprobs).sum()
            self.manual_backward(micro_loss * grad_scale)
            loss += micro_loss.detach()
        entropy_sum, tokens = strategy.reduce(entropy, reduce_op="sum").unbind()
        mismatch = strategy.reduce(mismatch, reduce_op="sum")
        return strategy.reduce(loss, reduce_op="sum"), mismatch, entropy_sum / tokens

    def _update(self, rollout: Rollout) -> tuple[torch.Tensor, Update | None, float]:
        """Sum the gradients over ranks, clip, propose, ask the step-size controller for α, apply. Returns the
        gradient norm before clipping, the update applied (None: the step was skipped, the weights unchanged) and
        the α it was applied at (NaN when skipped)."""
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        inner = [opt.optimizer for opt in optimizers]
        # Only the first optimizer steps through Lightning, so that global_step counts training steps.
        steps = [optimizers[0].step] + [opt.step for opt in inner[1:]]
        grad_norm = self._sum_and_clip([p for opt in inner for group in opt.param_groups for p in group["params"]])
        finite = bool(torch.isfinite(grad_norm))

        sketch = next(((opt, step) for opt, step in zip(inner, steps) if isinstance(opt, SketchOptimizer)), None)
        dense = [(opt, step) for opt, step in zip(inner, steps) if not isinstance(opt, SketchOptimizer)]
        controller = self._controller
        # With a controller, dense steps are proposals until α is chosen: α scales the whole update.
        held = controller is not None and finite
        proposed: dict[torch.Tensor, torch.Tensor] = {}  # {dense parameter: its value after the full step}
        if held:
            for opt, step in dense:
                proposed.update(propose_dense(opt, step))
        names = {p: name for name, p in self.policy.named_parameters()}
        alpha = 1.0
        strategy = self.trainer.strategy

        def choose_alpha(low_rank: dict) -> float:  # asked between propose() and apply()
            nonlocal alpha
            proposal = Update(low_rank, {names[p]: value for p, value in proposed.items()})
            alpha = controller.choose_alpha(self, proposal, rollout)
            return alpha

        taken = finite
        if sketch is not None:
            opt, step = sketch
            # Under FSDP each rank holds its rows of F: the controller is given the whole of it (whole_factors).
            step(alpha=(lambda: choose_alpha(strategy.whole_factors(opt.proposal()))) if controller else 1.0,
                 skip=not finite)
            taken = bool(opt.last_updates)  # the optimizer refuses non-finite sketches, α and factors itself
            # How much of the intended change reached the weights (≈ 1; far below with bf16 rounding to nearest at
            # RL learning rates). NaN on a skipped step: Lightning would repeat the last value.
            self.log("update/landed_fraction", opt.landed_fraction if taken else math.nan)
        elif held:
            taken = math.isfinite(choose_alpha({})) and alpha >= 0
            if not taken:
                log.warning("step size α=%s at step %d: the update is skipped", alpha, self.global_step)
        if held:
            if taken:
                apply_dense_(proposed, alpha)
        else:
            for opt, step in dense:
                if not taken:
                    opt.zero_grad(set_to_none=True)  # parameters without .grad are left alone by AdamW
                step()
        for opt in inner:
            opt.zero_grad(set_to_none=True)
        if not taken:
            return grad_norm, None, math.nan
        return grad_norm, Update(low_rank=strategy.whole_factors(sketch[0].last_updates) if sketch else {},
                                 dense={names[p]: p.detach() for opt, _ in dense
                                        for group in opt.param_groups for p in group["params"]}), alpha

    def _advance_lr_schedules(self, applied: bool) -> None:
        """Log the learning rates this step's update was proposed with (`train/lr`: the sketch optimizer's, or the
        dense baseline's AdamW; `train/rest_lr`: the AdamW of `sketch.train_rest`), then advance the schedules —
        after an applied update only: a skipped one changed no weight, so it spends none of the warm-up or decay."""
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        for key, optimizer in zip(("train/lr", "train/rest_lr"), optimizers):
            self.log(key, optimizer.param_groups[0]["lr"])
        schedulers = self.lr_schedulers()
        if applied and schedulers is not None:
            for scheduler in schedulers if isinstance(schedulers, list) else [schedulers]:
                scheduler.step()

    def _sum_and_clip(self, params: list[torch.Tensor]) -> torch.Tensor:
        """Sum the gradients over ranks (sketch strategies: once per step), then clip them all together; returns
        the norm before clipping (not finite: nothing is clipped and the step will be skipped)."""
        strategy = self.trainer.strategy
        if isinstance(strategy, SketchTraining):
            strategy.sum_gradients(params)  # one all-reduce of the d×r sketches (and dense grads) per step
            self.log_dict(strategy.gradient_sum_metrics())
        with_grad = [p for p in params if p.grad is not None]
        # Sketches too: E‖G·Aᵀ‖² = ‖G‖². The strategy takes the norm over all ranks' parts (FSDP: shards).
        sketching = isinstance(strategy, SketchTraining)
        grad_norm = (strategy.gradient_norm(with_grad) if sketching
                     else torch.nn.utils.get_total_norm([p.grad for p in with_grad]))
        if not torch.isfinite(grad_norm):
            log.warning("non-finite gradient norm at step %d: the whole update is skipped", self.global_step)
        elif self.hparams.max_grad_norm is not None:
            # Parameters, not gradient tensors: torch scales each parameter's .grad (a sketch is the .grad of its
            # layer's carrier B, so sketches are scaled with the dense gradients).
            # (foreach kernels refuse a list mixing sharded DTensor gradients with plain ones: FSDP's replicated head)
            mixed = any(isinstance(p.grad, DTensor) for p in with_grad)
            torch.nn.utils.clip_grads_with_norm_(with_grad, self.hparams.max_grad_norm, grad_norm,
                                                 foreach=False if mixed else None)
        return grad_norm

    # ---- evaluation: pass@1 ---------------------------------------------------------------------------------------

    def _pass_at_1(self, batch: dict[str, list[Any]], stage: str) -> None:
        _, rewards, _ = self._rollout_and_score(batch, 1, self.eval_sampling, step=-1)
        self.log(f"{stage}/pass@1", rewards.mean(), prog_bar=True, batch_size=len(rewards), sync_dist=True)

    def validation_step(self, batch: dict[str, list[Any]], batch_idx: int) -> None:
        self._pass_at_1(batch, "val")

    def test_step(self, batch: dict[str, list[Any]], batch_idx: int) -> None:
        self._pass_at_1(batch, "test")

    # ---- export ---------------------------------------------------------------------------------------------------

    def export(self, path: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Save the policy and tokenizer as a transformers checkpoint (sketched layers keep the original layout);
        `state_dict`: the policy's weights when this process does not hold them whole (gathered from FSDP shards)."""
        self.policy.save_pretrained(path, state_dict=state_dict)
        self.tokenizer.save_pretrained(path)
        follow_umask(Path(path))
        write_sums(Path(path))  # checked when a run loads the folder (`_load_policy`); `sha256sum -c SHA256SUMS` too

    def _export_from_every_rank(self, path: str | Path) -> None:
        """Called on every rank: a sharded policy is gathered first (a collective), and rank 0 writes the folder."""
        strategy = self.trainer.strategy
        state_dict = strategy.whole_policy_state() if isinstance(strategy, SketchTraining) else None
        if self.trainer.is_global_zero:
            self.export(path, state_dict)

    # ---- an engine with weights of its own must be kept in step ---------------------------------------------------

    def _check_engine_is_synced(self) -> None:
        # Without RolloutWeightSync (which sets `on_restart` when it takes the engine over, before this hook runs) an
        # engine with its own copy would sample from the model's initial files forever, silently.
        if self.engine is not None and not self.engine.samples_from(self.policy) and self.engine.on_restart is None:
            raise ValueError(
                f"model.engine: {type(self.engine).__name__} holds weights of its own, and nothing keeps them equal to "
                "the trainer's: add lightning_logra.callbacks.RolloutWeightSync to trainer.callbacks (or set "
                "model.engine: null to generate with the policy itself)"
            )

    def on_fit_start(self) -> None:
        self._check_engine_is_synced()
        # Asked for α between each step's proposal and its application (lightning_logra.control); None: α = 1.
        self._controller = find_controller(self.trainer.callbacks)
        # What the optimizers were built with, before a checkpoint's state replaces it (on_train_start puts it back).
        self._configured = resume.configured(self.trainer.optimizers)
        # The sketch settings beside the module's own hyperparameters, so that runs differ by them in the loggers
        strategy = self.trainer.strategy
        if isinstance(strategy, (SketchTraining, LoRAStrategy)):
            for logger in self.loggers:
                logger.log_hyperparams(strategy.config.hparams())

    def on_train_start(self) -> None:
        # After a resume, the optimizers hold the checkpoint's settings: this run's config wins, and says so.
        schedulers = [config.scheduler for config in self.trainer.lr_scheduler_configs]
        for change in resume.reapply(self.trainer.optimizers, schedulers, self._configured, self._config_key):
            log.warning("resuming: %s; training on with this run's value", change)

    def _config_key(self, index: int, key: str) -> str:
        """Where the config sets setting `key` of optimizer `index` (as `trainer.optimizers` orders them)."""
        strategy = self.trainer.strategy
        if isinstance(strategy, SketchTraining):
            sketch = "trainer.strategy.init_args.sketch"
            if index == 0:
                return f"{sketch}.optimizer.init_args.{key}"
            return {"lr": f"{sketch}.rest_lr", "weight_decay": f"{sketch}.rest_weight_decay"}.get(
                key, f"{sketch}: the AdamW of train_rest / train_bias, {key}")
        if isinstance(strategy, LoRAStrategy):
            return f"trainer.strategy.init_args.lora.{key}"
        return f"model.{key}"

    def on_validation_start(self) -> None:
        self._check_engine_is_synced()

    def on_test_start(self) -> None:
        self._check_engine_is_synced()

    # ---- checkpoints say what they are (lightning_logra.checkpoint) ------------------------------------------------

    def _stamp(self) -> dict[str, Any]:
        precision = str(self.trainer.precision)
        # "-true" precisions hold the weights themselves in that dtype; "-mixed" ones keep model.dtype's
        weights = {"bf16-true": "bfloat16", "16-true": "float16", "64-true": "float64"}.get(precision,
                                                                                          self.hparams.dtype)
        strategy = self.trainer.strategy
        if isinstance(strategy, LoRAStrategy):  # the adapters' settings too: export and resume need them
            return {**stamp(weights, LORA_TRAINING), "lora": strategy.config.record()}
        return stamp(weights, "with sketches" if isinstance(strategy, SketchTraining) else "densely")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_KEY] = {**self._stamp(), "num_tokens": self.num_tokens}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Runs before any state is restored. Evaluating or exporting a checkpoint under other settings is fine (its
        # weights load, cast to this run's dtype); resuming training from state taken under other settings is not.
        if self._trainer is not None and self.trainer.state.fn == TrainerFn.FITTING:
            check_resumable(checkpoint, self._stamp())
            self.num_tokens = checkpoint.get(CHECKPOINT_KEY, {}).get("num_tokens", 0)
        # This run's settings apply, not the checkpoint's (lightning_logra.cli): say where they differ.
        saved = checkpoint.get("hyper_parameters", {})
        for key, value in self.hparams.items():
            if key in saved and saved[key] != value:
                log.warning("model.%s: the checkpoint was made with %r, this run uses %r", key, saved[key], value)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        every = self.hparams.export_every
        if every is not None and self.global_step % every == 0:
            self._export_from_every_rank(Path(self.hparams.export_dir) / f"step-{self.global_step:06d}")

    def on_fit_end(self) -> None:
        if self.hparams.export_dir is not None:
            self._export_from_every_rank(self.hparams.export_dir)

    def teardown(self, stage: str) -> None:
        # An engine with its own processes is stopped between runs; the next run's configure_model restarts it.
        if self.engine is not None and not self.engine.samples_from(self.policy):
            self.engine.close()
