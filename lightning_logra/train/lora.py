"""LoRA adapters through peft: the paper's comparison method, trained by the LoRA mode (`modes.LoRAMode`, chosen by
`strategies.LoRAStrategy`).

The adapters go into the target matrices of the module's `policy` in place (the module, its in-process engine and
the KL controller keep the same policy object); everything else is frozen and the adapters are trained by AdamW. To
the step they are densely trained parameters, so gradient clipping, the predicted-KL controller (which holds a dense
step back and scales it by α) and skipped updates work as in a dense run.

A LoRA layer computes y = x·W₀ᵀ + s·(x·Aᵀ)·Bᵀ with A (r, k), B (d, r) and s = alpha / r (peft's scaling). Its merged
weight is W = W₀ + s·B·A. What a rollout engine with its own weights receives after a step is the change of the
merged weight, s·(B'A' − BA), which has rank at most 2r:

    s·(B'A' − BA) = s·B'(A' − A) + s·(B' − B)A = −F·P,   F = −s·[B' | B' − B] (d, 2r),   P = [A' − A ; A] (2r, k)

so the engine merges W −= F·P with the same in-place merge LoGRA's updates use (`sketch.update.LowRankDelta`, here
with an explicit P instead of a seeded projection): 2r·(d + k) numbers per matrix instead of d·k.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from lightning_logra.base.schedule import LRSchedule
from lightning_logra.base.settings import check_at_least, check_positive, is_number
from lightning_logra.sketch.config import DEFAULT_TARGETS
from lightning_logra.sketch.install import select_targets
from lightning_logra.sketch.update import LowRankDelta
from lightning_logra.train.optimizers import OptimizerSpec

# Where a LightningCLI config sets a LoRAConfig: errors name their field under it.
CONFIG_KEY = "trainer.strategy.init_args.lora"
TRAINING = "with LoRA adapters"  # what a checkpoint records about how it was trained (lightning_logra.train.checkpoint)
ADAPTER = "default"  # peft's adapter name


@dataclass
class LoRAConfig:
    """Which matrices get LoRA adapters, their shape, and the AdamW that trains them.

    Args:
        target_modules: the nn.Linear layers to adapt, by the last components of their names (`q_proj` selects every
            `...self_attn.q_proj`); every pattern must select at least one layer.
        rank: r of each adapter (A is r×k, B is d×r); it must be smaller than in_features (k) of every target.
        alpha: peft's lora_alpha; the adapter's output is scaled by alpha / rank.
        dropout: dropout on the adapters' input while training (0 keeps the trained policy equal to the merged one).
        lr: AdamW's learning rate (the paper's LoRA comparison: a constant 2e-4).
        weight_decay: AdamW's weight decay on the adapters.
        lr_schedule: warm-up and decay of lr, by applied update (`lightning_logra.base.schedule.LRSchedule`).
        optimizer: another torch optimizer for the adapters by `class_path` and `init_args`
            (`lightning_logra.train.optimizers`); init_args without `lr` / `weight_decay` take the two above. None:
            AdamW.
        seed: seeds the adapters' initialization (A as peft draws it, B = 0), so runs are reproducible whatever
            the global random state.
    """

    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    lr: float = 2e-4
    weight_decay: float = 0.0
    lr_schedule: LRSchedule = field(default_factory=LRSchedule)
    optimizer: dict[str, Any] | str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.target_modules:
            raise ValueError(f"{CONFIG_KEY}.target_modules is empty: name the linear layers to adapt, e.g. [q_proj, "
                             "v_proj]")
        check_positive(f"{CONFIG_KEY}.rank", self.rank, "integer (the rank r of each adapter, smaller than "
                       "in_features of every target)", integer=True)
        check_positive(f"{CONFIG_KEY}.alpha", self.alpha, "number (the adapters are scaled by alpha / rank)")
        if not (is_number(self.dropout) and 0 <= self.dropout < 1):
            raise ValueError(f"{CONFIG_KEY}.dropout must be in [0, 1), got {self.dropout}")
        check_positive(f"{CONFIG_KEY}.lr", self.lr, "learning rate")
        check_at_least(f"{CONFIG_KEY}.weight_decay", self.weight_decay, 0)
        self.optimizer_spec()  # the class imports and takes its init_args

    def optimizer_spec(self) -> OptimizerSpec | None:
        return OptimizerSpec.parse(self.optimizer, f"{CONFIG_KEY}.optimizer")

    def record(self) -> dict[str, Any]:
        """The settings the adapters' state is only valid under (a checkpoint records them; a resume compares)."""
        return {"target_modules": list(self.target_modules), "rank": self.rank, "alpha": self.alpha}

    def hparams(self) -> dict[str, Any]:
        """The settings as flat hyperparameters for the loggers: `lora/<field>`."""
        settings = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "optimizer"}
        return {f"lora/{k}": v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in settings.items()}

    def check_targets(self, model: nn.Module) -> None:
        """Refuse, naming the key, a pattern that selects nothing or something other than an nn.Linear, a tied
        weight, a rank not below a target's in_features. Works on a meta-device skeleton of the model."""
        with _named_keys():
            select_targets(model, self.target_modules, self.rank)

    def install(self, model: nn.Module) -> dict[str, nn.Module]:
        """Add the adapters in place (the model object stays the same); freeze every other parameter. Returns
        {module name: peft LoRA layer}."""
        peft = _import_peft()
        self.check_targets(model)
        names = list(select_targets(model, self.target_modules, self.rank))
        config = peft.LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                                 target_modules=names, bias="none")
        # peft draws A from the global generator (B starts at 0): fork it so that the adapters depend on `seed` only.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
        layers = adapted_layers(model)
        adapters = {id(p) for layer in layers.values() for p in adapter_parameters(layer)}
        for param in model.parameters():
            param.requires_grad_(id(param) in adapters)
        return layers


