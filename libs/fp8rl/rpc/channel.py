"""Client side of the fp8rl wire: channels with the project's limits, auth and TLS, and deadlines.

Every fp8rl client (SDK, controller, refit subscriber) builds its channels with
:func:`make_channel`, so message-size limits, keepalives and credentials agree with what
:func:`fp8rl.rpc.server.build_server` expects. The per-call default deadlines live here too
(:data:`DEFAULT_DEADLINE_S`), one place for every RPC of ``fp8rl.v1``.

Environment fallbacks (used when the matching argument is None; an empty string disables):

==================== ===========================================================
``FP8RL_AUTH_TOKEN`` bearer token sent as ``authorization: Bearer <token>``
``FP8RL_TOKEN_FILE`` file holding that token, read when ``FP8RL_AUTH_TOKEN`` is unset
``FP8RL_TLS_CA``     PEM file of the CA that signed the servers' certificates
==================== ===========================================================

Which token: an SDK / CLI user sends the *client* token (JobService); a service process sends the
*service* token on its calls to the other services — the service skeleton makes it this process's token
(:func:`set_process_token`, held in memory: the processes a service starts never inherit it) and removes
every token variable from its environment (see :mod:`fp8rl.rpc.scopes` for the two scopes). ``deploy.launcher up``
writes both into ``RUN/secrets/`` (mode 0600).

The token is attached by a client interceptor (not call credentials), so it also works on
plaintext channels inside a cluster; over an untrusted network pair it with TLS.
"""

from __future__ import annotations

import collections
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import grpc

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_DEADLINE_S",
    "Deadlines",
    "ENV_AUTH_TOKEN",
    "ENV_TLS_CA",
    "ENV_TOKEN_FILE",
    "KEEPALIVE_TIME_MS",
    "make_channel",
    "wait_ready",
    "resolve_setting",
    "resolve_token",
    "set_process_token",
    "read_pem",
    "read_token_file",
]

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # weight-shard chunks and big rollout batches; gRPC's default is 4 MiB
ENV_AUTH_TOKEN = "FP8RL_AUTH_TOKEN"
ENV_TOKEN_FILE = "FP8RL_TOKEN_FILE"
ENV_TLS_CA = "FP8RL_TLS_CA"
MAX_TOKEN_BYTES = 4096  # a bearer token is a short secret; a bigger "token file" is the wrong file

# Keepalive pings detect dead peers on long-lived streams (WatchJob, StreamShards) behind
# load balancers. The server must accept pings at least this often, or it answers with
# GOAWAY "too_many_pings"; build_server allows half this interval.
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000


@dataclass(frozen=True)
class Deadlines:
    """Default deadline, in seconds, of each fp8rl RPC (pass as ``timeout=``).

    Generous on purpose: they catch a hung peer, not a slow step. None means no deadline
    (long-lived streams that end on their own).

    Attributes:
        status: any service's Status call.
        health: a gRPC health Check.
        generate: RolloutService.Generate, a whole batch of rollouts.
        score: RewardService.Score of one step's responses.
        train_step: TrainerService.TrainStep (logprobs + backward + optimizer + publish).
        compute_logprobs: TrainerService.ComputeLogprobs of one batch.
        save_checkpoint: TrainerService.SaveCheckpoint.
        calibrate: CalibratorService.Calibrate (pull weights + calibration passes).
        get_manifest: WeightStore.GetManifest.
        stream_shard: WeightStore.StreamShards of one shard.
        submit_job: JobService.SubmitJob (validation only).
        get_job: JobService.GetJob.
        list_jobs: JobService.ListJobs.
        cancel_job: JobService.CancelJob.
        watch_job: JobService.WatchJob; None, the stream lasts as long as the job.
    """

    status: float = 5.0
    health: float = 2.0
    generate: float = 900.0
    score: float = 120.0
    train_step: float = 1800.0
    compute_logprobs: float = 900.0
    save_checkpoint: float = 1800.0
    calibrate: float = 600.0
    get_manifest: float = 10.0
    stream_shard: float = 600.0
    submit_job: float = 30.0
    get_job: float = 10.0
    list_jobs: float = 10.0
    cancel_job: float = 30.0
    watch_job: float | None = None


DEFAULT_DEADLINE_S = Deadlines()

# Target of each channel made here, so wait_ready can name it (channels do not expose it).
_TARGETS: weakref.WeakKeyDictionary[grpc.Channel, str] = weakref.WeakKeyDictionary()


def resolve_setting(value: str | None, env_var: str) -> str | None:
    """An explicit argument wins; None falls back to ``env_var``; "" (either way) means unset."""
    if value is None:
        value = os.environ.get(env_var)
    return value or None


def read_pem(path: str, what: str, env_var: str) -> bytes:
    """Reads a PEM file, failing with a message that names what it is for and where it came from.

    Raises:
        FileNotFoundError: ``path`` does not exist or is not a file.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} file {str(p)!r} does not exist (from the argument or ${env_var})")
    return p.read_bytes()


def read_token_file(path: str | os.PathLike, what: str = "token file") -> str:
    """The token stored in ``path`` (surrounding whitespace, e.g. a trailing newline, removed).

    Raises:
        FileNotFoundError: ``path`` does not exist or is not a regular file.
        ValueError: the file is empty, larger than :data:`MAX_TOKEN_BYTES`, not UTF-8 text, or
            holds whitespace inside the token (a header value cannot carry it).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} {str(p)!r} does not exist or is not a regular file")
    raw = p.read_bytes()[: MAX_TOKEN_BYTES + 1]
    if len(raw) > MAX_TOKEN_BYTES:
        raise ValueError(f"{what} {str(p)!r} is larger than {MAX_TOKEN_BYTES} bytes: not a bearer token")
    try:
        token = raw.decode().strip()
    except UnicodeDecodeError:
        raise ValueError(f"{what} {str(p)!r} is not UTF-8 text") from None
    if not token:
        raise ValueError(f"{what} {str(p)!r} is empty")
    if any(c.isspace() for c in token):
        raise ValueError(f"{what} {str(p)!r} holds whitespace inside the token; write the token alone")
    return token


