"""Server side of the fp8rl wire: one way to build every service's gRPC server.

:func:`build_server` gives each service the same skeleton: raised message-size limits, the
standard ``grpc.health.v1`` health service, server reflection, optional bearer-token auth and
optional TLS. Health starts NOT_SERVING for the whole server and for every registered service;
the service flips it with :func:`set_serving` once its backend is loaded, and back before it
stops (so k8s stops routing to it first).

Auth: when a token is configured, every call must carry ``authorization: Bearer <token>``
metadata or it fails with UNAUTHENTICATED — except the health service. Health stays open on
purpose: kubelet's native gRPC probes cannot send metadata, and health reveals nothing but
SERVING / NOT_SERVING. Reflection is *not* exempt (it reveals the API surface).

Environment fallbacks (used when the matching argument is None; an empty string disables):

==================== ===============================================
``FP8RL_AUTH_TOKEN`` bearer token required from callers
``FP8RL_TLS_CERT``   PEM certificate chain of this server
``FP8RL_TLS_KEY``    PEM private key of that certificate
==================== ===============================================
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .channel import DEFAULT_MAX_MESSAGE_BYTES, ENV_AUTH_TOKEN, KEEPALIVE_TIME_MS, read_pem, resolve_setting

__all__ = ["ENV_TLS_CERT", "ENV_TLS_KEY", "HealthServicer", "build_server", "set_serving"]

ENV_TLS_CERT = "FP8RL_TLS_CERT"
ENV_TLS_KEY = "FP8RL_TLS_KEY"

# Services reachable without the bearer token (see the module docstring for why).
_AUTH_EXEMPT_SERVICES = frozenset({health.SERVICE_NAME})

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


def _deny_handler(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as ``handler`` that fails with UNAUTHENTICATED.

    Requests are left undeserialized: nothing from an unauthenticated caller is parsed.
    """

    def deny(_request_or_iterator, context: grpc.ServicerContext):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is None or not (handler.request_streaming or handler.response_streaming):
        return grpc.unary_unary_rpc_method_handler(deny)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    return grpc.unary_stream_rpc_method_handler(deny)


class _BearerTokenInterceptor(grpc.ServerInterceptor):
    """Rejects calls whose ``authorization`` metadata is not ``Bearer <token>`` (health exempt)."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):
        service = handler_call_details.method.lstrip("/").split("/", 1)[0]
        if service in _AUTH_EXEMPT_SERVICES:
            return continuation(handler_call_details)
        given = next((v for k, v in handler_call_details.invocation_metadata or () if k == "authorization"), None)
        if given is None:
            message = (
                f"missing bearer token for {handler_call_details.method}: this server requires metadata "
                f"'authorization: Bearer <token>' (clients made by fp8rl.rpc.make_channel send ${ENV_AUTH_TOKEN})"
            )
        elif hmac.compare_digest(given.encode() if isinstance(given, str) else given, self._expected):
            return continuation(handler_call_details)
        else:
            message = f"invalid bearer token for {handler_call_details.method}: the token does not match this server's"
        return _deny_handler(continuation(handler_call_details), message)


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
        token: bearer token callers must present; None reads ``$FP8RL_AUTH_TOKEN``; "" means
            no auth.
        tls_cert: PEM certificate chain; with ``tls_key`` the port serves TLS only. None reads
            ``$FP8RL_TLS_CERT``; "" means plaintext.
        tls_key: PEM private key; None reads ``$FP8RL_TLS_KEY``.
        max_workers: handler threads, i.e. RPCs (streams included) served concurrently.
        host: address to bind; the default listens on every interface (IPv4 and IPv6).

    Returns:
        ``(server, health, bound_port)``: the unstarted server, its health servicer (every
        status NOT_SERVING until :func:`set_serving`), and the port actually bound.

    Raises:
        ValueError: bad limits, or only one of certificate / key given.
        FileNotFoundError: a TLS file does not exist.
        RuntimeError: the address could not be bound (e.g. port in use).
    """
    if max_message_bytes <= 0:
        raise ValueError(f"max_message_bytes must be > 0, got {max_message_bytes}")
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    credentials = _server_credentials(tls_cert, tls_key)  # fail on bad TLS config before anything else
    bearer = resolve_setting(token, ENV_AUTH_TOKEN)
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),  # a port already in use is an error, not a silently shared socket
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),  # accept clients' keepalives
        ("grpc.http2.max_ping_strikes", 0),
    ]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="fp8rl-grpc"),
        interceptors=[_BearerTokenInterceptor(bearer)] if bearer is not None else [],
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