@contextmanager
def _named_keys() -> Iterator[None]:
    """select_targets' errors begin with the argument they are about ("rank: ...", "target_modules: ...")."""
    try:
        yield
    except (ValueError, TypeError) as err:
        raise type(err)(f"{CONFIG_KEY}.{err}") from None


def _import_peft():
    try:
        import peft
    except ImportError as err:
        raise ImportError("trainer.strategy: LoRAStrategy needs peft (pip install 'lightning-logra[lora]')") from err
    return peft


# ---- the adapters as weights: merged values, and the low-rank change of a step --------------------------------------

def adapted_layers(model: nn.Module) -> dict[str, nn.Module]:
    """{module name: peft LoRA layer} in module order; empty for a model without adapters (peft not even needed)."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")}


def adapter_parameters(layer: nn.Module) -> list[nn.Parameter]:
    return [layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight]


def factors(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(A (r, k), B (d, r), s) of a LoRA layer: its merged weight is W₀ + s·B·A."""
    return layer.lora_A[ADAPTER].weight.detach(), layer.lora_B[ADAPTER].weight.detach(), layer.scaling[ADAPTER]


def merged_weight(layer: nn.Module) -> torch.Tensor:
    """W₀ + s·B·A (d, k), in W₀'s dtype (computed in fp32 at least)."""
    a, b, s = factors(layer)
    base = layer.base_layer.weight.detach()
    compute = torch.promote_types(base.dtype, torch.float32)
    return base.to(compute).addmm(b.to(compute), a.to(compute), alpha=s).to(base.dtype)


def engine_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of a LoRA-adapted model as the base model names and holds it: an adapted matrix as its merged
    weight under its own name (`...q_proj.weight`, not peft's `...q_proj.base_layer.weight`), no adapter tensors.
    What a full load sends to a rollout engine, and what an export writes."""
    layers = adapted_layers(model)
    tensors = {}
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        if ".lora_A." in name or ".lora_B." in name:
            continue
        layer_name = owner.removesuffix(".base_layer")
        if owner.endswith(".base_layer") and layer_name in layers:
            tensors[f"{layer_name}.{leaf}"] = merged_weight(layers[layer_name]) if leaf == "weight" else param.detach()
        else:
            tensors[name] = param.detach()
    return tensors


def adapter_snapshot(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module name: (A, B)} copies: what a step's change is measured from (`low_rank_deltas`)."""
    return {name: (a.clone(), b.clone()) for name, (a, b, _) in
            ((name, factors(layer)) for name, layer in adapted_layers(model).items())}


def low_rank_deltas(model: nn.Module, before: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, LowRankDelta]:
    """{`<layer>.weight`: the change of its merged weight since `before` as W −= F·P} (rank 2r, see the module's
    docstring), for every adapted layer whose adapters changed."""
    deltas = {}
    for name, layer in adapted_layers(model).items():
        a1, b1, s = factors(layer)
        a0, b0 = before[name]
        if torch.equal(a0, a1) and torch.equal(b0, b1):
            continue
        factor = torch.cat([b1, b1 - b0], dim=1).mul(-s)  # F (d, 2r)
        projection = torch.cat([a1 - a0, a0], dim=0)  # P (2r, k)
        deltas[f"{name}.weight"] = LowRankDelta(factor, seed=None, distribution=None, in_features=a1.shape[1],
                                                matrix=projection)
    return deltas


@torch.no_grad()
def merge_adapters_(model: nn.Module) -> None:
    """Merge every adapter into its matrix (W₀ ← W₀ + s·B·A) and put the plain nn.Linear back in its place: the
    model is the base architecture again, with the names and shapes of its files (what an export writes)."""
    for name, layer in adapted_layers(model).items():
        base = layer.base_layer
        base.weight.copy_(merged_weight(layer))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, base)


def save_adapter(model: nn.Module, config: LoRAConfig, base_model: str, out) -> None:
    """Write the adapters of `model` as peft saves them (`adapter_config.json`, `adapter_model.safetensors`), for
    `PeftModel.from_pretrained(<the base model>, out)`: a peft model of the same settings on the base model's
    skeleton takes the adapters' values, and peft writes its own format."""
    from transformers import AutoConfig, AutoModelForCausalLM

    peft = _import_peft()
    with torch.device("meta"):  # only the adapters are written: the base weights need not exist
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base_model))
    names = list(adapted_layers(model))
    peft_config = peft.LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                                  target_modules=names, bias="none", task_type="CAUSAL_LM",
                                  base_model_name_or_path=str(base_model))
    peft_model = peft.get_peft_model(skeleton, peft_config)
    inner = peft_model.base_model.model  # the skeleton, adapted as `model` is: the same module names
    adapters = {n: p for n, p in model.state_dict().items() if ".lora_A." in n or ".lora_B." in n}
    missing = inner.load_state_dict(adapters, strict=False, assign=True)
    if missing.unexpected_keys or any(".lora_" in n for n in missing.missing_keys):
        raise RuntimeError(f"save_adapter: the adapters do not fit peft's layout: {missing}")
    peft_model.save_pretrained(out)
