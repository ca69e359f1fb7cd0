"""Server side of the fp8rl wire: one way to build every service's gRPC server.

:func:`build_server` gives each service the same skeleton: the call gate (:mod:`fp8rl.rpc.guard`:
tokens checked from metadata before a request is read, per-method request limits, a deadline for the
request message, worker slots), the standard ``grpc.health.v1`` health service, server reflection,
optional TLS, and connection- and stream-level limits. Health starts NOT_SERVING for the whole server
and for every registered service; the service flips it with :func:`set_serving` once its backend is
loaded, and back before it stops (so k8s stops routing to it first).

The server is ``grpc.aio`` on the process's I/O loop (:mod:`fp8rl.rpc.io_loop`) behind a blocking
facade (:class:`Server`: ``start``, ``stop``, ``wait_for_termination``), and the servicers stay plain
blocking code run on worker threads (:mod:`fp8rl.rpc.sync_call`). Why: gRPC's thread-per-call server
gives a call its worker before the request message has arrived, so calls that never send one — with
or without a token — could hold every worker and starve health; here waiting for bytes costs no
thread, and health is answered on the loop itself.

Auth has two scopes, each with its own bearer token (:mod:`fp8rl.rpc.scopes`: :class:`ScopedTokens`,
:func:`rpc_scope`). ``build_server(token=T)`` is the one-token form (``T`` for both scopes,
``$FP8RL_AUTH_TOKEN`` when None) for single-purpose servers and tests; services pass ``scoped_tokens``.

Environment fallbacks (used when the matching argument is None; an empty string disables):

==================== ===============================================
``FP8RL_AUTH_TOKEN`` the one-token form's token
``FP8RL_TLS_CERT``   PEM certificate chain of this server
``FP8RL_TLS_KEY``    PEM private key of that certificate
==================== ===============================================
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from fp8rl import limits
from fp8rl.limits import RESERVED_WORKERS

from .channel import DEFAULT_MAX_MESSAGE_BYTES, ENV_AUTH_TOKEN, KEEPALIVE_TIME_MS, read_pem, resolve_setting
from .guard import CallGate, GateLimits, Observer, request_limit
from .io_loop import io_loop, run_on_loop
from .scopes import (
    CLIENT_SCOPE_SERVICES,
    SCOPE_CLIENT,
    SCOPE_SERVICE,
    ScopedTokens,
    TokenCheck,
    rpc_scope,
)

__all__ = ["CLIENT_SCOPE_SERVICES", "ENV_TLS_CERT", "ENV_TLS_KEY", "SCOPE_CLIENT", "SCOPE_SERVICE", "HealthServicer",
           "ScopedTokens", "Server", "build_server", "rpc_scope", "set_serving"]

ENV_TLS_CERT = "FP8RL_TLS_CERT"
ENV_TLS_KEY = "FP8RL_TLS_KEY"

ServicerAdder = tuple[Callable[[Any, Any], None], Any]


class HealthServicer:
    """The standard (asyncio) health servicer behind a blocking face, plus the names of the services it reports on.

    Attributes:
        service_names: fully qualified names of the application services on this server
            (e.g. ``"fp8rl.v1.RewardService"``); :func:`set_serving` sets each of them and
            the overall status ``""``.
    """

    def __init__(self, service_names: Iterable[str], servicer: health.aio.HealthServicer) -> None:
        self.service_names = tuple(service_names)
        self._servicer = servicer
        set_serving(self, False)

    def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        """Sets one service's status (ignored once graceful shutdown began)."""
        run_on_loop(self._servicer.set(service, status))

    def enter_graceful_shutdown(self) -> None:
        """Every status NOT_SERVING, for good."""
        run_on_loop(self._servicer.enter_graceful_shutdown())


def set_serving(health_servicer: HealthServicer, serving: bool) -> None:
    """Sets the overall status and every registered service's status to SERVING or NOT_SERVING.

    After ``health_servicer.enter_graceful_shutdown()`` the statuses stay NOT_SERVING.
    """
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", *health_servicer.service_names):
        health_servicer.set(name, status)


