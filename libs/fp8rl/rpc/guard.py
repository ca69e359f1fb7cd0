"""The server-side request guard: malformed bytes are INVALID_ARGUMENT, and long calls never take every worker.

gRPC Python serves every call of a server from one thread pool. Two things follow, and
:class:`RequestGuard` (a server interceptor that :func:`fp8rl.rpc.server.build_server` installs on
every server) handles both:

* **Malformed requests.** Bytes that do not parse as the method's request message would make gRPC
  itself answer INTERNAL ("Exception deserializing request!"). The guard parses them instead and
  answers INVALID_ARGUMENT naming the method and the parse error: a bad request is the caller's
  mistake, never the server's.
* **Starvation.** A handful of long calls (a big Generate, a TrainStep, a WatchJob stream) would
  otherwise hold every worker, and health checks and Status — cheap, and what probes and the
  controller poll — would queue behind them until they time out. The guard lets at most
  ``max_concurrent`` *long* calls run at once, ``max_workers - reserved_workers`` by default; one more
  is refused at once with UNAVAILABLE ("busy, retry"), which frees its worker immediately. Light
  calls (:data:`LIGHT_SERVICES`, :data:`LIGHT_METHODS`) are never counted, so the reserved workers
  always answer them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc

__all__ = ["LIGHT_METHODS", "LIGHT_SERVICES", "RequestGuard", "is_light"]

LIGHT_SERVICES = frozenset({"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"})
"""Services whose every method is light (never counted against the long-call limit)."""

LIGHT_METHODS = frozenset({"Status", "GetJob", "ListJobs"})
"""Method names (of any service) that only read state: light, never counted."""


class _Malformed:
    """What the tolerant deserializer hands the handler instead of raising: the parse error."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's malformed request
            return _Malformed(f"{type(exc).__name__}: {str(exc)[:200]}")

    return parse


def is_light(method: str) -> bool:
    """Whether ``method`` (``/package.Service/Method``) is a light call (see the module docstring)."""
    service, _, name = method.lstrip("/").partition("/")
    return service in LIGHT_SERVICES or name in LIGHT_METHODS


class RequestGuard(grpc.ServerInterceptor):
    """Answers malformed requests with INVALID_ARGUMENT and caps concurrent long calls (see the module docstring).

    Args:
        max_concurrent: long (not light) calls allowed to run at once; >= 1.
    """

    def __init__(self, max_concurrent: int) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        self.max_concurrent = max_concurrent
        self._slots = threading.BoundedSemaphore(max_concurrent)

    def _enter(self, method: str, counted: bool, request: Any, context: grpc.ServicerContext) -> None:
        if isinstance(request, _Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request for {method}: {request.reason}")
        if counted and not self._slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"{method}: server busy: {self.max_concurrent} long calls are running (the limit: worker "
                          f"threads minus those reserved for health and Status); retry with back-off")

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        counted = not is_light(method)
        parse = _tolerant(handler.request_deserializer)
        out = handler.response_serializer
        if handler.request_streaming:
            return self._streaming_request(handler, method, counted, parse, out)

        if handler.response_streaming:
            inner_stream = handler.unary_stream

            def unary_stream(request, context):
                self._enter(method, counted, request, context)
                try:
                    yield from inner_stream(request, context)
                finally:
                    if counted:
                        self._slots.release()

            return grpc.unary_stream_rpc_method_handler(unary_stream, request_deserializer=parse,
                                                        response_serializer=out)
        inner = handler.unary_unary

        def unary_unary(request, context):
            self._enter(method, counted, request, context)
            try:
                return inner(request, context)
            finally:
                if counted:
                    self._slots.release()

        return grpc.unary_unary_rpc_method_handler(unary_unary, request_deserializer=parse, response_serializer=out)

    def _streaming_request(self, handler, method: str, counted: bool, parse, out):
        """Client-streaming methods: each message is checked as it is read; the whole call is counted."""
        inner = handler.stream_stream if handler.response_streaming else handler.stream_unary

        def checked(requests, context):
            for request in requests:
                if isinstance(request, _Malformed):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request for {method}: "
                                                                    f"{request.reason}")
                yield request

        def call(requests, context):
            self._enter(method, counted, None, context)
            try:
                return inner(checked(requests, context), context)
            finally:
                if counted:
                    self._slots.release()

        if handler.response_streaming:
            def stream_stream(requests, context):
                self._enter(method, counted, None, context)
                try:
                    yield from inner(checked(requests, context), context)
                finally:
                    if counted:
                        self._slots.release()

            return grpc.stream_stream_rpc_method_handler(stream_stream, request_deserializer=parse,
                                                         response_serializer=out)
        return grpc.stream_unary_rpc_method_handler(call, request_deserializer=parse, response_serializer=out)
