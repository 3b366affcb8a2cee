"""Settings checked once the config is parsed, before any data, weights or rollout engine is loaded.

Without these, a sketch target that does not exist or a rank too large for a matrix failed only when the sketches
were installed: after the data module's set-up, the policy's weights and (with vLLM) an engine had been loaded,
minutes into a large run. The model's `config.json` is enough to know its layers: the checks run on a skeleton of
the model built on the meta device (names and shapes, no memory), with the same `select_targets` that installing
the sketches runs later.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from jsonargparse import Namespace
from lightning.pytorch import Trainer
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_logra.paths import model_path
from lightning_logra.train.modes import training_mode
from lightning_logra.train.module import RLVRModule
from lightning_logra.train.policy import check_penalty_placement
from lightning_logra.train.strategies.base import collectives_of


def check_before_loading(module: RLVRModule, trainer: Trainer) -> None:
    """What a fit would refuse, checked without loading anything; each error names its config key and the fix. Called
    by the CLI once its classes are built, before `fit`."""
    check_penalty_placement(module.hparams.loss.beta, collectives_of(trainer))
    training_mode(trainer.strategy, collectives_of(trainer)).check_settings(policy_skeleton(module.hparams.model))


def policy_skeleton(model: str) -> nn.Module | None:
    """The policy's modules with their names and shapes, on the meta device, from its config.json alone. None when
    no config.json is on this machine (a hub id not downloaded yet): the model's loading then fails or fetches it,
    and installing the sketches checks the same things."""
    model = model_path(model)  # the embedded model from any working directory, as the module loads it
    path = Path(model)
    if path.is_dir():
        config_file = path / "config.json"
    else:
        from huggingface_hub import try_to_load_from_cache

        try:
            config_file = try_to_load_from_cache(model, "config.json")
        except ValueError:  # not a hub id either; the module's loading names model.model
            return None
    if not isinstance(config_file, (str, Path)) or not Path(config_file).is_file():
        return None
    config = AutoConfig.from_pretrained(Path(config_file).parent)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def non_finite_settings(config: Any, key: str = "") -> list[str]:
    """Every setting in a parsed config (jsonargparse Namespaces, dicts and lists, as nested as the classes' own
    init_args) whose value is a float that is not finite, by its key (`trainer.callbacks[1].init_args.budget`)."""
    if isinstance(config, float):
        return [] if math.isfinite(config) else [f"{key}={config}"]
    if isinstance(config, Namespace):
        config = vars(config)
    if isinstance(config, dict):
        return [found for name, value in config.items()
                for found in non_finite_settings(value, f"{key}.{name}" if key else str(name))]
    if isinstance(config, (list, tuple)):
        return [found for index, value in enumerate(config) for found in non_finite_settings(value, f"{key}[{index}]")]
    return []


def check_finite_settings(config: Any) -> None:
    """Refuse NaN and infinity in any setting, whatever class it goes to, before anything is built. The command line
    refuses `nan` itself, but a config file's `.nan` or `.inf` (YAML's spellings) reaches the classes, where a check
    written as `x <= 0` lets NaN through: a NaN temperature trained with reward 0 and no warning."""
    found = non_finite_settings(config)
    if found:
        raise ValueError(f"{', '.join(found)}: a setting must be a finite number (YAML's .nan and .inf are refused); "
                         f"set a number, or null where the setting allows none")


# The project's strategies that train on one device, and what trains on more.
_ONE_DEVICE = {"DenseStrategy": "use lightning_logra.train.strategies.DenseDDPStrategy for more, or set "
                                "trainer.devices 1",
               "SketchStrategy": "use lightning_logra.train.strategies.SketchDDPStrategy (whole weights on every "
                                 "device) or SketchFSDPStrategy (sharded) for more (configs/tiny_arith_ddp.yaml, "
                                 "tiny_arith_fsdp.yaml), or set trainer.devices 1",
               "LoRAStrategy": "the LoRA mode has no strategy for more (LoRA is the paper's one-device comparison): "
                               "set trainer.devices 1"}


def check_device_count(trainer: Any) -> None:
    """Refuse more than one device or node under a strategy that trains on one: Lightning would train on the first
    device alone and say nothing (`--trainer.devices 8` with qwen1_5b.yaml would leave seven GPUs idle). `trainer`:
    the parsed config's trainer settings."""
    strategy = trainer.get("strategy")
    class_path = strategy if isinstance(strategy, str) else getattr(strategy, "class_path", None) or ""
    name = class_path.rpartition(".")[2]
    if name not in _ONE_DEVICE:
        return
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes") or 1
    count = len(devices) if isinstance(devices, (list, tuple)) else devices
    if isinstance(count, str) and count.lstrip("-").isdigit():
        count = int(count)
    many = (isinstance(count, int) and (count > 1 or count == -1)) or nodes > 1
    if many:
        raise ValueError(f"trainer.devices={devices!r}, trainer.num_nodes={nodes}: {name} trains on one device, "
                         f"and Lightning would use the first alone; {_ONE_DEVICE[name]}")
