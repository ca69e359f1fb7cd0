"""Hermes / Qwen tool-call parsing: good calls, several, malformed entries (never exceptions), bounds."""

from __future__ import annotations

import json

from fp8rl.envs.tools import (
    MAX_TOOL_CALL_CHARS,
    MAX_TOOL_CALLS_PER_TURN,
    ToolCall,
    ToolCallError,
    format_tool_call,
    parse_tool_calls,
    tool_result_message,
)


def test_one_call():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "347*29"}}\n</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "347*29"})]


def test_no_calls():
    assert parse_tool_calls("Answer: 42") == []


def test_several_calls_in_order_and_roundtrip():
    text = "a" + format_tool_call("f", {"x": 1}) + " and " + format_tool_call("g", {}) + "tail"
    assert parse_tool_calls(text) == [ToolCall("f", {"x": 1}), ToolCall("g", {})]


def test_arguments_as_json_string_and_missing():
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call><tool_call>{"name": "g"}</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("f", {"x": 2}), ToolCall("g", {})]


def test_malformed_entries_are_errors_not_exceptions():
    text = ("<tool_call>{not json}</tool_call>"
            '<tool_call>{"arguments": {}}</tool_call>'
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'
            "<tool_call>[1, 2]</tool_call>"
            '<tool_call>{"name": "ok", "arguments": {}}</tool_call>'
            "<tool_call>{\"name\": \"unterminated\"")
    out = parse_tool_calls(text)
    assert [type(c) for c in out] == [ToolCallError] * 4 + [ToolCall, ToolCallError]
    assert "not valid JSON" in out[0].error
    assert "no 'name'" in out[1].error
    assert "must be a JSON object" in out[2].error
    assert "unterminated" in out[5].error


def test_oversized_and_deeply_nested():
    big = json.dumps({"name": "f", "arguments": {"x": "y" * MAX_TOOL_CALL_CHARS}})
    deep = "[" * 3000 + "]" * 3000
    out = parse_tool_calls(f"<tool_call>{big}</tool_call><tool_call>{deep}</tool_call>")
    assert isinstance(out[0], ToolCallError) and "too long" in out[0].error
    assert isinstance(out[1], ToolCallError)


def test_at_most_n_calls_per_turn():
    text = format_tool_call("f", {}) * (MAX_TOOL_CALLS_PER_TURN + 5)
    out = parse_tool_calls(text)
    assert len(out) == MAX_TOOL_CALLS_PER_TURN + 1
    assert all(isinstance(c, ToolCall) for c in out[:-1])
    assert isinstance(out[-1], ToolCallError) and "too many" in out[-1].error


def test_tool_result_message():
    assert tool_result_message("6") == {"role": "tool", "content": "6"}
