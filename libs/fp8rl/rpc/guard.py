"""The call gate in front of every fp8rl servicer: nothing unauthenticated, incomplete or oversized holds a worker.

Every server :func:`fp8rl.rpc.server.build_server` makes is a ``grpc.aio`` server on the process's
I/O loop (:mod:`fp8rl.rpc.io_loop`). Receiving bytes costs no thread there; servicer code runs on
worker threads only once a call has earned one. :class:`CallGate` wraps each servicer method and
takes a call through these steps, in order, refusing it at the first that fails:

1. **Token** — from the call's metadata alone (:class:`~fp8rl.rpc.scopes.TokenCheck`), before a byte
   of the request is read: UNAUTHENTICATED / PERMISSION_DENIED. A refused call's message is never read
   (its bytes stay in the peer's flow-control window), so a caller without a token can neither hold a
   worker nor make the server buffer anything.
2. **Request message** — read on the loop, within ``first_message_s`` of the call's start
   (DEADLINE_EXCEEDED "no request message"), at most ``max_waiting`` calls waiting at once
   (RESOURCE_EXHAUSTED). The server-wide receive limit is the largest request any of its methods
   takes, which gRPC enforces from the message's length prefix before buffering it; each method's own
   limit (:func:`request_limit`) is checked here (RESOURCE_EXHAUSTED naming the method and both sizes).
3. **Parse** — bytes that are not the method's request message are INVALID_ARGUMENT naming the parse
   error (gRPC would answer INTERNAL: a bad request is the caller's mistake, never the server's).
4. **A worker** — *long* calls (everything not :func:`is_light`) take one of ``long_calls`` slots or are
   refused at once with UNAVAILABLE ("busy, retry"); *light* calls (Status, GetJob, ListJobs) take one of
   ``light_calls`` slots of their own, waiting up to ``light_wait_s`` (then UNAVAILABLE). Asyncio methods —
   health, the controller's WatchJob — pass steps 1-3 and then run on the loop itself: they never block,
   take no slot, and health always answers. A health ``Check`` without a token skips step 2 altogether: it is
   answered with the server's overall status and its message is never read
   (:meth:`~fp8rl.rpc.scopes.TokenCheck.health_open`), so no caller without a token can hold a place among
   ``max_waiting`` or make the server buffer more than one HTTP/2 stream window; ``Watch`` needs a token.
5. **Run** — the method runs on its pool's thread (:mod:`fp8rl.rpc.sync_call`); its ``context.is_active()``
   turns False the moment the call ends (client cancel, deadline, server stop), and the slot is free
   again only when the method has returned.

Every call that reaches the gate is reported to ``observer(method, code, seconds)`` with the code it got.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc import aio

from fp8rl import limits

from .scopes import HEALTH_CHECK, HEALTH_SERVICE, REFLECTION_SERVICE, TokenCheck
from .sync_call import Outcome, SyncContext, pump_stream, run_unary

__all__ = ["LIGHT_METHODS", "LIGHT_SERVICES", "CallGate", "GateLimits", "Observer", "is_light", "request_limit"]

log = logging.getLogger("fp8rl.rpc")

LIGHT_SERVICES = frozenset({HEALTH_SERVICE, REFLECTION_SERVICE})
"""Services whose every method is light."""

LIGHT_METHODS = frozenset({"Status", "GetJob", "ListJobs"})
"""Method names (of any service) that only read a little state: light (their own slots, short waits)."""

Observer = Callable[[str, grpc.StatusCode, float], None]
"""``observer(method, code, seconds)``: told how every call through the gate ended."""

_STREAM_CREDITS = 4  # items a streaming method may run ahead of a slow client


def is_light(method: str) -> bool:
    """Whether ``method`` (``/package.Service/Method``) is a light call (see the module docstring)."""
    service, _, name = method.lstrip("/").partition("/")
    return service in LIGHT_SERVICES or name in LIGHT_METHODS


def request_limit(method: str, bulk_bytes: int) -> int:
    """Largest request message ``method`` accepts: ``bulk_bytes`` for the batch-carrying RPCs
    (:data:`fp8rl.limits.BULK_REQUEST_METHODS`), else :data:`fp8rl.limits.REQUEST_BYTES` or the small default."""
    name = method.rpartition("/")[2]
    if name in limits.BULK_REQUEST_METHODS:
        return bulk_bytes
    return limits.REQUEST_BYTES.get(name, limits.MAX_REQUEST_BYTES)


@dataclass(frozen=True)
class GateLimits:
    """How many calls a server runs and waits for (``build_server`` derives them from its flags).

    Attributes:
        long_calls: long calls running at once (worker threads of the long pool); one more is UNAVAILABLE.
        light_calls: light calls running at once (threads of the light pool).
        first_message_s: seconds from a call's start to its request message; later is DEADLINE_EXCEEDED.
        light_wait_s: seconds a light call waits for a slot before UNAVAILABLE.
        max_waiting: calls past the token check that may wait (for their message or a light slot) at once.
        bulk_request_bytes: the request limit of the batch-carrying RPCs (:func:`request_limit`).
    """

    long_calls: int
    light_calls: int
    first_message_s: float = limits.FIRST_MESSAGE_TIMEOUT_S
    light_wait_s: float = limits.LIGHT_CALL_WAIT_S
    max_waiting: int = limits.MAX_WAITING_CALLS
    bulk_request_bytes: int = limits.MAX_BULK_MESSAGE_BYTES

    def __post_init__(self) -> None:
        for name in ("long_calls", "light_calls", "max_waiting", "bulk_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("first_message_s", "light_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class _Refuse(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


@dataclass(frozen=True)
class _Method:
    full: str  # /package.Service/Method
    light: bool
    max_request_bytes: int
    deserialize: Callable[[bytes], Any] | None


class CallGate:
    """Wraps servicer methods for an aio server (see the module docstring). Create and use it on the I/O loop.

    Args:
        tokens: the token check of the server's scopes.
        limits_: slots, waits and sizes.
        observer: told every call's method, final code and duration (metrics); None: nobody.
    """

    def __init__(self, tokens: TokenCheck, limits_: GateLimits, observer: Observer | None = None) -> None:
        self.tokens, self.limits, self.observer = tokens, limits_, observer
        self._long_pool = concurrent.futures.ThreadPoolExecutor(limits_.long_calls, thread_name_prefix="fp8rl-grpc")
        self._light_pool = concurrent.futures.ThreadPoolExecutor(limits_.light_calls,
                                                                 thread_name_prefix="fp8rl-grpc-light")
        self._long_free = limits_.long_calls  # touched on the loop only
        self._light: asyncio.Semaphore | None = None
        self._waiting = 0
        self._active: set[SyncContext] = set()
        self.loop: asyncio.AbstractEventLoop | None = None

    # -- wrapping -----------------------------------------------------------------------------
    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """The aio handler that takes ``handler``'s calls through the gate."""
        if handler.request_streaming:  # reflection (async) is the only one fp8rl serves
            return self._wrap_request_stream(method, handler)
        spec = _Method(method, is_light(method), request_limit(method, self.limits.bulk_request_bytes),
                       handler.request_deserializer)
        inner = handler.unary_stream if handler.response_streaming else handler.unary_unary
        if inspect.iscoroutinefunction(inner) or inspect.isasyncgenfunction(inner):
            return self._wrap_on_loop(spec, handler, inner)
        if handler.response_streaming:

            async def stream(_requests, context: aio.ServicerContext) -> None:
                await self._serve(spec, context, lambda request, ctx, push: pump_stream(inner, request, ctx, push),
                                  streaming=True)

            return grpc.stream_stream_rpc_method_handler(stream, response_serializer=handler.response_serializer)
        inner = handler.unary_unary

        async def unary(_requests, context: aio.ServicerContext) -> Any:
            return await self._serve(spec, context, lambda request, ctx, _push: run_unary(inner, request, ctx),
                                     streaming=False)

        return grpc.stream_unary_rpc_method_handler(unary, response_serializer=handler.response_serializer)

    def _wrap_on_loop(self, spec: _Method, handler: grpc.RpcMethodHandler, inner) -> grpc.RpcMethodHandler:
        """Asyncio methods (health): the same token check, request deadline, size and parse, then run on the loop
        itself — they are cheap and never block, so they take no worker and always answer."""

        async def call(context: aio.ServicerContext, write: bool) -> Any:
            t0 = time.perf_counter()
            try:
                metadata = context.invocation_metadata()
                refusal = self.tokens.refusal(spec.full, metadata)
                if refusal is not None:
                    raise _Refuse(*refusal)
                if spec.full == HEALTH_CHECK and self.tokens.health_open(metadata):
                    # no token: answered from the server's overall status (the empty request), its own message
                    # never read — it can be neither held nor fed, and it takes no place among the waiting
                    request = spec.deserialize(b"") if spec.deserialize is not None else b""
                else:
                    request = await self._receive(spec, context)
            except _Refuse as r:
                self._observe(spec.full, r.code, time.perf_counter() - t0)
                await context.abort(r.code, _bounded(r.details))
            try:
                if inspect.isasyncgenfunction(inner):
                    async for item in inner(request, context):
                        await context.write(item)
                    return None
                response = await inner(request, context)
                return None if write else response
            finally:
                self._observe(spec.full, context.code() or grpc.StatusCode.OK, time.perf_counter() - t0)

        if handler.response_streaming:
            async def stream(_requests, context):
                await call(context, True)

            return grpc.stream_stream_rpc_method_handler(stream, response_serializer=handler.response_serializer)

        async def unary(_requests, context):
            return await call(context, False)

        return grpc.stream_unary_rpc_method_handler(unary, response_serializer=handler.response_serializer)

    def _wrap_request_stream(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """Async bidirectional-streaming methods (server reflection): the token check, then the method itself."""
        if not handler.response_streaming:
            raise TypeError(f"{method}: client-streaming methods with a unary response are not served here")
        inner = handler.stream_stream

        async def checked(requests, context: aio.ServicerContext):
            refusal = self.tokens.refusal(method, context.invocation_metadata())
            if refusal is not None:
                self._observe(method, refusal[0], 0.0)
                await context.abort(*refusal)
            async for item in inner(requests, context):
                yield item

        return grpc.stream_stream_rpc_method_handler(checked, handler.request_deserializer,
                                                     handler.response_serializer)

    # -- one call -----------------------------------------------------------------------------
    async def _serve(self, spec: _Method, context: aio.ServicerContext, body, streaming: bool) -> Any:
        t0 = time.perf_counter()
        code: grpc.StatusCode | None = grpc.StatusCode.OK
        try:
            refusal = self.tokens.refusal(spec.full, context.invocation_metadata())
            if refusal is not None:
                raise _Refuse(*refusal)
            request, release = await self._receive_and_admit(spec, context)
            outcome = await self._run(spec, context, body, request, release, streaming)
            code, details = self._status(spec, outcome)
            if code != grpc.StatusCode.OK:
                raise _Refuse(code, details)
            return None if streaming else outcome.response
        except _Refuse as r:
            code = None  # observed before the status goes out: whoever reads the metrics after it sees the call
            self._observe(spec.full, r.code, time.perf_counter() - t0)
            await context.abort(r.code, _bounded(r.details))
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            if code is not None:
                self._observe(spec.full, code, time.perf_counter() - t0)

    async def _receive_and_admit(self, spec: _Method, context: aio.ServicerContext) -> tuple[Any, Callable[[], None]]:
        request = await self._receive(spec, context)
        self._waiting += 1  # waiting for a light worker counts as waiting too
        try:
            return request, await self._admit(spec, context)
        finally:
            self._waiting -= 1

    async def _receive(self, spec: _Method, context: aio.ServicerContext) -> Any:
        """The request message, read within the first-message deadline, checked against the method's size limit
        and parsed."""
        if self._waiting >= self.limits.max_waiting:
            raise _Refuse(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{spec.full}: {self._waiting} calls are already waiting for their request or a worker "
                          f"(the limit); retry with back-off")
        self._waiting += 1
        try:
            try:
                raw = await asyncio.wait_for(context.read(), self.limits.first_message_s)
            except TimeoutError:
                raise _Refuse(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"{spec.full}: no request message within {self.limits.first_message_s:g} s of the "
                              f"call's start") from None
            if raw is aio.EOF:
                raise _Refuse(grpc.StatusCode.INVALID_ARGUMENT, f"{spec.full}: the call carried no request message")
            if len(raw) > spec.max_request_bytes:
                raise _Refuse(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{spec.full}: the request is {len(raw)} bytes; this method takes at most "
                              f"{spec.max_request_bytes}")
            try:
                request = raw if spec.deserialize is None else spec.deserialize(raw)
            except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's malformed request
                raise _Refuse(grpc.StatusCode.INVALID_ARGUMENT,
                              f"malformed request for {spec.full}: {type(exc).__name__}: {str(exc)[:200]}") from None
            return request
        finally:
            self._waiting -= 1

    async def _admit(self, spec: _Method, context: aio.ServicerContext) -> Callable[[], None]:
        loop = asyncio.get_running_loop()
        if spec.light:
            if self._light is None:
                self._light = asyncio.Semaphore(self.limits.light_calls)
            remaining = context.time_remaining()
            wait = self.limits.light_wait_s if remaining is None else min(self.limits.light_wait_s, remaining)
            try:
                await asyncio.wait_for(self._light.acquire(), wait)
            except TimeoutError:
                raise _Refuse(grpc.StatusCode.UNAVAILABLE,
                              f"{spec.full}: server busy: {self.limits.light_calls} light calls are running; retry "
                              f"with back-off") from None
            sem = self._light
            return _once(lambda: loop.call_soon_threadsafe(sem.release))
        if self._long_free < 1:
            raise _Refuse(grpc.StatusCode.UNAVAILABLE,
                          f"{spec.full}: server busy: {self.limits.long_calls} long calls are running (the limit: "
                          f"worker threads minus those reserved for health and Status); retry with back-off")
        self._long_free -= 1

        def free() -> None:
            self._long_free += 1

        return _once(lambda: loop.call_soon_threadsafe(free))

    async def _run(self, spec: _Method, context: aio.ServicerContext, body, request: Any,
                   release: Callable[[], None], streaming: bool) -> Outcome:
        remaining = context.time_remaining()
        ctx = SyncContext(context.invocation_metadata(), context.peer(),
                          None if remaining is None else time.monotonic() + remaining)
        self._active.add(ctx)
        pool = self._light_pool if spec.light else self._long_pool
        loop = asyncio.get_running_loop()
        items: asyncio.Queue | None = asyncio.Queue() if streaming else None
        credits = threading.Semaphore(_STREAM_CREDITS)

        def push(item: Any) -> bool:  # on the worker thread: wait for a credit while the call lives
            while not credits.acquire(timeout=0.25):
                if not ctx.is_active():
                    return False
            if not ctx.is_active():
                return False
            loop.call_soon_threadsafe(items.put_nowait, item)
            return True

        try:
            job = pool.submit(body, request, ctx, push)
        except RuntimeError:  # the pool was shut down: the server is stopping
            release()
            self._active.discard(ctx)
            raise _Refuse(grpc.StatusCode.UNAVAILABLE, f"{spec.full}: the server is stopping; retry elsewhere") \
                from None
        job.add_done_callback(lambda _f: (ctx.finish(), release()))  # ran, failed or never started: free the slot
        get: asyncio.Future | None = None
        try:
            if not streaming:
                return await asyncio.wrap_future(job)
            done = asyncio.wrap_future(job)
            while True:
                get = asyncio.ensure_future(items.get())
                await asyncio.wait({get, done}, return_when=asyncio.FIRST_COMPLETED)
                if get.done():
                    await context.write(get.result())
                    credits.release()
                    continue
                while not items.empty():  # what the method yielded just before it returned
                    await context.write(items.get_nowait())
                return done.result()
        finally:
            if get is not None and not get.done():
                get.cancel()
            ctx.finish()  # cancelled, failed or done: is_active() turns False for the method
            self._active.discard(ctx)

    def _status(self, spec: _Method, outcome: Outcome) -> tuple[grpc.StatusCode, str]:
        if outcome.error is not None:
            if outcome.code is not None and outcome.code != grpc.StatusCode.OK:  # set_code(...) then raise
                return outcome.code, outcome.details
            log.error("%s failed", spec.full, exc_info=outcome.error)
            # gRPC's code for an exception the method did not turn into a status; its text stays in the log
            return grpc.StatusCode.UNKNOWN, f"{spec.full} failed: {type(outcome.error).__name__} (see the server log)"
        if outcome.code is not None:
            return outcome.code, outcome.details
        return grpc.StatusCode.OK, ""

    def _observe(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        if self.observer is not None:
            try:
                self.observer(method, code, seconds)
            except Exception:  # noqa: BLE001 - metrics never fail a call
                log.exception("call observer failed")

    # -- shutdown -----------------------------------------------------------------------------
    def close(self) -> None:
        """The server stopped: every running method sees ``is_active()`` False; the pools take no more work."""
        for ctx in list(self._active):
            ctx.finish()
        self._long_pool.shutdown(wait=False, cancel_futures=True)
        self._light_pool.shutdown(wait=False, cancel_futures=True)


def _bounded(details: str) -> str:
    """A status message cut to :data:`fp8rl.limits.MAX_STATUS_DETAILS_CHARS` (a longer one would reach the client
    as RESOURCE_EXHAUSTED on its metadata limit, hiding the real error)."""
    cap = limits.MAX_STATUS_DETAILS_CHARS
    return details if len(details) <= cap else f"{details[:cap]}... ({len(details)} characters)"


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` made idempotent and tolerant of a loop that has already closed."""
    lock, done = threading.Lock(), [False]

    def call() -> None:
        with lock:
            if done[0]:
                return
            done[0] = True
        try:
            fn()
        except RuntimeError:  # loop closed: nobody left to count slots for
            pass

    return call
