"""The endpoint's sessions: one trajectory per ``X-Session-Id``, recorded token by token as the calls go.

A session's record is what the trainer needs of a trajectory driven through the endpoint: every token id in
order, whether the model sampled it (mask 1: its logprob and weight version kept) or the caller's messages /
tools / environment wrote it (mask 0), the number of calls (turns) and what the next call must continue. Each
call's prompt must extend the recorded ids exactly — the first differing token is named in the refusal — and a
session takes one call at a time (a second concurrent call is refused, never interleaved). Bounded: at most
``max_sessions`` live, each at most ``max_tokens`` tokens (and never more than the model's context: every call's
prompt is the whole trajectory); a session idle for ``idle_s`` is forgotten (its engine K/V released by the caller
of :meth:`SessionBook.expire`). An ended session's id is not reopened: a call under it is refused (410), so an agent
still running after its trajectory was read records nothing.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .chat import EndpointError, SessionView

__all__ = ["SESSION_HEADER", "SessionBook", "SessionRecord", "check_session_id"]

SESSION_HEADER = "X-Session-Id"
CLOSED_KEPT = 65_536  # ended session ids remembered (a call under one is refused: an agent past its time)
_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def check_session_id(value: str | None) -> str | None:
    """The header's session id, or None; refuses ids that are not 1-128 of ``[A-Za-z0-9._:-]``."""
    if value is None:
        return None
    if not _ID.match(value):
        raise EndpointError(f"{SESSION_HEADER} must be 1-128 characters of [A-Za-z0-9._:-]", param=SESSION_HEADER)
    return value


@dataclass
class SessionRecord:
    """One session's trajectory so far (see the module docstring)."""

    token_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # -1 where the caller wrote the token
    turns: int = 0
    tool_calls: int = 0
    n_messages: int = 0
    reply: dict[str, Any] | None = None
    used: float = field(default_factory=time.monotonic)
    busy: bool = False

    def view(self) -> SessionView:
        return SessionView(tuple(self.token_ids), self.n_messages, self.reply)

    def to_json(self) -> dict[str, Any]:
        return {"token_ids": self.token_ids, "loss_mask": self.mask, "logprobs": self.logprobs,
                "weight_versions": self.versions, "turns": self.turns, "tool_calls": self.tool_calls}


class SessionBook:
    """The live sessions of one endpoint (thread-safe)."""

    def __init__(self, *, max_sessions: int = 1024, max_tokens: int = 1 << 20, idle_s: float = 3600.0) -> None:
        self.max_sessions, self.max_tokens, self.idle_s = max_sessions, max_tokens, idle_s
        self._s: dict[str, SessionRecord] = {}
        self._closed: OrderedDict[str, None] = OrderedDict()  # ended ids (the newest CLOSED_KEPT): never reopened
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._s)

    def begin(self, sid: str) -> SessionView:
        """Take ``sid`` for one call (created when new) and return what the call must continue.

        Raises:
            EndpointError: 409 when a call of ``sid`` is in flight; 429 when ``max_sessions`` are live.
        """
        with self._lock:
            rec = self._s.get(sid)
            if rec is None and sid in self._closed:
                raise EndpointError(f"session {sid!r} has ended (its trajectory was read and closed); a session is "
                                    f"one trajectory: start a new one under a new id", status=410,
                                    code="session_closed")
            if rec is None:
                if len(self._s) >= self.max_sessions:
                    raise EndpointError(f"{self.max_sessions} sessions are open; end some (DELETE "
                                        f"/v1/fp8rl/sessions/ID) or wait for idle ones to expire", status=429,
                                        type="rate_limit_error", code="too_many_sessions")
                rec = self._s[sid] = SessionRecord()
            if rec.busy:
                raise EndpointError(f"session {sid!r} has a call in flight: a session is one trajectory, its calls "
                                    f"go one after another", status=409, code="session_busy")
            rec.busy, rec.used = True, time.monotonic()
            return rec.view()

    def end(self, sid: str) -> None:
        """Release ``sid`` after a call that recorded nothing (refused or failed)."""
        with self._lock:
            rec = self._s.get(sid)
            if rec is not None:
                rec.busy = False
                if not rec.token_ids:
                    del self._s[sid]

    def record(self, sid: str, prompt: list[int], ids: list[int], logprobs: list[float], version: int, *,
               n_messages: int, reply: dict[str, Any] | None) -> None:
        """Append one call: the prompt's new tokens (mask 0) and the model's (mask 1), then release ``sid``.

        Raises:
            EndpointError: the prompt does not extend the recorded ids (names the first differing token), or the
                trajectory would pass ``max_tokens``. Nothing is recorded then.
        """
        with self._lock:
            rec = self._s.get(sid)
            if rec is None:  # closed while its call ran (an agent past its time): nothing to record into
                return
            try:
                old = rec.token_ids
                check_extends(old, prompt)
                if len(prompt) + len(ids) > self.max_tokens:
                    raise EndpointError(f"session trajectory would hold {len(prompt) + len(ids)} tokens; the limit "
                                        f"is {self.max_tokens}", code="session_too_long")
                new = prompt[len(old):]
                rec.token_ids = old + new + list(ids)
                rec.mask += [0] * len(new) + [1] * len(ids)
                rec.logprobs += [0.0] * len(new) + list(logprobs)
                rec.versions += [-1] * len(new) + [version] * len(ids)
                rec.turns += 1
                rec.tool_calls += len((reply or {}).get("tool_calls") or [])
                rec.n_messages, rec.reply = n_messages + 1, reply
            finally:
                rec.busy, rec.used = False, time.monotonic()

    def get(self, sid: str) -> SessionRecord | None:
        with self._lock:
            return self._s.get(sid)

    def drop(self, sid: str) -> SessionRecord | None:
        """End ``sid``: its record (None when there is none); later calls under the id are refused (410)."""
        with self._lock:
            self._closed[sid] = None
            self._closed.move_to_end(sid)
            while len(self._closed) > CLOSED_KEPT:
                self._closed.popitem(last=False)
            return self._s.pop(sid, None)

    def expire(self) -> list[str]:
        """Forget sessions idle past ``idle_s`` (not in a call); returns their ids."""
        now = time.monotonic()
        with self._lock:
            gone = [k for k, r in self._s.items() if not r.busy and now - r.used > self.idle_s]
            for k in gone:
                del self._s[k]
        return gone


def check_extends(old: list[int], prompt: list[int]) -> None:
    """Raises :class:`EndpointError` (``session_history_mismatch``) unless ``prompt`` starts with ``old``."""
    if len(prompt) >= len(old) and prompt[:len(old)] == old:
        return
    at = next((i for i, (a, b) in enumerate(zip(old, prompt, strict=False)) if a != b), min(len(old), len(prompt)))
    raise EndpointError(
        f"the prompt does not extend this session's trajectory: token {at} is "
        f"{prompt[at] if at < len(prompt) else 'missing'} where the session holds "
        f"{old[at] if at < len(old) else 'nothing'} ({len(old)} tokens recorded). A session is one trajectory: "
        f"send the assistant turns back with their token ids, or start a new session", code="session_history_mismatch")
