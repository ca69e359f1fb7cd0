"""Server side of the fp8rl wire: one way to build every service's gRPC server.

:func:`build_server` gives each service the same skeleton: raised message-size limits, the
standard ``grpc.health.v1`` health service, server reflection, optional bearer-token auth and
optional TLS. Health starts NOT_SERVING for the whole server and for every registered service;
the service flips it with :func:`set_serving` once its backend is loaded, and back before it
stops (so k8s stops routing to it first).

Auth has two scopes, each with its own bearer token (:class:`ScopedTokens`):

* **client** — the controller's ``JobService`` (submit, watch, get, list, cancel): what an SDK / CLI
  user holds;
* **service** — every other RPC (TrainStep, ComputeLogprobs, SaveCheckpoint, the WeightStore,
  Generate, Score, Calibrate, each service's Status): what the services send one another.

A call must carry ``authorization: Bearer <token>`` of its RPC's scope. No token, or one that is
neither scope's, fails with UNAUTHENTICATED; the *other* scope's token fails with PERMISSION_DENIED
naming the scope needed (so a client-token holder can neither train nor read weights). A scope with
no token configured is open. The health service is always open: kubelet's native gRPC probes cannot
send metadata, and health reveals nothing but SERVING / NOT_SERVING. Reflection is *not* exempt (it
reveals the API surface): either scope's token opens it.

``build_server(token=T)`` is the one-token form (``T`` for both scopes, ``$FP8RL_AUTH_TOKEN`` when
None) for single-purpose servers and tests; services pass ``scoped_tokens``.

Environment fallbacks (used when the matching argument is None; an empty string disables):

==================== ===============================================
``FP8RL_AUTH_TOKEN`` the one-token form's token
``FP8RL_TLS_CERT``   PEM certificate chain of this server
``FP8RL_TLS_KEY``    PEM private key of that certificate
==================== ===============================================
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fp8rl.limits import RESERVED_WORKERS

from .channel import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ENV_AUTH_TOKEN,
    ENV_TOKEN_FILE,
    KEEPALIVE_TIME_MS,
    read_pem,
    resolve_setting,
)
from .guard import RequestGuard

__all__ = ["CLIENT_SCOPE_SERVICES", "ENV_TLS_CERT", "ENV_TLS_KEY", "SCOPE_CLIENT", "SCOPE_SERVICE", "HealthServicer",
           "ScopedTokens", "build_server", "rpc_scope", "set_serving"]

ENV_TLS_CERT = "FP8RL_TLS_CERT"
ENV_TLS_KEY = "FP8RL_TLS_KEY"

# Services reachable without the bearer token (see the module docstring for why).
_AUTH_EXEMPT_SERVICES = frozenset({health.SERVICE_NAME})

SCOPE_CLIENT, SCOPE_SERVICE = "client", "service"
# The services an SDK / CLI user may call (client scope); every other fp8rl service is internal (service scope).
CLIENT_SCOPE_SERVICES = frozenset({"fp8rl.v1.JobService"})
_SCOPE_CALLS = {SCOPE_CLIENT: "JobService: submit, watch, get, list and cancel jobs",
                SCOPE_SERVICE: "the services' internal RPCs"}


def rpc_scope(method: str) -> str | None:
    """The scope whose token ``method`` (``/package.Service/Method``) needs.

    Returns :data:`SCOPE_CLIENT` for :data:`CLIENT_SCOPE_SERVICES`, None for health (open) and
    reflection (either scope's token), :data:`SCOPE_SERVICE` for everything else.
    """
    service = method.lstrip("/").split("/", 1)[0]
    if service in _AUTH_EXEMPT_SERVICES or service == reflection.SERVICE_NAME:
        return None
    return SCOPE_CLIENT if service in CLIENT_SCOPE_SERVICES else SCOPE_SERVICE


@dataclass(frozen=True)
class ScopedTokens:
    """The bearer token of each scope; None (or "") leaves that scope open.

    Attributes:
        service: token of the internal RPCs (every service but the controller's JobService).
        client: token of the JobService (what the SDK / CLI sends).
    """

    service: str | None = None
    client: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "service", self.service or None)
        object.__setattr__(self, "client", self.client or None)

    def get(self, scope: str) -> str | None:
        """The token of ``scope`` (:data:`SCOPE_SERVICE` or :data:`SCOPE_CLIENT`)."""
        return self.service if scope == SCOPE_SERVICE else self.client

ServicerAdder = tuple[Callable[[Any, grpc.Server], None], Any]


class HealthServicer(health.HealthServicer):
    """The standard health servicer, plus the names of the services it reports on.

    Attributes:
        service_names: fully qualified names of the application services on this server
            (e.g. ``"fp8rl.v1.RewardService"``); :func:`set_serving` sets each of them and
            the overall status ``""``.
    """

    def __init__(self, service_names: Iterable[str]):
        super().__init__(experimental_non_blocking=True)  # Watch streams do not pin a worker thread
        self.service_names = tuple(service_names)
        set_serving(self, False)


def set_serving(health_servicer: HealthServicer, serving: bool) -> None:
    """Sets the overall status and every registered service's status to SERVING or NOT_SERVING.

    After ``health_servicer.enter_graceful_shutdown()`` the statuses stay NOT_SERVING.
    """
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", *health_servicer.service_names):
        health_servicer.set(name, status)


class _RecordingServer:
    """Wraps a grpc.Server while generated ``add_*_to_server`` functions run, noting service names."""

    def __init__(self, server: grpc.Server):
        self._server = server
        self.service_names: list[str] = []

    def _note(self, name: str) -> None:
        if name not in self.service_names:
            self.service_names.append(name)

    def add_generic_rpc_handlers(self, handlers) -> None:
        for h in handlers:
            if isinstance(h, grpc.ServiceRpcHandler):
                self._note(h.service_name())
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service_name: str, handlers) -> None:
        self._note(service_name)
        self._server.add_registered_method_handlers(service_name, handlers)

    def __getattr__(self, name: str):
        return getattr(self._server, name)


def _deny_handler(handler: grpc.RpcMethodHandler | None, message: str,
                  code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as ``handler`` that fails with ``code``.

    Requests are left undeserialized: nothing from a caller without the right token is parsed.
    """

    def deny(_request_or_iterator, context: grpc.ServicerContext):
        context.abort(code, message)

    if handler is None or not (handler.request_streaming or handler.response_streaming):
        return grpc.unary_unary_rpc_method_handler(deny)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    return grpc.unary_stream_rpc_method_handler(deny)


class _BearerTokenInterceptor(grpc.ServerInterceptor):
    """Checks each call's ``authorization: Bearer <token>`` against its RPC's scope (see the module docstring)."""

    def __init__(self, tokens: ScopedTokens):
        self._expected = {scope: f"Bearer {t}".encode() for scope in (SCOPE_SERVICE, SCOPE_CLIENT)
                          if (t := tokens.get(scope)) is not None}

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        required = rpc_scope(method)
        service = method.lstrip("/").split("/", 1)[0]
        if service in _AUTH_EXEMPT_SERVICES or not self._expected or (
                required is not None and required not in self._expected):
            return continuation(handler_call_details)  # health, or a scope left open
        given = next((v for k, v in handler_call_details.invocation_metadata or () if k == "authorization"), None)
        if isinstance(given, str):
            given = given.encode()
        # every scope is compared (constant time each), so timing tells nothing about which one matched
        held = [s for s, exp in self._expected.items() if given is not None and hmac.compare_digest(given, exp)]
        if held and (required is None or required in held):
            return continuation(handler_call_details)
        code = grpc.StatusCode.UNAUTHENTICATED
        needed = f"the {required} token" if required else "a token"
        if held:
            code = grpc.StatusCode.PERMISSION_DENIED
            message = (f"{method} needs {needed} ({_SCOPE_CALLS[required]}); the {held[0]} token only grants "
                       f"{_SCOPE_CALLS[held[0]]}")
        elif given is None:
            message = (f"missing bearer token for {method}: this server requires metadata 'authorization: Bearer "
                       f"<token>' with {needed} (clients made by fp8rl.rpc.make_channel send ${ENV_AUTH_TOKEN} or the "
                       f"file ${ENV_TOKEN_FILE})")
        else:
            message = f"invalid bearer token for {method}: it is not {needed} of this server"
        return _deny_handler(continuation(handler_call_details), message, code)


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
    interceptors: Sequence[grpc.ServerInterceptor] = (),
) -> tuple[grpc.Server, HealthServicer, int]:
    """Builds (but does not start) a gRPC server hosting the given servicers.

    Example::

        server, health, port = build_server(
            [(reward_pb2_grpc.add_RewardServiceServicer_to_server, RewardServicer(grader))], port=50051
        )
        server.start()
        set_serving(health, True)
        ...
        health.enter_graceful_shutdown()
        server.stop(grace=5)

    Args:
        servicers_adders: ``(add_XServicer_to_server, servicer)`` pairs from the generated
            ``*_pb2_grpc`` modules.
        port: TCP port to listen on; 0 picks a free ephemeral port (returned).
        max_message_bytes: cap on a single received or sent message; a larger request fails
            with RESOURCE_EXHAUSTED.
        token: the one-token form: callers of either scope present it; None reads
            ``$FP8RL_AUTH_TOKEN``; "" means no auth. Ignored when ``scoped_tokens`` is given.
        tls_cert: PEM certificate chain; with ``tls_key`` the port serves TLS only. None reads
            ``$FP8RL_TLS_CERT``; "" means plaintext.
        tls_key: PEM private key; None reads ``$FP8RL_TLS_KEY``.
        max_workers: handler threads, i.e. RPCs (streams included) served concurrently.
        reserved_workers: of those, how many long calls may never occupy: at most
            ``max(1, max_workers - reserved_workers)`` calls other than health / Status run at once, the
            next gets UNAVAILABLE (:mod:`fp8rl.rpc.guard`, which also answers malformed requests with
            INVALID_ARGUMENT).
        host: address to bind; the default listens on every interface (IPv4 and IPv6).
        scoped_tokens: one token per scope (service, client); a scope without one is open.
        interceptors: run first, outside the token check and the request guard (e.g. the RPC metrics of
            :mod:`fp8rl.metrics`, which then count refused calls with the code they got).

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
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),  # a port already in use is an error, not a silently shared socket
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),  # accept clients' keepalives
        ("grpc.http2.max_ping_strikes", 0),
    ]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="fp8rl-grpc"),
        interceptors=[*interceptors, *([_BearerTokenInterceptor(tokens)] if tokens.service or tokens.client else []),
                      RequestGuard(max(1, max_workers - reserved_workers))],
        options=options,
    )

    recorder = _RecordingServer(server)
    for pair in servicers_adders:
        try:
            add, servicer = pair
        except (TypeError, ValueError):
            msg = f"servicers_adders items must be (add_XServicer_to_server, servicer) pairs, got {pair!r}"
            raise TypeError(msg) from None
        if not callable(add):
            raise TypeError(f"{add!r} is not callable; expected a generated add_XServicer_to_server function")
        add(servicer, recorder)

    health_servicer = HealthServicer(recorder.service_names)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*recorder.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)

    address = f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as e:
        raise RuntimeError(f"could not listen on {address}: {e} (port in use, or host not local?)") from e
    if bound == 0:  # older grpcio reports a failed bind this way
        raise RuntimeError(f"could not listen on {address} (port in use, or host not local?)")
    return server, health_servicer, bound
