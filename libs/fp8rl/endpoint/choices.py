"""Samples → OpenAI choices: the text of a turn, stop strings, tool calls, logprobs, and the SSE chunks of a stream.

Each choice carries, beside OpenAI's fields, the token-carrying ones (:data:`~.chat.TOKEN_FIELDS` and
``weight_version``) on its message (chat) or on itself (completions), and private ``_ids`` / ``_lps`` / ``_text``
keys (what the session records; stripped before the choice is sent).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from fp8rl.engines.base import Sample
from fp8rl.envs.tools import ToolCall, parse_tool_calls

from .chat import CompletionRequest

__all__ = ["choice_text", "cut_at_stop", "make_choice", "stream_chunks", "text_pieces", "tool_calls_of"]


def cut_at_stop(ids: Sequence[int], logprobs: Sequence[float], finish_reason: str, text_of,
                stops: Sequence[str]) -> tuple[list[int], list[float], str, str]:
    """``(token_ids, logprobs, text, finish_reason)`` of a sample cut at its first stop string: the tokens up to
    the one that completes the stop (the record holds what the text came from), the text before the stop.
    ``text_of(ids)`` is a turn's text (its stop token left out). The shortest such prefix is found by bisection:
    a prefix's text holding a stop is monotone in its length."""
    ids, lps = list(ids), list(logprobs)
    text = text_of(ids)
    hits = [text.find(s) for s in stops if s in text]
    if not hits:
        return ids, lps, text, finish_reason
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in text_of(ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return ids[:lo], lps[:lo], text[:min(hits)], "stop"


def tool_calls_of(text: str, names: frozenset[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """The content and OpenAI ``tool_calls`` of a model turn: well-formed ``<tool_call>`` blocks (of a tool the
    request offered, when it offered any) become calls; the content is the text outside them (None when empty).
    A malformed block stays in the content, for the agent to see."""
    calls = [c for c in parse_tool_calls(text) if isinstance(c, ToolCall) and (not names or c.name in names)]
    if not calls:
        return text, []
    rest = text
    while "<tool_call>" in rest and "</tool_call>" in rest:
        a = rest.find("<tool_call>")
        b = rest.find("</tool_call>", a)
        if b < 0:
            break
        rest = rest[:a] + rest[b + len("</tool_call>"):]
    rest = rest.strip()
    return rest or None, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                           "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]


def choice_text(decode, ids: Sequence[int], stop_ids: Sequence[int]) -> str:
    """The text of a model turn without its stop token (the message content a client sees)."""
    ids = list(ids)
    if ids and ids[-1] in stop_ids:
        ids = ids[:-1]
    return decode(ids)


def make_choice(index: int, s: Sample, req: CompletionRequest, decode: Callable[[Sequence[int]], str],
                text_of: Callable[[Sequence[int]], str]) -> dict[str, Any]:
    """Choice ``index`` of ``s`` for ``req`` (``decode``: ids → text; ``text_of``: a turn's text without its stop
    token)."""
    ids, lps, text, finish = cut_at_stop(s.token_ids, s.logprobs, s.finish_reason, text_of, req.stop_strings)
    fields = {"prompt_token_ids": list(s.prompt_ids), "generation_token_ids": ids, "generation_log_probs": lps,
              "weight_version": s.weight_version}
    out: dict[str, Any] = {"index": index, "_ids": ids, "_lps": lps, "_text": text}
    if req.chat:
        content, calls = tool_calls_of(text, req.tool_names)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
            finish = "tool_calls" if finish == "stop" else finish
        out["message"] = {**msg, **fields}
    else:
        out["text"] = (text_of(s.prompt_ids) if req.echo else "") + text
        out.update(fields)
    out["finish_reason"] = finish
    out["weight_version"] = s.weight_version
    if req.logprobs:
        toks = [decode([t]) for t in ids]
        if req.chat:
            out["logprobs"] = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                           for t, lp in zip(toks, lps, strict=True)]}
        else:
            out["logprobs"] = {"tokens": toks, "token_logprobs": lps, "top_logprobs": None,
                               "text_offset": _offsets(toks)}
    return out


def stream_chunks(req: CompletionRequest, choices: list[dict[str, Any]], public: list[dict[str, Any]],
                  text_of: Callable[[Sequence[int]], str]) -> Iterator[dict[str, Any]]:
    """The ``choices`` entries of a stream's chunks, in order: per choice its role, its text token by token (a
    message with tool calls: its content at once), then a last chunk with the tool calls, the finish reason and
    the token fields. ``public``: the choices as sent (no private keys)."""
    for c, pc in zip(choices, public, strict=True):
        i = c["index"]
        pieces = text_pieces(text_of, c["_ids"], c["_text"])
        if not req.chat:
            for piece in pieces:
                yield {"index": i, "text": piece, "finish_reason": None}
            yield {"index": i, "text": "", "finish_reason": pc["finish_reason"],
                   **{k: pc[k] for k in ("prompt_token_ids", "generation_token_ids", "generation_log_probs",
                                         "weight_version")}}
            continue
        yield {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        msg = pc["message"]
        last = {k: v for k, v in msg.items() if k not in ("role", "content")}
        if last.get("tool_calls"):
            last["tool_calls"] = [{"index": j, **tc} for j, tc in enumerate(last["tool_calls"])]
            if msg.get("content"):
                yield {"index": i, "delta": {"content": msg["content"]}, "finish_reason": None}
        else:
            for piece in pieces:
                yield {"index": i, "delta": {"content": piece}, "finish_reason": None}
        yield {"index": i, "delta": last, "finish_reason": pc["finish_reason"], "weight_version": pc["weight_version"]}


def text_pieces(text_of: Callable[[Sequence[int]], str], ids: list[int], text: str) -> list[str]:
    """The text deltas of a turn token by token (a token that ends inside a multi-byte character adds nothing
    until the character completes); their concatenation is ``text``."""
    out, prev = [], ""
    for j in range(1, len(ids) + 1):
        t = text_of(ids[:j])
        if "\ufffd" in t[len(prev):]:
            continue
        t = t[:len(text)] if len(t) > len(text) else t
        if t.startswith(prev) and len(t) > len(prev):
            out.append(t[len(prev):])
            prev = t
    if prev != text:
        out.append(text[len(prev):] if text.startswith(prev) else text)
    return [p for p in out if p]


def _offsets(toks: list[str]) -> list[int]:
    out, at = [], 0
    for t in toks:
        out.append(at)
        at += len(t)
    return out
