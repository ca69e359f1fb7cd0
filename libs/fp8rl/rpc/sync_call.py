"""Plain (blocking) servicer methods, run on worker threads behind an asyncio gRPC server.

fp8rl's servicers are ordinary functions ``Method(request, context)`` that return a response or yield
a stream of them, and do heavy blocking work (a TrainStep, a batch of rollouts). The server that
hosts them is ``grpc.aio`` (:mod:`fp8rl.rpc.guard` says why); this module is the bridge:

* :class:`SyncContext` is the ``context`` such a method gets — the part of ``grpc.ServicerContext``
  fp8rl uses: ``abort``, ``set_code`` / ``set_details`` / ``code`` / ``details``, ``is_active``,
  ``time_remaining``, ``invocation_metadata``, ``peer``, ``add_callback``.
* :func:`run_unary` and :func:`pump_stream` run a method on a worker thread and report an
  :class:`Outcome`; a stream's items are handed to the loop one at a time through ``push``, which
  blocks while the client is slow (bounded buffering) and returns False once the call is over.

Invariant: ``is_active()`` turns False as soon as the call ends for any reason — the client cancels,
its deadline passes, the server stops — so a method that checks it between decode steps, micro-batches
or items stops promptly and frees its thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc

__all__ = ["AbortRpc", "Outcome", "SyncContext", "pump_stream", "run_unary"]

log = logging.getLogger("fp8rl.rpc")


class AbortRpc(BaseException):
    """Raised by :meth:`SyncContext.abort` to end the method (a BaseException, so ``except Exception``
    blocks in servicer code cannot swallow it, as with gRPC's own abort)."""


class SyncContext:
    """The ``context`` argument of a plain servicer method (see the module docstring).

    Args:
        metadata: the call's invocation metadata.
        peer: the client's address as gRPC names it (``ipv4:127.0.0.1:54321``).
        deadline: the call's deadline on :func:`time.monotonic`'s clock, or None.
    """

    def __init__(self, metadata: Iterable[tuple[str, Any]], peer: str, deadline: float | None) -> None:
        self._metadata = tuple(metadata or ())
        self._peer = peer
        self._deadline = deadline
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self.aborted = False

    # -- what the call is ---------------------------------------------------------------------
    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def is_active(self) -> bool:
        """False once the call ended (cancelled, past its deadline, server stopping)."""
        return not self._done.is_set() and (self._deadline is None or time.monotonic() < self._deadline)

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """Call ``callback`` once the call has ended; returns False (and does not register) when it already has."""
        with self._lock:
            if self._done.is_set():
                return False
            self._callbacks.append(callback)
            return True

    # -- how it ends --------------------------------------------------------------------------
    def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        """End the call with ``code`` and ``details`` (the first abort wins); raises :class:`AbortRpc`."""
        if not self.aborted:
            self.aborted, self._code, self._details = True, code, details
        raise AbortRpc(code, details)

    def set_code(self, code: grpc.StatusCode) -> None:
        if not self.aborted:
            self._code = code

    def set_details(self, details: str) -> None:
        if not self.aborted:
            self._details = details

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

    def finish(self) -> None:
        """The call is over (the gate calls this once, from any thread): ``is_active`` turns False, callbacks run."""
        with self._lock:
            if self._done.is_set():
                return
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            try:
                cb()
            except Exception:  # noqa: BLE001 - a callback's failure is its own; the call is over either way
                log.exception("callback of a finished call failed")


@dataclass
class Outcome:
    """How a method ended: ``response`` (unary), or the status it left (``code`` None = OK), or ``error``."""

    response: Any = None
    code: grpc.StatusCode | None = None
    details: str = ""
    error: BaseException | None = None


def _ended(ctx: SyncContext, exc: BaseException | None = None) -> Outcome:
    if isinstance(exc, AbortRpc) or exc is None:
        code = ctx.code()
        return Outcome(code=None if code == grpc.StatusCode.OK else code, details=ctx.details())
    return Outcome(code=ctx.code(), details=ctx.details(), error=exc)


def run_unary(method: Callable[[Any, SyncContext], Any], request: Any, ctx: SyncContext) -> Outcome:
    """Runs a unary-response method (on a worker thread)."""
    try:
        response = method(request, ctx)
    except BaseException as exc:  # noqa: BLE001 - reported to the loop, which turns it into a status
        return _ended(ctx, exc)
    out = _ended(ctx)
    out.response = response
    return out


def pump_stream(method: Callable[[Any, SyncContext], Iterable[Any]], request: Any, ctx: SyncContext,
                push: Callable[[Any], bool]) -> Outcome:
    """Runs a server-streaming method (on a worker thread), handing each item to ``push`` until it says stop."""
    items = None
    try:
        items = iter(method(request, ctx))
        for item in items:
            if not push(item):
                break
    except BaseException as exc:  # noqa: BLE001
        return _ended(ctx, exc)
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()  # the generator's finally blocks (slots, locks) run here, on this thread
    return _ended(ctx)
