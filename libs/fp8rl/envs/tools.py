"""Tool calls in the Hermes / Qwen convention, parsed out of an assistant turn's text.

The model writes one or more blocks (the chat template's ``tools=`` system prompt asks for exactly this)::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "347*29"}}
    </tool_call>

:func:`parse_tool_calls` returns one entry per block, in order: a :class:`ToolCall`, or a
:class:`ToolCallError` when the block is malformed (bad JSON, no name, arguments not an object, too long,
unterminated) — never an exception, so the environment can answer the model with the error as a tool result.
Work is bounded: at most :data:`MAX_TOOL_CALLS_PER_TURN` entries (one more error entry says the rest were
dropped) and at most :data:`MAX_TOOL_CALL_CHARS` characters of JSON per call, checked before parsing.
Results go back as ``role: "tool"`` messages (:func:`tool_result_message`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .base import Message

__all__ = [
    "MAX_TOOL_CALLS_PER_TURN", "MAX_TOOL_CALL_CHARS", "TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "ToolCall",
    "ToolCallError", "answer_tool_calls", "format_tool_call", "parse_tool_calls", "tool_result_message",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
MAX_TOOL_CALLS_PER_TURN = 8
MAX_TOOL_CALL_CHARS = 4096
_SNIPPET = 80  # characters of a bad block quoted back in its error


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: the tool's ``name`` and its ``arguments`` object."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolCallError:
    """One malformed ``<tool_call>`` block: ``error`` says what is wrong, in words the model can act on."""

    error: str


def _snippet(raw: str) -> str:
    raw = raw.strip()
    return raw if len(raw) <= _SNIPPET else raw[:_SNIPPET] + "..."


def _parse_one(raw: str) -> ToolCall | ToolCallError:
    if len(raw) > MAX_TOOL_CALL_CHARS:
        return ToolCallError(f"tool call too long: {len(raw)} characters, at most {MAX_TOOL_CALL_CHARS}")
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: deeply nested JSON
        return ToolCallError(f"tool call is not valid JSON ({type(e).__name__}: {str(e)[:100]}): {_snippet(raw)}")
    if not isinstance(obj, dict):
        return ToolCallError(f'tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}: '
                             f"{_snippet(raw)}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError(f"tool call has no 'name': {_snippet(raw)}")
    args = obj.get("arguments", {})
    if isinstance(args, str):  # the OpenAI wire form: arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            return ToolCallError(f"tool call {name!r}: 'arguments' is a string that is not a JSON object")
    if not isinstance(args, dict):
        return ToolCallError(f"tool call {name!r}: 'arguments' must be a JSON object, got {type(args).__name__}")
    return ToolCall(name, args)


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """The tool calls in ``text``, in order; [] when it has none (then the turn is a plain answer).

    Linear in ``len(text)``. Text between blocks is ignored. A ``<tool_call>`` without its closing tag
    yields a :class:`ToolCallError`; so do calls past :data:`MAX_TOOL_CALLS_PER_TURN` (one error for all).
    """
    out: list[ToolCall | ToolCallError] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        if start < 0:
            return out
        if len(out) == MAX_TOOL_CALLS_PER_TURN:
            out.append(ToolCallError(f"too many tool calls: at most {MAX_TOOL_CALLS_PER_TURN} per turn; "
                                     f"the rest were ignored"))
            return out
        body = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body)
        if end < 0:
            out.append(ToolCallError(f"unterminated {TOOL_CALL_OPEN}: close it with {TOOL_CALL_CLOSE}"))
            return out
        out.append(_parse_one(text[body:end]))
        pos = end + len(TOOL_CALL_CLOSE)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The block a model writes to call ``name`` (the inverse of :func:`parse_tool_calls`)."""
    return f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{TOOL_CALL_CLOSE}"


def answer_tool_calls(calls: list[ToolCall | ToolCallError], tool: str, argument: str, run: Callable[[str], str],
                      info: dict[str, float | str], *, enabled: bool = True, unavailable: str = "",
                      usage: str = "") -> list[Message]:
    """The ``tool`` messages answering ``calls`` (one each, in call order) of an environment with one tool ``tool``
    taking one str ``argument``: ``run(arguments[argument])``, or an ``error: ...`` text for a malformed call,
    another tool's name, a missing argument (``usage``) — and ``unavailable`` for every call when not ``enabled``
    (a control). Counts ``tool_calls`` and ``tool_errors`` (answers starting ``error:``) in ``info``."""
    messages = []
    for call in calls:
        if not isinstance(call, ToolCall):
            result = f"error: {call.error}"
        elif call.name != tool:
            result = f"error: unknown tool {call.name[:40]!r}; the only tool is {tool!r}"
        elif not enabled:
            result = unavailable
        elif not isinstance(call.arguments.get(argument), str):
            result = usage
        else:
            result = run(call.arguments[argument])
        info["tool_calls"] += 1
        info["tool_errors"] += 1.0 if result.startswith("error:") else 0.0
        messages.append(tool_result_message(result))
    return messages


def tool_result_message(content: str) -> Message:
    """A tool's result (or its error text) as the message the environment appends: role ``"tool"``."""
    if not isinstance(content, str):
        raise TypeError(f"tool result must be a str, got {type(content).__name__}")
    return {"role": "tool", "content": content}
