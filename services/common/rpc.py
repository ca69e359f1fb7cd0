"""What a servicer method raises and how it becomes a status: :class:`Abort`, :func:`require`, :func:`rpc_method`.

Invariant: no exception leaves a servicer as UNKNOWN — an :class:`Abort` is its own status, Redis being
away is UNAVAILABLE (retryable), anything else INTERNAL with the traceback in the log only.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Sequence

import grpc
import redis

from fp8rl.refit import RefitConnectionError

log = logging.getLogger("fp8rl.service")

__all__ = ["Abort", "check_token_ids", "require", "rpc_method"]


class Abort(Exception):
    """Ends an RPC with ``code`` and a message that names what was wrong (see :func:`rpc_method`)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def require(ok: object, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> None:
    """Raise :class:`Abort` (INVALID_ARGUMENT by default) with ``message`` unless ``ok``."""
    if not ok:
        raise Abort(code, message)


def check_token_ids(ids: Sequence[int], vocab_size: int, max_len: int, what: str) -> list[int]:
    """``ids`` as a list, after checking it is non-empty, in ``[0, vocab_size)`` and at most ``max_len`` long."""
    ids = list(ids)
    require(ids, f"{what} is empty")
    require(len(ids) <= max_len, f"{what} has {len(ids)} tokens; the model holds at most {max_len} positions")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    require(bad is None, f"{what} holds token id {bad}, outside the model's vocabulary [0, {vocab_size})")
    return ids


def rpc_method(fn: Callable) -> Callable:
    """Decorate a servicer method (unary or server-streaming).

    :class:`Abort` → its status; Redis unreachable, or an exception whose class says ``transient = True`` (a trainer
    whose rank group failed and is being restarted) → UNAVAILABLE (retryable); other errors → INTERNAL.
    """
    name = fn.__qualname__

    def fail(exc: BaseException, context: grpc.ServicerContext):
        if isinstance(exc, Abort):
            log.info("%s -> %s: %s", name, exc.code.name, exc.message)
            context.abort(exc.code, exc.message)
        if isinstance(exc, redis.ConnectionError | redis.TimeoutError | RefitConnectionError):
            log.warning("%s: Redis unreachable: %s", name, exc)  # transient: clients retry UNAVAILABLE
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{name}: the job state in Redis is unreachable ({exc}); retry")
        if getattr(exc, "transient", False):
            log.warning("%s: %s: %s (transient)", name, type(exc).__name__, exc)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{name}: {type(exc).__name__}: {exc}; retry")
        log.exception("%s failed", name)
        context.abort(grpc.StatusCode.INTERNAL, f"{name} failed: {type(exc).__name__}: {exc}")

    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def stream(self, request, context):
            try:
                yield from fn(self, request, context)
            except Exception as exc:  # noqa: BLE001 - every error becomes a status, none escapes as UNKNOWN
                fail(exc, context)
        return stream

    @functools.wraps(fn)
    def unary(self, request, context):
        try:
            return fn(self, request, context)
        except Exception as exc:  # noqa: BLE001
            fail(exc, context)
    return unary
