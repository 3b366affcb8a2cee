"""A resumed run trains with the optimizer settings its own config gives, never silently with the checkpoint's.

torch's `Optimizer.load_state_dict` replaces every parameter group's settings (lr, betas, eps, momentum, weight
decay) with the checkpoint's, and a `LambdaLR`'s state its base learning rates: left alone, a resumed run would
record one value in its saved config and train with another. So the module notes the settings the optimizers were
built with (`configured`, before the checkpoint is restored) and, once it is, puts back every one the checkpoint
changed (`reapply`), saying so. The optimizers' state (moments, momentum buffers, the step count) is kept: it stays
meaningful under a new learning rate, betas or eps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Settings = list[list[dict[str, Any]]]  # per optimizer, per parameter group: every setting but the parameters


def configured(optimizers: list[torch.optim.Optimizer]) -> Settings:
    """The settings of every parameter group, as built from the run's config. `initial_lr` is the configured
    learning rate (a scheduler sets it once); `lr` is that times the schedule's factor, and is not compared."""
    return [[{key: value for key, value in group.items() if key not in ("params", "lr")} for group in opt.param_groups]
            for opt in optimizers]


def reapply(optimizers: list[torch.optim.Optimizer], schedulers: list[Any], settings: Settings,
            config_key: Callable[[int, str], str]) -> list[str]:
    """Put the configured `settings` back into the restored `optimizers` (and their schedulers' base learning rates)
    wherever the checkpoint's differ. `config_key(i, "lr")` names optimizer i's setting in the config. Returns one
    line per setting changed."""
    changes = []
    for index, (optimizer, groups) in enumerate(zip(optimizers, settings)):
        scheduler = _scheduler_of(optimizer, schedulers)
        for number, (group, wanted) in enumerate(zip(optimizer.param_groups, groups)):
            for key, value in wanted.items():
                if key in group and _same(group[key], value):
                    continue
                name = config_key(index, "lr" if key == "initial_lr" else key)
                changes.append(f"{name}: the checkpoint has {group.get(key)!r}, this run's config {value!r}")
                group[key] = value
                if key == "initial_lr" and scheduler is not None:
                    # The schedule's lr of this update, from the new base: base × factor(updates taken).
                    scheduler.base_lrs[number] = value
                    group["lr"] = value * scheduler.lr_lambdas[number](scheduler.last_epoch)
                    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
    return changes


def _scheduler_of(optimizer: torch.optim.Optimizer, schedulers: list[Any]) -> Any:
    found = [s for s in schedulers if getattr(s, "optimizer", None) is optimizer]
    return found[0] if found else None


def _same(a: Any, b: Any) -> bool:
    """Equal settings; betas restored from a checkpoint may come back as a list where the config gave a tuple."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a == b
