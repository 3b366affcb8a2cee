"""Tool calls read from a turn's text, in the Hermes format Qwen's chat templates use: each call one JSON object
inside `<tool_call>` ... `</tool_call>`, `{"name": ..., "arguments": {...}}`.

A turn without a call is the episode's answer. A call that cannot be read (an unclosed tag, JSON that does not
parse, no name, arguments that are not an object) is an invalid call: counted, and answered or ending the episode as
`model.episodes.invalid_tool_call` says."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ParsedTurn:
    """What a turn asked for: its calls in order, and the reasons of those that could not be read."""

    calls: list[ToolCall]
    invalid: list[str]

    @property
    def answered(self) -> bool:
        """A turn that asked for nothing (not even a call that failed to parse): the episode's last."""
        return not self.calls and not self.invalid


def parse_tool_calls(text: str) -> ParsedTurn:
    calls, invalid = [], []
    for body in _CALL.findall(text):
        call = _read_call(body.strip())
        if isinstance(call, ToolCall):
            calls.append(call)
        else:
            invalid.append(call)
    # An opening tag left without its closing one: the model began a call and did not finish it (or was cut)
    if text.count(OPEN) > len(_CALL.findall(text)):
        invalid.append(f"a {OPEN} without its {CLOSE}")
    return ParsedTurn(calls, invalid)


def _read_call(body: str) -> ToolCall | str:
    """The call in one tag's body, or why it is not one."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as err:
        return f"the call is not JSON ({err.msg} at character {err.pos})"
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return 'the call names no tool: write {"name": ..., "arguments": {...}}'
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI's API carries them
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return f"the arguments of {value['name']!r} are not a JSON object"
    if not isinstance(arguments, dict):
        return f"the arguments of {value['name']!r} are not a JSON object"
    return ToolCall(value["name"], arguments)
