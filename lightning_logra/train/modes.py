"""Training modes: how a run trains its policy — densely (AdamW), with LoGRA sketches, or with LoRA adapters — as one
type that the module's training step calls, picked once per run by `training_mode`, the one place that looks at what
kind of run this is.

After the step's backward passes, whatever the mode:

    reduce_and_clip(max_grad_norm)   sum the gradients over the ranks, clip their total norm; the norm before
    propose(grad_norm, measured)     the update at α = 1 (an `Update`: what a step-size controller measures), or None
                                     when it is skipped (a gradient that is not finite); empty unless `measured`
    apply(α)                         take α of it; the `Update` a rollout engine with weights of its own receives,
                                     or None when nothing reached the weights

Every step makes exactly one step of the first optimizer through Lightning (which counts `global_step`), applied or
skipped. A mode also builds its optimizers, says what a checkpoint records of it and which settings a resume compares
(`stamp`, `config_key`), what it logs (`hparams`, `metrics`), and what a full load of an engine sends
(`engine_tensors`). The distribution of all of this over processes is the strategy's (`strategies.Collectives`).
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_logra.algo.update import Update, apply_dense_, propose_dense
from lightning_logra.sketch.config import CONFIG_KEY as SKETCH_KEY
from lightning_logra.sketch.config import SketchConfig
from lightning_logra.sketch.install import select_targets, sketch_carriers, sketched_layers
from lightning_logra.train import lora
from lightning_logra.train.dense import CONFIG_KEY as DENSE_KEY
from lightning_logra.train.dense import DenseConfig
from lightning_logra.train.lora import CONFIG_KEY as LORA_KEY
from lightning_logra.train.lora import LoRAConfig
from lightning_logra.train.optimizers import OptimizerSpec, build_optimizer
from lightning_logra.train.strategies.base import Collectives

log = logging.getLogger(__name__)

Optimizers = tuple[list[torch.optim.Optimizer], list[torch.optim.lr_scheduler.LRScheduler]]


@dataclass(frozen=True)
class Stepped:
    """An optimizer and what steps it: Lightning's wrapper for a run's first optimizer (its steps are the ones
    Lightning counts as `global_step`), the optimizer's own `step` for the others."""

    optimizer: torch.optim.Optimizer
    step: Callable[..., Any]


