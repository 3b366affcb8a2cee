"""A config's dict (a shipped YAML file, parsed) edited in the shape the command line reads: the module's settings in
their groups (`model.loss.beta`: `lightning_logra.train.settings`), how the weights train in the strategy
(`trainer.strategy.init_args.dense` / `lora` / `sketch`). What a benchmark writes is read back by `python cli.py
fit --config`, whose parser checks it."""

from __future__ import annotations

from typing import Any

STRATEGIES = "lightning_logra.train.strategies"


def model_group(config: dict, group: str) -> dict:
    """`config["model"][group]`, made an empty dict first where the config leaves the group at its defaults."""
    model = config["model"]
    if model.get(group) is None:
        model[group] = {}
    return model[group]


def set_model(config: dict, key: str, value: Any) -> dict:
    """Sets `model.<key>`, a group's (`set_model(config, "loss.beta", 0.04)`), creating the group where the config
    leaves it at its defaults; returns `config`."""
    group, _, name = key.partition(".")
    if not name:
        raise ValueError(f"set_model: {key!r} names no group's key (e.g. 'loss.beta'; train.settings.MOVED says where "
                         "a key of the flat settings lives now)")
    model_group(config, group)[name] = value
    return config


def dense_strategy(lr: float, target_modules: list[str] | None = None,
                   optimizer: dict[str, Any] | None = None) -> dict:
    """`trainer.strategy` of a dense run on one device (`DenseStrategy`): AdamW, or `optimizer` ({class_path,
    init_args}), at `lr` on every parameter or on the weights of `target_modules`."""
    dense: dict[str, Any] = {"lr": lr}
    if target_modules is not None:
        dense["target_modules"] = list(target_modules)
    if optimizer is not None:
        dense["optimizer"] = optimizer
    return {"class_path": f"{STRATEGIES}.DenseStrategy", "init_args": {"dense": dense}}


def lora_strategy(target_modules: list[str], rank: int, lr: float, seed: int,
                  optimizer: dict[str, Any] | None = None) -> dict:
    """`trainer.strategy` of a LoRA run (`LoRAStrategy`): adapters of `rank` (alpha 2·rank) on `target_modules`,
    trained by AdamW, or `optimizer` ({class_path, init_args}), at `lr`."""
    lora: dict[str, Any] = {"target_modules": list(target_modules), "rank": rank, "alpha": 2.0 * rank, "lr": lr,
                            "seed": seed}
    if optimizer is not None:
        lora["optimizer"] = optimizer
    return {"class_path": f"{STRATEGIES}.LoRAStrategy", "init_args": {"lora": lora}}


def optimizer_dict(spec: Any, lr: float) -> dict[str, Any]:
    """An `OptimizerSpec` (`bench.lib.peers.spec`) as a strategy's `optimizer` value, at `lr`."""
    return {"class_path": spec.class_path, "init_args": {**spec.init_args, "lr": lr}}
