"""Sketch optimizers: turn each layer's sketch S (d×r) into a direction U (d×r) and merge W ← W − α·η·U·A.

A step is split in two so that the predicted-KL controller can choose α between them:
  propose()   checks every sketch is finite, computes U from S and updates the d×r state;
  apply(α)    merges α·η·U·A into each W in place, zeroes the sketches and returns, per weight, the
              `LowRankDelta` (F = α·η·U and A's seed) that a rollout engine needs to make the same change.
`step(alpha=...)` applies the pending proposal (proposing first if none is pending), so these are ordinary
`torch.optim.Optimizer`s for Lightning, LR schedulers and checkpoints; their parameters are the layers' zero
`sketch_param`s, whose `.grad` is the sketch.

Projection refresh: with `refresh_every = N`, after every N applied updates each layer switches to the
projection of the next refresh index (a new seed). The state (momentum, Adam moments and the step count used
for bias correction) is *reset* at a refresh: it lives in the coordinates of the old A, and while a first
moment could be carried over through A_old·A_newᵀ, Adam's elementwise second moment has no such linear map.
The paper's default is a fixed projection (`refresh_every=None`).

Low-precision weights: the merge rounds W − F·A into bf16/fp16 stochastically (`rounding="stochastic"`), keyed by
the layer's seed and `updates`, the count of applied updates, which is checkpointed and sent with every sync so
the engine rounds the same way. `factor_dtype` is the dtype F is rounded to before it is merged *and* sent, so the
trainer merges exactly what the engine receives. Every apply measures on a sample of entries how much of the
intended change reached the weights (`landed_fraction`, ≈ 1 when updates land; rounding to nearest at RL
learning rates gives a few percent) and warns when it stays low.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

import torch

from lightning_logra.base.hashing import counter_uniform
from lightning_logra.base.settings import check_positive
from lightning_logra.sketch.linear import SketchedLinear
from lightning_logra.sketch.rounding import LOW_PRECISION, check_rounding, rounding_key
from lightning_logra.sketch.update import LowRankDelta, apply_low_rank_update_

log = logging.getLogger(__name__)

FACTOR_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
Rounding = Literal["stochastic", "nearest"]
FactorDtype = Literal["float32", "bfloat16"]
Layers = Mapping[str, SketchedLinear] | Iterable[SketchedLinear]
_PROBE_ENTRIES = 1024  # entries per matrix sampled to measure the landed fraction
_LANDED_WARNING = (20, 0.5)  # warn when the mean landed fraction over this many updates is below this


class SketchOptimizer(torch.optim.Optimizer):
    """Base class; subclasses define `_direction(S, state, group) -> U` and `state_tensors_per_layer()`.

    A new sketch optimizer is one subclass in one file: its constructor takes the layers first, then its own
    hyperparameters (typed: configs are checked against them), then `refresh_every`, `rounding` and
    `factor_dtype`, which it hands to this class. A config selects it like any component:

        sketch:
          optimizer:
            class_path: my_package.MySketchOptimizer
            init_args: {lr: 1.0e-5, my_setting: 3}

    Common settings (all subclasses):
        refresh_every: switch every layer to a new projection after this many applied updates (None: fixed A).
        rounding: how a merge rounds into bf16/fp16 weights ("stochastic": unbiased, a no-op for fp32 weights;
            "nearest" loses most of each update at RL learning rates). See `lightning_logra/sketch/rounding.py`.
        factor_dtype: the dtype F = α·η·U is rounded to before it is merged and sent to a rollout engine
            ("bfloat16" halves the sync).
    """

    def __init__(
        self,
        layers: Layers,
        defaults: dict,
        refresh_every: int | None = None,
        rounding: Rounding = "stochastic",
        factor_dtype: FactorDtype = "float32",
    ) -> None:
        layers = list(layers.values()) if isinstance(layers, Mapping) else list(layers)
        if not layers:
            raise ValueError(f"{type(self).__name__}: no sketched layers given (install_sketches first)")
        check_positive("refresh_every", refresh_every, "number of updates", integer=True, null="a fixed projection")
        check_positive("lr", defaults["lr"], "learning rate")
        check_rounding(rounding)
        if factor_dtype not in FACTOR_DTYPES:
            raise ValueError(f"factor_dtype must be one of {list(FACTOR_DTYPES)}, got {factor_dtype!r}")
        self.refresh_every = refresh_every
        self.rounding, self.factor_dtype = rounding, FACTOR_DTYPES[factor_dtype]
        self.updates = 0  # applied updates since training began: keys the stochastic rounding (checkpointed)
        self.landed_fraction = math.nan  # of the last applied update, measured on a sample of entries
        self._landed_history: list[float] = []
        self._warned_landed = False
        self.skipped_steps = 0
        # The last applied step per weight name ("<layer>.weight"): F = α·η·U and the seed of the A it was merged with.
        self.last_updates: dict[str, LowRankDelta] = {}
        self._layer_of = {layer.sketch_param: layer for layer in layers}
        self._proposal: dict[torch.Tensor, torch.Tensor] | None = None
        self._dropped = False  # this step was dropped (skip()) before step() was called
        super().__init__([layer.sketch_param for layer in layers], defaults)

    @property
    def layers(self) -> list[SketchedLinear]:
        return [self._layer_of[p] for group in self.param_groups for p in group["params"]]

    def _direction(self, sketch: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        raise NotImplementedError

    def state_tensors_per_layer(self) -> int:
        """How many d×r fp32 state tensors this optimizer keeps per layer (for memory accounting)."""
        raise NotImplementedError

    @torch.no_grad()
    def propose(self) -> bool:
        """Compute U for every layer and advance the state. False (and nothing changed) if a sketch is not finite."""
        self.last_updates = {}
        layers = self.layers
        # one sync, not one per layer
        finite = torch.stack([torch.isfinite(layer.sketch_rows()).all() for layer in layers])
        if not bool(finite.all()):
            bad = [layer.name for layer, ok in zip(layers, finite.tolist()) if not ok]
            self.skip(f"non-finite sketch in {bad}")
            return False
        self._proposal = {}
        for group in self.param_groups:
            for p in group["params"]:
                # Only the layer's own rows: under FSDP each rank keeps state (rows, r) for its shard alone.
                self._proposal[p] = self._direction(self._layer_of[p].sketch_rows(), self._state_of(p), group)
        return True

    def _state_of(self, p: torch.Tensor) -> dict:
        """The carrier's optimizer state, started (no updates since a refresh) the first time it is asked for."""
        state = self.state[p]
        if not state:
            state["step"] = 0  # updates since the last refresh
            state["refresh_index"] = self._layer_of[p].refresh_index
        return state

    @torch.no_grad()
    def materialize_state(self) -> None:
        """Create every layer's state that does not exist yet as a first proposal from a zero sketch would (zeros,
        step 0), changing nothing else: a sharded checkpoint's state is then loaded into it in place."""
        for group in self.param_groups:
            for p in group["params"]:
                if not self.state[p]:
                    self._direction(torch.zeros_like(self._layer_of[p].sketch_rows()), self._state_of(p), group)

    def skip(self, reason: str) -> None:
        """Drop this step's sketches and proposal without touching the weights; count and report it. (Skipped in
        apply(), the d×r state has already taken this step's finite sketch, as propose() computed it.)"""
        self._dropped = True
        self.skipped_steps += 1
        self.last_updates = {}
        log.warning("%s: update skipped (%d skipped so far)", reason, self.skipped_steps)
        for layer in self.layers:
            layer.zero_sketch()
        self._proposal = None

    def proposal(self) -> dict[str, LowRankDelta]:
        """The pending proposal per weight name: F = η·U (d, r) with A's seed, i.e. Δ = −η·U·A at α = 1 (under FSDP
        the layer's `rows` of F only; lightning_logra.train.strategies.fsdp gathers the whole of it)."""
        if self._proposal is None:
            raise RuntimeError("no pending proposal: call propose() first")
        proposal = {}
        for group in self.param_groups:
            for p in group["params"]:
                layer = self._layer_of[p]
                proposal[f"{layer.name}.weight"] = LowRankDelta(group["lr"] * self._proposal[p], layer.seed,
                                                                layer.distribution, layer.in_features)
        return proposal

    @torch.no_grad()
    def apply(self, alpha: float = 1.0) -> dict[str, LowRankDelta]:
        """Merge W ← W − α·η·U·A for the pending proposal; zero the sketches; return what was merged per weight
        name: F = α·η·U (d, r) in `factor_dtype`, A's seed, and the key of the rounding (also `last_updates`).
        Each layer merges its `rows` of F into its `local_weight()` (all of W, or under FSDP the rank's shard), with
        the rounding bits those rows have in the whole matrix."""
        if self._proposal is None:
            raise RuntimeError("no pending proposal: call propose() first (or it was skipped)")
        # The last line of defence: whatever chose α, a non-finite step never reaches the weights.
        if not (math.isfinite(alpha) and alpha >= 0):
            self.skip(f"non-finite or negative step scale α={alpha}")
            return {}
        # F in the dtype it travels in: the engine merges exactly this, so the trainer does too.
        pending = {p: ((alpha * group["lr"]) * self._proposal[p]).to(self.factor_dtype)  # (d, r)
                   for group in self.param_groups for p in group["params"]}
        finite = torch.stack([torch.isfinite(f).all() for f in pending.values()])  # one sync, not one per layer
        if not bool(finite.all()):
            self.skip(f"non-finite update factor α·η·U (α={alpha})")
            return {}
        landed, intended = [], []  # per layer, on the weights' device: summed once at the end (one sync)
        for group in self.param_groups:
            for p in group["params"]:
                layer = self._layer_of[p]
                factor = pending[p]
                stochastic = self.rounding == "stochastic" and layer.weight.dtype in LOW_PRECISION
                # the matrix's own seed: matrices that share A (share_projection) still draw bits of their own
                key = rounding_key(layer.own_seed, self.updates) if stochastic else None
                projection = layer.projection()
                weight = layer.local_weight()  # (rows, k)
                rows, cols = self._probe(layer)
                before = weight[rows, cols].double()
                apply_low_rank_update_(weight, factor, projection, key, first_row=layer.rows.start)
                change = (factor[rows].double() * projection[:, cols].T.double()).sum(-1)  # (F·A) at the probe
                landed.append(-((weight[rows, cols].double() - before) * change).sum())  # W moves by −F·A
                intended.append((change**2).sum())
                layer.zero_sketch()
                self.state[p]["step"] += 1
                # recorded before a refresh below moves the layer to its next seed
                self.last_updates[f"{layer.name}.weight"] = LowRankDelta(factor, layer.seed, layer.distribution,
                                                                         layer.in_features, key)
        self.updates += 1
        landed, intended = float(torch.stack(landed).sum()), float(torch.stack(intended).sum())
        self._record_landed(landed / intended if intended > 0 else math.nan)
        self._proposal = None
        self._maybe_refresh()
        return self.last_updates

    def _probe(self, layer: SketchedLinear) -> tuple[torch.Tensor, torch.Tensor]:
        """A few entries of the layer's W[rows] (local row indices), new at each update: where the landed fraction is
        measured."""
        d, k = len(range(layer.out_features)[layer.rows]), layer.in_features
        if d == 0:  # a rank whose shard of this matrix is empty (d < world size)
            none = torch.zeros(0, dtype=torch.int64, device=layer.weight.device)
            return none, none
        keys = torch.arange(_PROBE_ENTRIES, dtype=torch.int64) + rounding_key(layer.own_seed ^ 1, self.updates)
        flat = (counter_uniform(keys) * (d * k)).long().clamp(max=d * k - 1).to(layer.weight.device)
        return flat // k, flat % k

    def _record_landed(self, fraction: float) -> None:
        """Keep the last measurements; warn once when updates have stopped landing in the weights."""
        self.landed_fraction = fraction
        count, threshold = _LANDED_WARNING
        self._landed_history = (self._landed_history + [fraction])[-count:]
        mean = sum(self._landed_history) / len(self._landed_history)
        if len(self._landed_history) == count and mean < threshold and not self._warned_landed:
            self._warned_landed = True
            log.warning(
                "only %.0f%% of each sketch update reached the weights on average over the last %d updates "
                "(landed fraction %.3f): %s weights round the small updates away. Use sketch.optimizer.rounding: "
                "stochastic, or fp32 weights (precision bf16-mixed / 32-true), or a larger learning rate.",
                100 * mean, count, mean, str(self.layers[0].weight.dtype).removeprefix("torch."),
            )

    def _maybe_refresh(self) -> None:
        if self.refresh_every is None:
            return
        for p, state in self.state.items():
            if state["step"] >= self.refresh_every:
                refresh_index = state["refresh_index"] + 1
                state.clear()
                state["step"] = 0
                state["refresh_index"] = refresh_index
                self._layer_of[p].set_refresh_index(refresh_index)

    @torch.no_grad()
    def step(self, closure=None, alpha: float = 1.0, skip: bool = False):
        """Apply α of the pending proposal, proposing first if none is pending (propose() + apply(α), as any
        optimizer's step). `skip=True` (the caller found a non-finite gradient elsewhere) drops the step instead. A
        step whose proposal propose() already dropped applies nothing. A skipped step still counts as a step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if skip:
            if not self._dropped:
                self.skip("non-finite gradient")
        elif self._proposal is not None or (not self._dropped and self.propose()):
            self.apply(alpha)
        self._dropped = False
        return loss

    def settings(self) -> dict:
        """What the state is only valid under: the optimizer and, per layer, the projection it lives in."""
        return {
            "optimizer": type(self).__name__,
            "refresh_every": self.refresh_every,
            "layers": {layer.name: {"rank": layer.rank, "seed": layer.base_seed, "distribution": layer.distribution,
                                    "projection": layer.projection_name}
                       for layer in self.layers},
        }

    def state_dict(self) -> dict:
        return {**super().state_dict(), "updates": self.updates, "sketch": self.settings()}

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        saved = state_dict.pop("sketch", None)
        if saved is None:
            log.warning("the checkpoint's sketch optimizer state does not say which sketch settings it was taken "
                        "under (an older checkpoint): resuming without checking them")
        else:
            _check_same_sketch(saved, self.settings())
        self.updates = state_dict.pop("updates", 0)
        super().load_state_dict(state_dict)
        # The refresh index is part of the optimizer's state; the layers must use the matching projection.
        for p, state in self.state.items():
            if "refresh_index" in state and self._layer_of[p].refresh_index != state["refresh_index"]:
                self._layer_of[p].set_refresh_index(state["refresh_index"])


def _check_same_sketch(saved: dict, current: dict) -> None:
    """Refuse to resume state taken under other sketch settings: Adam moments of one projection's coordinates mean
    nothing in another's, and a different rank or optimizer does not even fit."""
    differences = []
    if saved["optimizer"] != current["optimizer"]:
        differences.append(f"sketch.optimizer: checkpoint {saved['optimizer']}, this run {current['optimizer']}")
    if saved["refresh_every"] != current["refresh_every"]:
        differences.append(f"sketch.optimizer.refresh_every: checkpoint {saved['refresh_every']}, "
                           f"this run {current['refresh_every']}")
    if sorted(saved["layers"]) != sorted(current["layers"]):
        differing = sorted(set(saved["layers"]) ^ set(current["layers"]))[:2]
        differences.append(f"sketch.target_modules: checkpoint sketches {len(saved['layers'])} matrices, this run "
                           f"{len(current['layers'])} (e.g. {differing})")
    else:
        for key in ("rank", "seed", "distribution"):
            values = {(layer[key], current["layers"][name][key]) for name, layer in saved["layers"].items()}
            differences += [f"sketch.{key}: checkpoint {old}, this run {new}" for old, new in sorted(values, key=str)
                            if old != new]
        # A checkpoint written before projections could be shared names none: each layer had its own.
        shared = [any(layer.get("projection", name) != name for name, layer in settings["layers"].items())
                  for settings in (saved, current)]
        if shared[0] != shared[1]:
            differences.append(f"sketch.share_projection: checkpoint {str(shared[0]).lower()}, "
                               f"this run {str(shared[1]).lower()}")
    if differences:
        raise ValueError(
            "cannot resume: the checkpoint's sketch optimizer state was taken under other sketch settings ("
            + "; ".join(differences) + "). Resume with the checkpoint's settings, or start a new run from its "
            "weights (export them, then train with the new settings)."
        )


