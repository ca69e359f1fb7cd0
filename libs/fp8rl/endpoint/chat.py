"""OpenAI chat / completions requests → prompt token ids, and samples → OpenAI choices, token in / token out.

The prompt of a chat request is built without re-rendering what the model already wrote:

1. The last assistant message that carries ``generation_token_ids`` (and ``prompt_token_ids``, as this endpoint
   returned them: NeMo-Gym's names) is **spliced**: the prompt starts with exactly ``prompt_token_ids +
   generation_token_ids``, and only the messages after it are rendered, as the delta the chat template appends
   (:meth:`fp8rl.envs.render.ChatRenderer.delta`). The assistant's text may have been changed by the client (a
   framework that strips ``<think>``, re-serialises tool calls): its tokens are what count.
2. Else, in a session that already has turns (the ``X-Session-Id`` header), the conversation must continue the
   session's: its first messages are the previous request's plus the assistant reply the endpoint returned (same
   role and content or tool calls), and the session's recorded ids are spliced the same way.
3. Else (a conversation's first call, or a client without a session that never sends token ids) the messages are
   rendered whole with the generation prompt.

In a session every prompt must extend the session's recorded ids exactly (:class:`~.sessions.SessionBook`);
anything else is refused naming the first token that differs, never silently re-rendered. Malformed input is an
:class:`EndpointError` (HTTP 400, OpenAI's error shape) naming the field; nothing is generated.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from fp8rl import limits
from fp8rl.engines.base import SamplingParams
from fp8rl.envs.render import ChatRenderer

__all__ = ["TOKEN_FIELDS", "CompletionRequest", "EndpointError", "EndpointLimits", "SessionView", "parse_chat",
           "parse_completion"]

TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
"""The token-carrying fields on each returned assistant message (NeMo-Gym's names), sent back to be spliced."""

_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "weight_version", "refusal",
                 "function_call", "audio", "annotations", "reasoning_content", *TOKEN_FIELDS}
_ROLES = ("system", "user", "assistant", "tool")
# accepted and used, accepted and ignored (bookkeeping only), accepted only at their neutral value
_CHAT_KEYS = {"model", "messages", "tools", "tool_choice", "n", "temperature", "top_p", "max_tokens",
              "max_completion_tokens", "stop", "logprobs", "top_logprobs", "stream", "stream_options", "seed"}
_COMPLETION_KEYS = {"model", "prompt", "n", "temperature", "top_p", "max_tokens", "stop", "logprobs", "stream",
                    "stream_options", "seed", "echo"}
_IGNORED = {"user", "metadata", "store", "parallel_tool_calls", "service_tier"}
_NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": None, "response_format": None,
            "suffix": None, "best_of": 1}
MAX_STOP_STRINGS = 4  # OpenAI's own bound