_UNSET = object()
_process_token: object = _UNSET


def set_process_token(token: str | None) -> None:
    """Make ``token`` (None: none) what this process's channels send unless told otherwise.

    A service calls this with its service token instead of exporting it: a token kept in memory is not
    inherited by the processes it starts (grading workers, engine processes) the way an environment
    variable is.
    """
    global _process_token
    _process_token = token or None


def resolve_token(token: str | None = None, token_file: str | os.PathLike | None = None) -> str | None:
    """The bearer token a client sends, or None for none.

    Order: ``token`` (``""`` means none, whatever else is set); ``token_file``; the process token
    (:func:`set_process_token`) when one was set; ``$FP8RL_AUTH_TOKEN`` when it is set at all (set but
    empty means none); ``$FP8RL_TOKEN_FILE``.

    Raises:
        FileNotFoundError, ValueError: the token file chosen cannot be used (see :func:`read_token_file`).
    """
    if token is not None:
        return token or None
    if token_file:
        return read_token_file(token_file)
    if _process_token is not _UNSET:
        return _process_token
    if ENV_AUTH_TOKEN in os.environ:
        return os.environ[ENV_AUTH_TOKEN] or None
    env_file = os.environ.get(ENV_TOKEN_FILE)
    return read_token_file(env_file, f"token file (${ENV_TOKEN_FILE})") if env_file else None


_CALL_DETAILS_FIELDS = ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")


class _CallDetails(collections.namedtuple("_CallDetails", _CALL_DETAILS_FIELDS), grpc.ClientCallDetails):
    """Mutable-by-copy ClientCallDetails (grpc's own class cannot be constructed)."""


class _BearerTokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` to the metadata of every call."""

    def __init__(self, token: str):
        self._header = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [*(details.metadata or ()), self._header]
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._with_token(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._with_token(client_call_details), request_iterator)


def make_channel(
    target: str,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    token: str | None = None,
    tls_ca: str | None = None,
    token_file: str | os.PathLike | None = None,
    own_connection: bool = False,
) -> grpc.Channel:
    """Opens a channel to an fp8rl service.

    The channel connects lazily; call :func:`wait_ready` to block until the server is up.

    Args:
        target: ``host:port`` (any gRPC target string, e.g. ``dns:///trainer:50051``).
        max_message_bytes: cap on a single sent or received message; must match the server's.
        token: bearer token to send; "" sends none; None reads ``token_file``, else
            ``$FP8RL_AUTH_TOKEN``, else ``$FP8RL_TOKEN_FILE`` (:func:`resolve_token`).
        tls_ca: PEM CA file; when set the channel uses TLS and verifies the server against it.
            None reads ``$FP8RL_TLS_CA``; "" (or both unset) means plaintext.
        token_file: file holding the token (used when ``token`` is None).
        own_connection: open a connection of its own. By default gRPC shares one connection among a process's
            channels to the same target, and servers see them as one client (e.g. the controller's WatchJob
            limit per client).

    Returns:
        A ``grpc.Channel`` usable with any generated stub in :mod:`fp8rl.rpc`.

    Raises:
        ValueError: ``max_message_bytes`` is not positive, or the token file is unusable.
        FileNotFoundError: the CA file or the token file does not exist.
    """
    if max_message_bytes <= 0:
        raise ValueError(f"max_message_bytes must be > 0, got {max_message_bytes}")
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 0),  # ping only while a call is open
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging an idle long-lived stream
        *([("grpc.use_local_subchannel_pool", 1)] if own_connection else []),
    ]
    ca_path = resolve_setting(tls_ca, ENV_TLS_CA)
    if ca_path is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=read_pem(ca_path, "TLS CA", ENV_TLS_CA))
        channel = grpc.secure_channel(target, creds, options=options)
    else:
        channel = grpc.insecure_channel(target, options=options)
    bearer = resolve_token(token, token_file)
    if bearer is not None:
        channel = grpc.intercept_channel(channel, _BearerTokenInterceptor(bearer))
    _TARGETS[channel] = target
    return channel


def wait_ready(channel: grpc.Channel, timeout: float) -> None:
    """Blocks until ``channel`` is connected.

    Args:
        channel: a channel (best from :func:`make_channel`, whose target the error names).
        timeout: seconds to wait.

    Raises:
        TimeoutError: not connected within ``timeout``; the message names the target.
    """
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
    except grpc.FutureTimeoutError:
        target = _TARGETS.get(channel, "<target unknown: channel not made by fp8rl.rpc.make_channel>")
        raise TimeoutError(
            f"gRPC server at {target} was not reachable within {timeout:g}s "
            "(is the service running and listening on that address? TLS on one side only?)"
        ) from None