class SketchSGD(SketchOptimizer):
    """U = S, or heavy-ball momentum M ← β·M + S, U = M (as torch.optim.SGD with dampening 0)."""

    def __init__(self, layers: Layers, lr: float, momentum: float = 0.0, refresh_every: int | None = None,
                 rounding: Rounding = "stochastic", factor_dtype: FactorDtype = "float32") -> None:
        """
        Args:
            lr: η, the learning rate of the sketched matrices.
            momentum: heavy-ball momentum β in [0, 1); 0 steps along the sketch itself.
            refresh_every: a new projection A (and a fresh state) every this many applied updates; None keeps A
                fixed (the paper's default).
            rounding: how merges round into bf16/fp16 weights: `stochastic` (unbiased; a no-op for fp32) or
                `nearest` (loses most of each update at RL learning rates).
            factor_dtype: the dtype of F = α·η·U, merged and sent to a rollout engine (`bfloat16` halves the sync).
        """
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        super().__init__(layers, dict(lr=lr, momentum=momentum), refresh_every, rounding, factor_dtype)

    def _direction(self, sketch, state, group):
        # No copies: apply() drops the sketch by setting .grad to None (never zeroes it in place), and the
        # momentum buffer only changes at the next propose(), so U stays valid until apply() has used it.
        if group["momentum"] == 0.0:
            return sketch
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = sketch.clone()  # (d, r)
        else:
            state["momentum_buffer"].mul_(group["momentum"]).add_(sketch)
        return state["momentum_buffer"]

    def state_tensors_per_layer(self) -> int:
        return 0 if all(g["momentum"] == 0.0 for g in self.param_groups) else 1


