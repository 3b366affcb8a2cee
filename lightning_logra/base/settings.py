"""Checks of numeric settings, shared by every class a config builds: each refusal names the setting's key, what it
must be and what it got. A number must be finite (a YAML `.nan` or `.inf` is refused as a negative one is) and a
bool is not a number (YAML's `yes` would otherwise pass as 1)."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

import yaml


def is_number(value: Any, integer: bool = False) -> bool:
    """A finite int or float (`integer`: an int), not a bool."""
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        return False
    return math.isfinite(value)


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