class Server:
    """A started-or-not gRPC server (the blocking face of a ``grpc.aio`` server on the I/O loop)."""

    def __init__(self, aio_server: aio.Server, gate: CallGate) -> None:
        self._server, self._gate = aio_server, gate
        self._stopped = threading.Event()

    def start(self) -> None:
        run_on_loop(self._server.start())

    def stop(self, grace: float | None) -> threading.Event:
        """Stops taking calls; running ones get ``grace`` seconds (None: none). Returns an event set once stopped."""

        async def stop() -> None:
            try:
                await self._server.stop(grace)
            finally:
                self._gate.close()
                self._stopped.set()

        asyncio.run_coroutine_threadsafe(stop(), io_loop())
        return self._stopped

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Blocks until the server stopped (True) or ``timeout`` passed (False)."""
        return self._stopped.wait(timeout)


class _Registry:
    """Stands in for the server while generated ``add_*_to_server`` functions run: collects their method handlers."""

    def __init__(self) -> None:
        self.methods: dict[str, dict[str, grpc.RpcMethodHandler]] = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        for h in handlers:
            methods = getattr(h, "_method_handlers", None)  # grpc.method_handlers_generic_handler's table
            if not isinstance(methods, dict):
                raise TypeError(f"{h!r}: only handlers made by grpc.method_handlers_generic_handler are served")
            for full, handler in methods.items():
                service, _, name = full.lstrip("/").rpartition("/")
                self.methods.setdefault(service, {})[name] = handler

    def add_registered_method_handlers(self, service_name: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.methods.setdefault(service_name, {}).update(handlers)


def _server_credentials(tls_cert: str | None, tls_key: str | None) -> grpc.ServerCredentials | None:
    cert = resolve_setting(tls_cert, ENV_TLS_CERT)
    key = resolve_setting(tls_key, ENV_TLS_KEY)
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        missing = "certificate (tls_cert / $FP8RL_TLS_CERT)" if cert is None else "key (tls_key / $FP8RL_TLS_KEY)"
        raise ValueError(f"TLS needs both a certificate and a key; the {missing} is not set")
    chain = read_pem(cert, "TLS certificate", ENV_TLS_CERT)
    private_key = read_pem(key, "TLS private key", ENV_TLS_KEY)
    return grpc.ssl_server_credentials([(private_key, chain)])


def build_server(
    servicers_adders: Iterable[ServicerAdder],
    *,
    port: int,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    token: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    max_workers: int = 8,
    host: str = "[::]",
    scoped_tokens: ScopedTokens | None = None,
    reserved_workers: int = RESERVED_WORKERS,
    observer: Observer | None = None,
    first_message_s: float = limits.FIRST_MESSAGE_TIMEOUT_S,
) -> tuple[Server, HealthServicer, int]:
    """Builds (but does not start) a gRPC server hosting the given servicers.

    Example::

        server, health, port = build_server(
            [(reward_pb2_grpc.add_RewardServiceServicer_to_server, RewardServicer(grader))], port=50051
        )
        server.start()
        set_serving(health, True)
        ...
        health.enter_graceful_shutdown()
        server.stop(grace=5).wait()

    Args:
        servicers_adders: ``(add_XServicer_to_server, servicer)`` pairs from the generated
            ``*_pb2_grpc`` modules; the servicers' methods are plain blocking functions.
        port: TCP port to listen on; 0 picks a free ephemeral port (returned).
        max_message_bytes: cap on a sent message and on the request of the batch-carrying RPCs
            (:data:`fp8rl.limits.BULK_REQUEST_METHODS`); every other method takes far less
            (:func:`fp8rl.rpc.guard.request_limit`). A larger request fails with RESOURCE_EXHAUSTED.
        token: the one-token form: callers of either scope present it; None reads
            ``$FP8RL_AUTH_TOKEN``; "" means no auth. Ignored when ``scoped_tokens`` is given.
        tls_cert: PEM certificate chain; with ``tls_key`` the port serves TLS only. None reads
            ``$FP8RL_TLS_CERT``; "" means plaintext.
        tls_key: PEM private key; None reads ``$FP8RL_TLS_KEY``.
        max_workers: worker threads, i.e. calls (streams included) running at once.
        reserved_workers: of those, how many serve only light calls (Status, GetJob, ListJobs): long calls get
            ``max(1, max_workers - reserved_workers)``, the next is UNAVAILABLE (:mod:`fp8rl.rpc.guard`, which
            also answers malformed requests with INVALID_ARGUMENT). Health needs no worker.
        host: address to bind; the default listens on every interface (IPv4 and IPv6).
        scoped_tokens: one token per scope (service, client); a scope without one is open.
        observer: ``observer(method, code, seconds)`` for every call, refused ones included (e.g. the RPC
            metrics of :mod:`fp8rl.metrics`).
        first_message_s: seconds a call may take to send its request message after it started.

    Returns:
        ``(server, health, bound_port)``: the unstarted server, its health servicer (every
        status NOT_SERVING until :func:`set_serving`), and the port actually bound.

    Raises:
        ValueError: bad limits, only one of certificate / key given, or the two scoped tokens are equal
            (which would let a client-token holder call internal RPCs).
        FileNotFoundError: a TLS file does not exist.
        RuntimeError: the address could not be bound (e.g. port in use).
    """
    if max_message_bytes <= 0:
        raise ValueError(f"max_message_bytes must be > 0, got {max_message_bytes}")
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    credentials = _server_credentials(tls_cert, tls_key)  # fail on bad TLS config before anything else
    if scoped_tokens is not None:
        tokens = scoped_tokens
        if tokens.service is not None and tokens.service == tokens.client:
            raise ValueError("the service token and the client token are equal: give each scope its own token, or "
                             "a client-token holder could call the internal RPCs")
    else:
        bearer = resolve_setting(token, ENV_AUTH_TOKEN)
        tokens = ScopedTokens(service=bearer, client=bearer)
    gate_limits = GateLimits(long_calls=max(1, max_workers - reserved_workers), light_calls=max(1, reserved_workers),
                             first_message_s=first_message_s, bulk_request_bytes=max_message_bytes)

    registry = _Registry()
    for pair in servicers_adders:
        try:
            add, servicer = pair
        except (TypeError, ValueError):
            msg = f"servicers_adders items must be (add_XServicer_to_server, servicer) pairs, got {pair!r}"
            raise TypeError(msg) from None
        if not callable(add):
            raise TypeError(f"{add!r} is not callable; expected a generated add_XServicer_to_server function")
        add(servicer, registry)
    service_names = list(registry.methods)
    # the asyncio reflection servicer, registered like the others so it goes through the gate (the token check)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        reflection.aio.ReflectionServicer((*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME)), registry)
    largest_request = max((request_limit(f"/{svc}/{name}", max_message_bytes)
                           for svc, handlers in registry.methods.items() for name in handlers),
                          default=limits.MAX_REQUEST_BYTES)
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        # gRPC refuses a bigger message from its length prefix, before buffering it; the gate checks each method's
        ("grpc.max_receive_message_length", largest_request),
        ("grpc.so_reuseport", 0),  # a port already in use is an error, not a silently shared socket
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),  # accept clients' keepalives
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.max_concurrent_streams", limits.MAX_STREAMS_PER_CONNECTION),
        ("grpc.max_allowed_incoming_connections", limits.MAX_CONNECTIONS),
        ("grpc.server_handshake_timeout_ms", int(limits.HANDSHAKE_TIMEOUT_S * 1000)),
        ("grpc.max_metadata_size", limits.MAX_METADATA_BYTES),
        # No BDP-driven stream windows: a stream whose message the server does not read (a health Check or any call
        # without a token) may then send only the initial 64 KiB window, not the megabytes a BDP estimate grants
        # every stream (measured: 16 unread 16 MiB health messages a second, +16 to +170 MiB of RSS with it, +1
        # MiB without). A message the server does read opens the window to its whole length anyway, so bulk
        # requests lose nothing (a 100 MB Score: 0.84 s with BDP, 0.76 s without, loopback).
        ("grpc.http2.bdp_probe", 0),
    ]

    async def make() -> tuple[aio.Server, CallGate, health.aio.HealthServicer, int]:
        gate = CallGate(TokenCheck(tokens), gate_limits, observer)
        server = aio.server(options=options)
        health_servicer = health.aio.HealthServicer()  # on the loop: it answers without a worker, always
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, registry)
        for service, handlers in registry.methods.items():  # every method through the gate, health included
            wrapped = {name: gate.wrap(f"/{service}/{name}", h) for name, h in handlers.items()}
            server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, wrapped)])
        address = f"{host}:{port}"
        try:
            bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        except RuntimeError as e:
            raise RuntimeError(f"could not listen on {address}: {e} (port in use, or host not local?)") from e
        if bound == 0:
            raise RuntimeError(f"could not listen on {address} (port in use, or host not local?)")
        return server, gate, health_servicer, bound

    aio_server, gate, health_servicer, bound = run_on_loop(make())
    return Server(aio_server, gate), HealthServicer(service_names, health_servicer), bound