class SketchAdam(SketchOptimizer):
    """Adam on the sketch coordinates: m, v (d×r each), bias-corrected; U = m̂ / (√v̂ + ε)."""

    def __init__(
        self,
        layers: Layers,
        lr: float = 1e-5,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        refresh_every: int | None = None,
        rounding: Rounding = "stochastic",
        factor_dtype: FactorDtype = "float32",
    ) -> None:
        """
        Args:
            lr: η, the learning rate of the sketched matrices.
            betas: the decay rates of Adam's first and second moments, each in [0, 1).
            eps: added to √v̂ in the denominator.
            refresh_every: a new projection A (and a fresh state) every this many applied updates; None keeps A
                fixed (the paper's default).
            rounding: how merges round into bf16/fp16 weights: `stochastic` (unbiased; a no-op for fp32) or
                `nearest` (loses most of each update at RL learning rates).
            factor_dtype: the dtype of F = α·η·U, merged and sent to a rollout engine (`bfloat16` halves the sync).
        """
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        check_positive("eps", eps)
        super().__init__(layers, dict(lr=lr, betas=tuple(betas), eps=eps), refresh_every, rounding, factor_dtype)

    def _direction(self, sketch, state, group):
        beta1, beta2 = group["betas"]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(sketch)  # (d, r)
            state["exp_avg_sq"] = torch.zeros_like(sketch)  # (d, r)
        t = state["step"] + 1  # this proposal's step since the last refresh (step advances on apply)
        state["exp_avg"].mul_(beta1).add_(sketch, alpha=1.0 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(sketch, sketch, value=1.0 - beta2)
        m_hat = state["exp_avg"] / (1.0 - beta1**t)
        v_hat = state["exp_avg_sq"] / (1.0 - beta2**t)
        return m_hat / (v_hat.sqrt() + group["eps"])

    def state_tensors_per_layer(self) -> int:
        return 2


# What `sketch.optimizer` holds: a sketch optimizer class, or one with its hyperparameters bound (a config's
# class_path + init_args), still to be given the layers.
SketchOptimizerFactory = Callable[[Layers], SketchOptimizer]