class TrainingMode(ABC):
    record: str  # how a checkpoint says its state was trained

    def __init__(self, collectives: Collectives) -> None:
        self.collectives = collectives
        self.metrics: dict[str, float] = {}  # the last step's, beyond the module's own
        self._lightning_optimizers: Callable[[], Any] | None = None
        self._policy: nn.Module | None = None
        self._finite = self._held = False
        self._proposed: dict[torch.Tensor, torch.Tensor] = {}  # {dense parameter: its value at α = 1}, held back

    # ---- set-up ---------------------------------------------------------------------------------------------------

    def install(self, policy: nn.Module, fitting: bool) -> None:
        """Make `policy` trainable this way (in place) before the strategy sets it up; `fitting`: a fit, not an
        evaluation."""
        self._policy = policy

    @abstractmethod
    def build_optimizers(self, policy: nn.Module) -> Optimizers:
        """The optimizers and their learning-rate schedulers (one each), for Lightning to hold and checkpoint."""

    def bind(self, lightning_optimizers: Callable[[], Any]) -> None:
        """The module's `optimizers()`: Lightning's wrappers of the optimizers, the first of which is stepped
        through Lightning (which counts the steps)."""
        self._lightning_optimizers = lightning_optimizers

    def check_settings(self, skeleton: nn.Module | None) -> None:
        """Refuse, naming the key, settings that would fail once the model is loaded, before anything is (`skeleton`:
        the policy on the meta device, or None when its config is not on this machine)."""

    def stamp(self) -> dict[str, Any]:
        """What a checkpoint records of how its state was trained (a resume under another record is refused)."""
        return {"training": self.record}

    def hparams(self) -> dict[str, Any]:
        """The mode's settings for the loggers, beside the module's own."""
        return {}

    @abstractmethod
    def config_key(self, index: int, key: str) -> str:
        """Where the config sets setting `key` (`lr`, `betas`, ...) of optimizer `index`."""

    def engine_tensors(self, policy: nn.Module) -> dict[str, torch.Tensor]:
        """Every tensor a rollout engine with weights of its own holds, by the model's names, as the trainer has
        them: what a full load sends."""
        carriers = sketch_carriers(policy)  # a sketched layer's zero carrier is not a weight of the model's files
        return {name: p.detach() for name, p in policy.named_parameters() if id(p) not in carriers}

    # ---- the step -------------------------------------------------------------------------------------------------

    def _optimizers(self) -> list[Stepped]:
        """Every optimizer of the run with what steps it, the first through Lightning."""
        wrapped = self._lightning_optimizers()
        wrapped = wrapped if isinstance(wrapped, list) else [wrapped]
        return [Stepped(w.optimizer, w.step if i == 0 else w.optimizer.step) for i, w in enumerate(wrapped)]

    def advance_schedules(self, schedulers: Any, applied: bool) -> None:
        """Advance the learning-rate schedules (Lightning's `lr_schedulers()`: one, a list, or None) after an applied
        update only: a skipped one changed no weight, so it spends none of the warm-up or decay."""
        if applied and schedulers is not None:
            for scheduler in schedulers if isinstance(schedulers, list) else [schedulers]:
                scheduler.step()

    def learning_rates(self) -> dict[str, float]:
        """`train/lr`: the learning rate the step's update is proposed with (its first optimizer's)."""
        return {"train/lr": self._optimizers()[0].optimizer.param_groups[0]["lr"]}

    def reduce_and_clip(self, max_grad_norm: float | None) -> torch.Tensor:
        """Sum the gradients over the ranks (once per step), then clip them all together to `max_grad_norm`;
        returns the norm before clipping (not finite: nothing is clipped, and the step will be skipped)."""
        params = [p for stepped in self._optimizers() for group in stepped.optimizer.param_groups
                  for p in group["params"]]
        self.collectives.sum_gradients(params)
        return clip_gradients(params, max_grad_norm, self.collectives)

    def _begin(self, grad_norm: torch.Tensor, measured: bool) -> bool:
        """Whether the step can be taken (its gradient norm is finite); a step a controller measures holds its dense
        steps back until α is chosen."""
        self._finite = bool(torch.isfinite(grad_norm))
        self._held = measured and self._finite
        return self._finite

    def _propose_dense(self, optimizers: list[Stepped]) -> dict[str, Any]:
        """Take the dense optimizers' steps as proposals (held back until α is chosen): {name: value at α = 1}."""
        self._proposed = {}
        for stepped in optimizers:
            self._proposed.update(propose_dense(stepped.optimizer, stepped.step))
        names = {p: name for name, p in self._policy.named_parameters()}
        return {names[p]: value for p, value in self._proposed.items()}

    def _apply_dense(self, optimizers: list[Stepped], alpha: float, taken: bool) -> None:
        """α of the held proposal; or, when none was held (no step-size controller), the optimizers' own steps."""
        if self._held:
            if taken:
                apply_dense_(self._proposed, alpha)
        else:
            for stepped in optimizers:
                if not taken:
                    stepped.optimizer.zero_grad(set_to_none=True)  # parameters without .grad are left alone by AdamW
                stepped.step()
        self._proposed = {}

    def _dense_values(self, optimizers: list[Stepped]) -> dict[str, torch.Tensor]:
        """{name: new value} of every parameter the dense optimizers train: what an engine receives of them."""
        names = {p: name for name, p in self._policy.named_parameters()}
        return {names[p]: p.detach() for stepped in optimizers for group in stepped.optimizer.param_groups
                for p in group["params"]}

    @abstractmethod
    def propose(self, grad_norm: torch.Tensor, measured: bool) -> Update | None:
        """The step's update at α = 1 (empty unless `measured`: only a step-size controller needs it), or None
        when it is skipped; after `reduce_and_clip`."""

    @abstractmethod
    def apply(self, alpha: float) -> Update | None:
        """Take α of the proposal (a step that was skipped, or an α that is not a finite non-negative number,
        changes nothing and returns None); the gradients are dropped either way."""


