"""Checks of numeric settings, shared by every class a config builds: each refusal names the setting's key, what it
must be and what it got. A number must be finite (a YAML `.nan` or `.inf` is refused as a negative one is) and a
bool is not a number (YAML's `yes` would otherwise pass as 1). Also what a reward is (`real_number`): one real
number, a bool among them (a pass or a fail), as a reward function and an environment's reward() return it."""

from __future__ import annotations

import math
import numbers
import sys
from dataclasses import fields
from typing import Any

import yaml


def is_number(value: Any, integer: bool = False) -> bool:
    """A finite int or float (`integer`: an int), not a bool. An int past what a float holds (10**400) is a number
    only where an int is asked for: elsewhere it would become inf (math.isfinite raised OverflowError on it)."""
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        return False
    if integer:
        return True
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def real_number(value: Any) -> float | None:
    """`value` as a float when it is one real number, None when it is not: what a reward function and an
    environment's reward() may return. An int, a float or a bool (a pass or a fail: 1.0 or 0.0), numpy's scalars of
    these, or a 0-d torch tensor of a real dtype (what indexing a tensor of rewards gives). Not text ("0.5": float()
    would take it, but a reward that returns text is broken), a complex number, nor an array or a tensor of several.
    An int past a float's range is ±inf; whether a value must be finite is the caller's to say."""
    torch, numpy = sys.modules.get("torch"), sys.modules.get("numpy")  # not imported: no value is one of theirs
    if torch is not None and isinstance(value, torch.Tensor):
        real = value.dim() == 0 and not value.is_complex()
    else:
        real = isinstance(value, numbers.Real) or (numpy is not None and isinstance(value, numpy.bool_))
    if not real:
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def check_positive(key: str, value: Any, what: str | None = None, *, integer: bool = False, null: str | None = None,
                   why: str = "") -> None:
    """Refuse anything but a positive finite number (`integer`: a whole one). `what` names the unit ("number of
    seconds"); `null`, when given, says what None means, and lets it pass; `why` is added to the message."""
    if value is None and null is not None:
        return
    if is_number(value, integer) and value > 0:
        return
    what = what or ("integer" if integer else "number")
    raise ValueError(f"{key} must be a positive {what}{f' (or null: {null})' if null else ''}, got {value!r}"
                     f"{f': {why}' if why else ''}")


def check_at_least(key: str, value: Any, minimum: float, what: str | None = None, *, integer: bool = False,
                   null: str | None = None, why: str = "") -> None:
    """Refuse anything but a finite number ≥ `minimum` (`integer`: a whole one); `what`, `null` and `why` as in
    `check_positive`."""
    if value is None and null is not None:
        return
    if is_number(value, integer) and value >= minimum:
        return
    what = what or ("whole number" if integer else "number")
    raise ValueError(f"{key} must be a {what} ≥ {minimum}{f' (or null: {null})' if null else ''}, got {value!r}"
                     f"{f': {why}' if why else ''}")


def _as_mapping(dumper: yaml.Dumper, group: Any) -> yaml.Node:
    return dumper.represent_dict({f.name: getattr(group, f.name) for f in fields(group)})


def yaml_as_mappings(*kinds: type) -> None:
    """Settings dataclasses in YAML (a run's hparams.yaml) as plain mappings of their fields, which load back as
    dicts, rather than as Python objects no safe loader reads."""
    for kind in kinds:
        yaml.add_representer(kind, _as_mapping)