class EndpointError(Exception):
    """A refused request: HTTP ``status`` and OpenAI's ``{"error": {message, type, param, code}}``."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:  # noqa: A002 - OpenAI's name
        super().__init__(message)
        self.status, self.param, self.type, self.code = status, param, type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class EndpointLimits:
    """Per-request bounds of a call (messages, samples, tokens, tools), and the sampling an agent job pins."""

    max_messages: int = 1024
    max_n: int = 64
    max_tokens: int = 4096
    default_max_tokens: int = 512
    max_tools: int = 128
    max_generated_tokens: int = limits.MAX_GENERATED_TOKENS  # prompts x n x max_tokens of one call
    temperature: float | None = None  # set: every call samples at it (an agent job's policy temperature)
    top_p: float | None = None  # likewise


@dataclass(frozen=True)
class SessionView:
    """What a session recorded after its last call: the ids the next prompt must extend, how many messages the
    conversation had then (the request's plus the returned assistant reply) and that reply."""

    ids: tuple[int, ...]
    n_messages: int
    reply: dict[str, Any] | None


@dataclass(frozen=True)
class CompletionRequest:
    """A checked request: the prompt(s) as token ids and how to sample them.

    Attributes:
        prompts: one prompt per entry (a chat request has one; a completions batch several).
        sampling: the engine's parameters (``n`` samples per prompt).
        stop_strings: text stops, applied to the samples after generation (cut at token granularity).
        logprobs: return OpenAI's ``logprobs.content`` per choice.
        stream: answer as server-sent events.
        chat: a chat completion (choices carry a message) or a text completion.
        model: the ``model`` the caller named (echoed).
        echo: completions only: the prompt's text before each choice's.
        n_messages: a chat request's messages (the session's count after this call is one more).
        tool_names: the tools the request offered (a call of another name stays text).
        include_usage: ``stream_options.include_usage``: a last chunk with the token counts.
    """

    prompts: list[list[int]]
    sampling: SamplingParams
    stop_strings: tuple[str, ...] = ()
    logprobs: bool = False
    stream: bool = False
    chat: bool = True
    model: str = ""
    echo: bool = False
    n_messages: int = 0
    tool_names: frozenset[str] = field(default_factory=frozenset)
    include_usage: bool = False


def _obj(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise EndpointError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _check_keys(body: dict[str, Any], allowed: set[str]) -> None:
    for k, v in body.items():
        if k in allowed or k in _IGNORED:
            continue
        if k in _NEUTRAL:
            if v in (_NEUTRAL[k], None) or (k == "response_format" and isinstance(v, dict)
                                             and v.get("type") == "text"):
                continue
            raise EndpointError(f"{k}={json.dumps(v)[:80]} is not supported by this endpoint (the policy's "
                                f"logprobs must stay those it samples with); leave it out", param=k)
        raise EndpointError(f"unknown field {k!r}; this endpoint takes {sorted(allowed)}", param=k)


def _int(body: dict, key: str, default: int | None, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise EndpointError(f"{key} must be an integer, got {json.dumps(v)[:40]}", param=key)
    if not lo <= v <= hi:
        raise EndpointError(f"{key} must be in [{lo}, {hi}], got {v}", param=key)
    return v


def _float(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise EndpointError(f"{key} must be a finite number, got {json.dumps(v)[:40]}", param=key)
    if not lo <= v <= hi:
        raise EndpointError(f"{key} must be in [{lo:g}, {hi:g}], got {v:g}", param=key)
    return float(v)


def _stops(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP_STRINGS:
        raise EndpointError(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them",
                            param="stop")
    return tuple(stops)


def _token_ids(v: Any, where: str, vocab_size: int) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise EndpointError(f"{where} must be a list of token ids (integers)", param=where)
    bad = next((t for t in v if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise EndpointError(f"{where} holds {bad}, outside the model's vocabulary [0, {vocab_size})", param=where)
    return list(v)


def _content(m: dict, where: str) -> str:
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # content parts: text only
        out = []
        for j, part in enumerate(c):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise EndpointError(f"{where}.content[{j}]: only text parts are supported "
                                    f"({{'type': 'text', 'text': ...}})", param=f"{where}.content")
            out.append(part["text"])
        return "".join(out)
    raise EndpointError(f"{where}.content must be a string, a list of text parts or null", param=f"{where}.content")


def _tool_calls_for_template(calls: Any, where: str) -> list[dict[str, Any]]:
    """OpenAI ``tool_calls`` as chat templates read them (``function.arguments`` an object, not a JSON string)."""
    if not isinstance(calls, list):
        raise EndpointError(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
            raise EndpointError(f"{where}.tool_calls[{j}] must be {{'type': 'function', 'function': {{'name': ..., "
                                f"'arguments': ...}}}}", param=f"{where}.tool_calls")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise EndpointError(f"{where}.tool_calls[{j}].function.arguments is not JSON",
                                    param=f"{where}.tool_calls") from None
        out.append({"type": "function", "function": {"name": fn["name"], "arguments": args},
                    **({"id": c["id"]} if isinstance(c.get("id"), str) else {})})
    return out


def _messages(body: dict, lim: EndpointLimits) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise EndpointError("messages must be a non-empty list", param="messages")
    if len(msgs) > lim.max_messages:
        raise EndpointError(f"messages: {len(msgs)} messages; the limit is {lim.max_messages}", param="messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise EndpointError(f"{where} must be an object", param=where)
        extra = sorted(k for k, v in m.items() if k not in _MESSAGE_KEYS and v is not None)
        if extra:
            raise EndpointError(f"{where}: unknown field(s) {extra}", param=where)
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in _ROLES:
            raise EndpointError(f"{where}.role must be one of {list(_ROLES)}, got {m.get('role')!r}", param=where)
        msg: dict[str, Any] = {"role": role, "content": _content(m, where)}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls_for_template(m["tool_calls"], where)
        if role == "tool" and isinstance(m.get("tool_call_id"), str):
            msg["tool_call_id"] = m["tool_call_id"]
        if role != "assistant" and any(m.get(k) is not None for k in TOKEN_FIELDS):
            raise EndpointError(f"{where}: token fields ride on assistant messages only", param=where)
        out.append(msg)
    return out


def _tools(body: dict, lim: EndpointLimits) -> list[dict[str, Any]] | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise EndpointError("tool_choice: only 'auto' and 'none' are supported (the model decides; nothing "
                            "forces its tokens)", param="tool_choice")
    if tools is None:
        return None
    if not isinstance(tools, list) or len(tools) > lim.max_tools:
        raise EndpointError(f"tools must be a list of at most {lim.max_tools} tools", param="tools")
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]):
            raise EndpointError(f"tools[{j}] must be {{'type': 'function', 'function': {{'name': ..., "
                                f"'parameters': ...}}}}", param="tools")
    return tools if choice != "none" else None


def _sampling(body: dict, lim: EndpointLimits, prompt_len: int, max_len: int, *, n_cap: int) -> SamplingParams:
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    room = max_len - prompt_len
    if room < 1:
        raise EndpointError(f"the prompt has {prompt_len} tokens; the model has {max_len} positions",
                            param="messages", code="context_length_exceeded")
    max_tokens = _int(body, key, min(lim.default_max_tokens, room), 1, lim.max_tokens)
    if max_tokens > room:
        raise EndpointError(f"{key}={max_tokens} with a {prompt_len}-token prompt exceeds the model's {max_len} "
                            f"positions", param=key, code="context_length_exceeded")
    temperature = _float(body, "temperature", 1.0 if lim.temperature is None else lim.temperature, 0.0,
                         min(2.0, limits.MAX_TEMPERATURE))
    top_p = _float(body, "top_p", 1.0 if lim.top_p is None else lim.top_p, 1e-9, 1.0)
    for key, got, pinned in (("temperature", temperature, lim.temperature), ("top_p", top_p, lim.top_p)):
        if pinned is not None and got != pinned:
            raise EndpointError(f"{key}={got:g}: this endpoint samples the policy being trained at {key}={pinned:g} "
                                f"(the job's policy.generation.{key}); leave it out or pass {pinned:g}", param=key)
    return SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                          n=_int(body, "n", 1, 1, n_cap), seed=_int(body, "seed", None, 0, limits.INT64_MAX))


def _check_budget(prompts: int, sampling: SamplingParams, lim: EndpointLimits) -> None:
    tokens = prompts * sampling.n * sampling.max_tokens
    if tokens > lim.max_generated_tokens:
        raise EndpointError(f"prompts x n x max_tokens = {prompts} x {sampling.n} x {sampling.max_tokens} = {tokens} "
                            f"tokens; the limit of one call is {lim.max_generated_tokens}", param="max_tokens")


def _include_usage(body: dict) -> bool:
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict) or set(so) - {"include_usage", "include_obfuscation"}:
        raise EndpointError("stream_options takes include_usage only", param="stream_options")
    return bool(so.get("include_usage"))


def _flags(body: dict, *, chat: bool) -> tuple[bool, bool]:
    for k in ("stream", "echo"):
        if body.get(k) is not None and not isinstance(body[k], bool):
            raise EndpointError(f"{k} must be true or false", param=k)
    lp = body.get("logprobs")
    if chat:
        if lp is not None and not isinstance(lp, bool):
            raise EndpointError("logprobs must be true or false", param="logprobs")
        if body.get("top_logprobs") not in (None, 0):
            raise EndpointError("top_logprobs is not supported (each choice carries the sampled tokens' logprobs)",
                                param="top_logprobs")
        return bool(lp), bool(body.get("stream"))
    if lp not in (None, 0, 1, True, False):
        raise EndpointError("logprobs: only the sampled token's logprob is returned (0, 1 or null)",
                            param="logprobs")
    return bool(lp), bool(body.get("stream"))


def _same_reply(sent: dict[str, Any], returned: dict[str, Any]) -> bool:
    """A client's copy of an assistant reply is the returned one: same text, or same tool calls (names and
    arguments; ids and text around them may be dropped by the client)."""
    if sent.get("role") != "assistant":
        return False
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in sent.get("tool_calls") or []]
    want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in returned.get("tool_calls") or []]
    if want:
        return calls == want
    return not calls and sent["content"] == (returned.get("content") or "")


def _spliced_prompt(raw: list[dict], msgs: list[dict], tools, renderer: ChatRenderer, vocab_size: int,
                    session: SessionView | None) -> list[int]:
    k = next((i for i in range(len(raw) - 1, -1, -1) if msgs[i]["role"] == "assistant"
              and raw[i].get("generation_token_ids") is not None), None)
    if k is not None:
        m = raw[k]
        if m.get("prompt_token_ids") is None:
            raise EndpointError(f"messages[{k}] carries generation_token_ids without prompt_token_ids: send back "
                                f"both fields as the endpoint returned them", param=f"messages[{k}]")
        base = (_token_ids(m["prompt_token_ids"], f"messages[{k}].prompt_token_ids", vocab_size)
                + _token_ids(m["generation_token_ids"], f"messages[{k}].generation_token_ids", vocab_size))
    elif session is not None and session.ids:
        k = session.n_messages - 1
        if len(msgs) <= k or session.reply is None or not _same_reply(msgs[k], session.reply):
            raise EndpointError(
                f"the conversation does not continue this session's: message {k} should be the assistant reply "
                f"the endpoint returned. Send it back as returned (with its generation_token_ids), or start a new "
                f"session for a new conversation", param="messages", code="session_history_mismatch")
        base = list(session.ids)
    else:
        return renderer.opening(msgs, tools)
    new = msgs[k + 1:]
    if not new:
        raise EndpointError("the last message is an assistant turn: a chat completion answers the messages after "
                            "it (user or tool)", param="messages")
    if base[-1] not in renderer.stop_ids:  # a turn cut by its token budget: end it as the template would
        base = base + [renderer.end_of_turn_id]
    history = msgs[:k + 1]
    try:
        delta, _ = renderer.delta(history, new, tools)
    except ValueError as exc:
        raise EndpointError(f"cannot render the new messages after the spliced turn: {exc}",
                            param="messages") from None
    return base + delta


def parse_chat(body: Any, renderer: ChatRenderer, *, vocab_size: int, max_len: int, lim: EndpointLimits,
               session: SessionView | None) -> tuple[CompletionRequest, list[dict[str, Any]] | None]:
    """A ``/v1/chat/completions`` body → the checked request (one prompt) and its tools.

    Raises:
        EndpointError: a malformed or unsupported field, an unsplicable history, a prompt too long.
    """
    body = _obj(body)
    _check_keys(body, _CHAT_KEYS)
    raw = body.get("messages")
    msgs = _messages(body, lim)
    tools = _tools(body, lim)
    logprobs, stream = _flags(body, chat=True)
    stops = _stops(body)
    try:
        prompt = _spliced_prompt(raw, msgs, tools, renderer, vocab_size, session)
    except EndpointError:
        raise
    except ValueError as exc:  # the template refused the messages (e.g. a system message not first)
        raise EndpointError(f"the chat template refused the messages: {exc}", param="messages") from None
    except Exception as exc:  # noqa: BLE001 - Jinja raises its own errors (raise_exception in a template)
        raise EndpointError(f"the chat template refused the messages: {exc}", param="messages") from None
    sampling = _sampling(body, lim, len(prompt), max_len, n_cap=1 if session is not None else lim.max_n)
    names = frozenset(t["function"]["name"] for t in tools or [])
    return CompletionRequest([prompt], sampling, stops, logprobs, stream, True, str(body.get("model") or ""),
                             n_messages=len(msgs), tool_names=names, include_usage=_include_usage(body)), tools


def parse_completion(body: Any, encode, *, vocab_size: int, max_len: int, lim: EndpointLimits,
                     session: SessionView | None) -> CompletionRequest:
    """A ``/v1/completions`` body → the checked request; ``prompt`` is a string, token ids, or a list of either.
    In a session the (single) prompt must extend the session's ids.

    Raises:
        EndpointError: as :func:`parse_chat`.
    """
    body = _obj(body)
    _check_keys(body, _COMPLETION_KEYS)
    p = body.get("prompt")
    if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p)):
        p = [p]
    if not isinstance(p, list) or not p or len(p) > limits.MAX_GENERATE_PROMPTS:
        raise EndpointError(f"prompt must be a string, a list of token ids, or a list of at most "
                            f"{limits.MAX_GENERATE_PROMPTS} of those", param="prompt")
    prompts = []
    for i, q in enumerate(p):
        ids = encode(q) if isinstance(q, str) else _token_ids(q, f"prompt[{i}]", vocab_size)
        if not ids:
            raise EndpointError(f"prompt[{i}] is empty", param="prompt")
        prompts.append(ids)
    if session is not None and len(prompts) != 1:
        raise EndpointError("a session carries one prompt per call", param="prompt")
    logprobs, stream = _flags(body, chat=False)
    sampling = _sampling(body, lim, max(map(len, prompts)), max_len, n_cap=1 if session is not None else lim.max_n)
    _check_budget(len(prompts), sampling, lim)
    return CompletionRequest(prompts, sampling, _stops(body), logprobs, stream, False, str(body.get("model") or ""),
                             echo=bool(body.get("echo")), include_usage=_include_usage(body))