class _DenseSteps(TrainingMode):
    """A mode whose every optimizer steps parameters densely (AdamW, or the strategy's `optimizer`): their steps are
    held back as the proposal when a controller measures it, and taken at α."""

    def __init__(self, collectives: Collectives, optimizer: OptimizerSpec | None) -> None:
        super().__init__(collectives)
        self.optimizer = optimizer

    def stamp(self) -> dict[str, Any]:
        # A checkpoint of a run with an `optimizer` records its class: another's state would be misread on resume
        # (AdamW, the default, records nothing, as checkpoints always did).
        stamp = super().stamp()
        return stamp if self.optimizer is None else {**stamp, "optimizer": self.optimizer.class_path}

    def hparams(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {}
        return {"optimizer": self.optimizer.class_path,
                **{f"optimizer_{k}": v for k, v in self.optimizer.init_args.items()}}

    def _optimizer_key(self, key: str, otherwise: str) -> str:
        """Where the config sets `key` of the optimizer: the `optimizer`'s init_args when they set it (or when it is
        a setting of its own), else the mode's key `otherwise`."""
        mode_sets_it = self.optimizer is None or (key in ("lr", "weight_decay") and key not in self.optimizer.init_args)
        return otherwise if mode_sets_it else f"{self.optimizer.key}.init_args.{key}"

    def propose(self, grad_norm: torch.Tensor, measured: bool) -> Update | None:
        if not self._begin(grad_norm, measured):
            return None
        return Update(dense=self._propose_dense(self._optimizers())) if self._held else Update()

    def apply(self, alpha: float) -> Update | None:
        optimizers = self._optimizers()
        taken = self._finite and math.isfinite(alpha) and alpha >= 0
        if self._finite and not taken:
            log.warning("step size α=%s: the update is skipped", alpha)
        self._apply_dense(optimizers, alpha, taken)
        for stepped in optimizers:
            stepped.optimizer.zero_grad(set_to_none=True)
        return Update(dense=self._dense_values(optimizers)) if taken else None


class DenseMode(_DenseSteps):
    """Every parameter (all of them, or the target matrices' weights) by AdamW, or by the optimizer the
    `DenseConfig` names: the baseline, and the peer optimizers the benchmarks compare."""

    record = "densely"

    def __init__(self, collectives: Collectives, config: DenseConfig) -> None:
        super().__init__(collectives, config.optimizer_spec())
        self.config = config
        self.lr, self.weight_decay, self.target_modules = config.lr, config.weight_decay, config.target_modules
        self.lr_schedule = config.lr_schedule

    def install(self, policy: nn.Module, fitting: bool) -> None:
        super().install(policy, fitting)
        if self.target_modules is None:
            return
        # Only the weights of these nn.Linear layers train, the rest (embeddings, norms, biases) is frozen, as a
        # sketch run leaves them. (rank 0: every nn.Linear qualifies; the rank rule is the sketches'.)
        trained = {id(linear.weight) for linear in self._select(policy).values()}
        for param in policy.parameters():
            param.requires_grad_(id(param) in trained)

    def _select(self, policy: nn.Module) -> dict[str, nn.Linear]:
        """The target matrices' layers (rank 0: every nn.Linear qualifies; the rank rule is the sketches')."""
        try:
            return select_targets(policy, self.target_modules, rank=0)
        except (ValueError, TypeError) as err:
            raise type(err)(f"{DENSE_KEY}.{err}") from None

    def build_optimizers(self, policy: nn.Module) -> Optimizers:
        params = [p for p in policy.parameters() if p.requires_grad]
        optimizer = build_optimizer(self.optimizer, policy, params, self.lr, self.weight_decay)
        return [optimizer], [self.lr_schedule.scheduler(optimizer)]

    def config_key(self, index: int, key: str) -> str:
        return self._optimizer_key(key, f"{DENSE_KEY}.{key}")

    def hparams(self) -> dict[str, Any]:
        return {**self.config.hparams(), **super().hparams()}

    def check_settings(self, skeleton: nn.Module | None) -> None:
        if skeleton is not None and self.target_modules is not None:
            self._select(skeleton)


class LoRAMode(_DenseSteps):
    """peft LoRA adapters on the target matrices, trained by AdamW (to the step, densely trained parameters); what
    an engine receives of a step is each adapted matrix's change as a low-rank delta (`lora.low_rank_deltas`)."""

    record = lora.TRAINING

    def __init__(self, collectives: Collectives, config: LoRAConfig) -> None:
        super().__init__(collectives, config.optimizer_spec())
        self.config = config
        self._before: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # the adapters at the step's start

    def install(self, policy: nn.Module, fitting: bool) -> None:
        # In every stage, not only fit: a LoRA checkpoint's state holds the adapters (and peft's `base_layer` names),
        # so validate / test with it need them in place; fresh adapters (B = 0) leave the policy's outputs unchanged.
        super().install(policy, fitting)
        if not lora.adapted_layers(policy):
            self.config.install(policy)

    def build_optimizers(self, policy: nn.Module) -> Optimizers:
        params = [p for layer in lora.adapted_layers(policy).values() for p in lora.adapter_parameters(layer)]
        optimizer = build_optimizer(self.optimizer, policy, params, self.config.lr, self.config.weight_decay)
        return [optimizer], [self.config.lr_schedule.scheduler(optimizer)]

    def check_settings(self, skeleton: nn.Module | None) -> None:
        if skeleton is not None:
            self.config.check_targets(skeleton)

    def stamp(self) -> dict[str, Any]:
        return {**super().stamp(), "lora": self.config.record()}  # the adapters' settings: export and resume need them

    def hparams(self) -> dict[str, Any]:
        return {**self.config.hparams(), **super().hparams()}

    def config_key(self, index: int, key: str) -> str:
        return self._optimizer_key(key, f"{LORA_KEY}.{key}")

    def engine_tensors(self, policy: nn.Module) -> dict[str, torch.Tensor]:
        return lora.engine_tensors(policy)  # each adapted matrix merged, under its own name

    def propose(self, grad_norm: torch.Tensor, measured: bool) -> Update | None:
        self._before = lora.adapter_snapshot(self._policy)
        return super().propose(grad_norm, measured)

    def apply(self, alpha: float) -> Update | None:
        applied = super().apply(alpha)
        if applied is None:
            return None
        return Update(lora.low_rank_deltas(self._policy, self._before))  # rank 2r per adapted matrix


class SketchMode(TrainingMode):
    """LoGRA: the target matrices by their d×r sketches and a sketch optimizer (the first optimizer), with the
    biases of those layers and every other parameter, when `train_bias` / `train_rest`, by an AdamW (the second)."""

    record = "with sketches"

    def __init__(self, collectives: Collectives, config: SketchConfig) -> None:
        super().__init__(collectives)
        self.config = config
        self.handles: dict = {}  # the sketched layers, by name

    def install(self, policy: nn.Module, fitting: bool) -> None:
        super().install(policy, fitting)
        if fitting:  # an evaluation runs the model as it is
            self.handles = sketched_layers(policy) or self.config.install(policy)

    def build_optimizers(self, policy: nn.Module) -> Optimizers:
        optimizers = self.config.build_optimizers(policy, self.handles)
        return optimizers, self.config.build_schedulers(optimizers)

    def check_settings(self, skeleton: nn.Module | None) -> None:
        if skeleton is not None:
            self.config.check_targets(skeleton)

    def hparams(self) -> dict[str, Any]:
        return self.config.hparams()

    @property
    def sketch_optimizer(self) -> Stepped:
        """The sketch optimizer (SketchSGD, SketchAdam, ...): the run's first, stepped through Lightning."""
        return self._optimizers()[0]

    @property
    def dense_optimizers(self) -> list[Stepped]:
        """The AdamW of `train_rest` / `train_bias`, when either is set (else none)."""
        return self._optimizers()[1:]

    def learning_rates(self) -> dict[str, float]:
        rates = {"train/lr": self.sketch_optimizer.optimizer.param_groups[0]["lr"]}
        for stepped in self.dense_optimizers:
            rates["train/rest_lr"] = stepped.optimizer.param_groups[0]["lr"]
        return rates

    def config_key(self, index: int, key: str) -> str:
        if index == 0:
            return f"{SKETCH_KEY}.optimizer.init_args.{key}"
        return {"lr": f"{SKETCH_KEY}.rest_lr", "weight_decay": f"{SKETCH_KEY}.rest_weight_decay"}.get(
            key, f"{SKETCH_KEY}: the AdamW of train_rest / train_bias, {key}")

    def propose(self, grad_norm: torch.Tensor, measured: bool) -> Update | None:
        if not self._begin(grad_norm, measured):
            return None
        dense = self._propose_dense(self.dense_optimizers) if self._held else {}
        sketch = self.sketch_optimizer.optimizer
        if not sketch.propose():  # (a sketch that is not finite: it dropped the step itself)
            self._finite = False
            return None
        if not measured:
            return Update()
        # Under FSDP each rank holds its rows of F: the controller is given the whole of it.
        return Update(self.collectives.whole_factors(sketch.proposal()), dense)

    def apply(self, alpha: float) -> Update | None:
        sketch, dense = self.sketch_optimizer, self.dense_optimizers
        # The step Lightning counts: α of the pending proposal, or the step dropped (the optimizer refuses a
        # non-finite α or factor itself, and a proposal it already dropped applies nothing).
        sketch.step(alpha=alpha, skip=not self._finite)
        sketch = sketch.optimizer
        taken = bool(sketch.last_updates)
        # How much of the intended change reached the weights (≈ 1; far below with bf16 rounding to nearest at RL
        # learning rates). NaN on a skipped step.
        self.metrics = {"update/landed_fraction": sketch.landed_fraction if taken else math.nan}
        self._apply_dense(dense, alpha, taken)
        sketch.zero_grad(set_to_none=True)
        for stepped in dense:
            stepped.optimizer.zero_grad(set_to_none=True)
        if not taken:
            return None
        return Update(self.collectives.whole_factors(sketch.last_updates), self._dense_values(dense))


def clip_gradients(params: list[torch.Tensor], max_norm: float | None, collectives: Collectives) -> torch.Tensor:
    """Scale the gradients of `params` together so that their total norm is at most `max_norm` (None: leave them);
    returns the norm before. Sketches count as gradients (E‖G·Aᵀ‖² = ‖G‖²), so the limit means what it means for
    dense ones; the collectives take the norm over all ranks' parts (FSDP: shards). A norm that is not finite
    clips nothing (the step will be skipped)."""
    with_grad = [p for p in params if p.grad is not None]
    norm = collectives.gradient_norm(with_grad)
    if not torch.isfinite(norm):
        log.warning("non-finite gradient norm: the whole update is skipped")
    elif max_norm is not None:
        # Parameters, not gradient tensors: torch scales each parameter's .grad (a sketch is the .grad of its layer's
        # carrier B, so sketches are scaled with the dense gradients). foreach kernels refuse a list mixing sharded
        # DTensor gradients with plain ones (FSDP's replicated head).
        mixed = any(isinstance(p.grad, DTensor) for p in with_grad)
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, norm, foreach=False if mixed else None)
    return norm


def training_mode(strategy: Any, collectives: Collectives) -> TrainingMode:
    """The run's training mode, by the settings its strategy carries: a `SketchConfig` trains with sketches, a
    `LoRAConfig` with adapters, a `DenseConfig` densely; Lightning's own strategies, carrying none, train densely
    with `DenseConfig`'s defaults."""
    config = getattr(strategy, "config", None)
    if isinstance(config, SketchConfig):
        return SketchMode(collectives, config)
    if isinstance(config, LoRAConfig):
        return LoRAMode(collectives, config)
    return DenseMode(collectives, config if isinstance(config, DenseConfig) else DenseConfig())
