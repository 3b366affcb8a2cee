"""Tool calls read from a turn's text, in the Hermes format Qwen's chat templates use: each call one JSON object
inside `<tool_call>` ... `</tool_call>`, `{"name": ..., "arguments": {...}}`.

A turn without a call is the episode's answer. A call that cannot be read (an unclosed tag, JSON that does not
parse, no name, arguments that are not an object) is an invalid call: counted, and answered or ending the episode as
`model.episodes.invalid_tool_call` says."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


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
    start = text.find(OPEN)
    while start >= 0:
        # Each tag's body runs to the first closing tag after it (a tag opened inside a body is the body's text).
        # One pass over the text: every search starts where the last one ended, so 20,000 unclosed tags cost one
        # scan, not one scan each.
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:  # the model began a call and did not finish it (or was cut): no tag after it closes either
            invalid.append(f"a {OPEN} without its {CLOSE}")
            break
        call = _read_call(text[start + len(OPEN):end].strip())
        if isinstance(call, ToolCall):
            calls.append(call)
        else:
            invalid.append(call)
        start = text.find(OPEN, end + len(CLOSE))
    return ParsedTurn(calls, invalid)


def _json(text: str) -> tuple[Any, str | None]:
    """`text` parsed, or why it is not JSON the parser can read: beside a syntax error, a nesting deeper than Python's
    recursion limit (RecursionError) or an integer of more than 4,300 digits (ValueError) is the model's invalid
    call, not the environment's failure."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as err:
        return None, f"{err.msg} at character {err.pos}"
    except RecursionError:
        return None, "nested too deeply"
    except ValueError as err:  # Python's limit on an integer's digits
        return None, str(err).split(";")[0]


def _read_call(body: str) -> ToolCall | str:
    """The call in one tag's body, or why it is not one."""
    value, why = _json(body)
    if why is not None:
        return f"the call is not JSON ({why})"
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return 'the call names no tool: write {"name": ..., "arguments": {...}}'
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI's API carries them
        arguments, why = _json(arguments)
        if why is not None:
            return f"the arguments of {value['name']!r} are not a JSON object ({why})"
    if not isinstance(arguments, dict):
        return f"the arguments of {value['name']!r} are not a JSON object"
    return ToolCall(value["name"], arguments)
