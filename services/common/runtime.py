"""The one skeleton every fp8rl service runs on: flags, job config, logging, server, health, graceful stop.

Usage (every role the same way)::

    python -m services.<role> --config JOB.yaml [--port N] [--host ADDR] [--redis-url URL | --redis-url-file F]
                              [--replica-id ID] [--job-id ID] [--advertise-host HOST] [--ready-file PATH] [role flags]

A Redis password travels in the URL (``redis://:PASSWORD@host:port/db``); ``--redis-url-file`` (what
``deploy.launcher`` passes: ``RUN/secrets/redis.url``, mode 0600) keeps it off the command line, and it wins over
``--redis-url``. The URL is only ever logged redacted (:func:`fp8rl.refit.redact_url`); a wrong or missing password
stops the service at start with one line naming the setting it came from (exit 2).

Lifecycle:

1. flags are parsed (each falls back to an environment variable, see :data:`ENV`), logging is set up and
   ``torch.set_num_threads($FP8RL_TORCH_THREADS, default 1)`` — several services often share one box; the
   token scopes are resolved and an open non-loopback listener refused (:mod:`services.common.security`);
2. the job YAML is validated and a :class:`~fp8rl.refit.RefitStore` for the job is opened;
3. the role's :class:`Service` is built (model loading: the slow part) — for a torch-heavy role on its
   compute thread (:mod:`.compute`: one thread runs all of a process's torch work), then its gRPC server (health
   NOT_SERVING) is started and :meth:`Service.start` runs — the role flips health to SERVING through
   :meth:`Context.set_serving` once it can serve;
4. the ``--ready-file`` (JSON: ``service``, ``pid``, ``port``, ``endpoint``, ``replica_id``) is written
   atomically: the port is bound and started. Whether it *serves* is what gRPC health says;
5. SIGTERM / SIGINT, or :meth:`Context.fail` from a background thread: health goes NOT_SERVING first
   (so probes and load balancers stop routing), then :meth:`Service.stop`, then the server drains for
   ``--grace`` seconds. Exit status 0, or 1 after a failure, 2 for a bad config / startup error.

Servicer methods wear :func:`rpc_method`: they raise :class:`Abort` (a status code and a message for
people) and anything unexpected becomes INTERNAL with the traceback in the log.

The nouns live beside this module — :mod:`.rpc` (Abort, require, rpc_method), :mod:`.service` (Context,
Service, ServiceSpec), :mod:`.security` (token scopes) — and are re-exported here, the
one import a service needs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from fp8rl import limits, memory
from fp8rl.config import ConfigError, load_job_config
from fp8rl.metrics import serve_metrics
from fp8rl.refit import RefitAuthenticationError, RefitConnectionError, RefitError, RefitStore, RoleLease, connect
from fp8rl.rpc.channel import DEFAULT_MAX_MESSAGE_BYTES, read_token_file
from fp8rl.rpc.server import SCOPE_SERVICE, build_server

from . import security
from .compute import ComputeThread
from .rpc import Abort, check_token_ids, require, rpc_method
from .service import Context, Service, ServiceSpec, StartupError

log = logging.getLogger("fp8rl.service")

__all__ = ["ENV", "Abort", "StartupError", "Service", "ServiceSpec", "Context", "optional_port", "rpc_method",
           "require", "check_token_ids", "serve", "main"]

# flag -> environment fallback (the flag wins; the env var is read when the flag is absent)
ENV = {
    "config": "FP8RL_CONFIG", "port": "FP8RL_PORT", "host": "FP8RL_HOST", "advertise_host": "FP8RL_ADVERTISE_HOST",
    "redis_url": "FP8RL_REDIS_URL", "redis_url_file": "FP8RL_REDIS_URL_FILE", "job_id": "FP8RL_JOB_ID",
    "replica_id": "FP8RL_REPLICA_ID",
    "ready_file": "FP8RL_READY_FILE", "log_level": "FP8RL_LOG_LEVEL", "max_message_bytes": "FP8RL_MAX_MESSAGE_BYTES",
    "lease_ttl": "FP8RL_LEASE_TTL_S", "grace": "FP8RL_SHUTDOWN_GRACE_S", "workers": "FP8RL_GRPC_WORKERS",
    "token": "FP8RL_AUTH_TOKEN", "metrics_port": "FP8RL_METRICS_PORT", "metrics_host": "FP8RL_METRICS_HOST",
    **security.SECURITY_ENV,  # token: the client token's old variable
}
ENV_TORCH_THREADS = "FP8RL_TORCH_THREADS"
_WILDCARD_HOSTS = {"", "[::]", "::", "0.0.0.0"}


def env_default(flag: str, default: Any = None) -> Any:
    """The environment fallback of ``flag`` (:data:`ENV`, else ``FP8RL_<FLAG>``), or ``default`` when unset."""
    return os.environ.get(ENV.get(flag, f"FP8RL_{flag.upper()}"), default)


def _default_replica_id(role: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-]", "-", f"{role}-{socket.gethostname()}")[:64]


def optional_port(flag: str) -> Callable[[str | int | None], int | None]:
    """The argparse type of a port flag that may be off (``--metrics-port``, the rollout's ``--openai-port``):
    None / "" = off, else a port in [0, 65535] (0 = a free one); a bad value names the flag and its variable."""
    name = f"--{flag.replace('_', '-')}"

    def parse(value: str | int | None) -> int | None:
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        try:
            port = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} (or ${ENV.get(flag, f'FP8RL_{flag.upper()}')}) must be a port "
                                             f"number, got {value!r}") from None
        if not 0 <= port <= 65535:
            raise argparse.ArgumentTypeError(f"{name} must be in [0, 65535], got {port}")
        return port

    return parse


_metrics_port = optional_port("metrics_port")


def _memory_limit_gb(value: str | float | None) -> float | None:
    """``--memory-limit-gb``: None / "" = no limit of its own, else a positive number of GB."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        gb = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--memory-limit-gb must be a number of GB, got {value!r}") from None
    if not (gb > 0 and gb < float("inf")):
        raise argparse.ArgumentTypeError(f"--memory-limit-gb must be > 0 and finite, got {value!r}")
    return gb


def parse_args(spec: ServiceSpec, argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m services.{spec.name}", description=f"fp8rl {spec.name} service")
    a = p.add_argument
    a("--config", default=env_default("config"), help="job YAML (the same file for every service of the job)")
    a("--port", type=int, default=env_default("port", spec.default_port), help="0 picks a free port")
    a("--host", default=env_default("host", "[::]"), help="address to bind")
    a("--advertise-host", default=env_default("advertise_host"),
      help="host others reach this server at (default: --host, or this hostname when binding a wildcard)")
    a("--redis-url", default=env_default("redis_url", "redis://127.0.0.1:6379/0"),
      help="redis://[:PASSWORD@]HOST:PORT/DB; a password here is visible to every local user: prefer --redis-url-file")
    a("--redis-url-file", default=env_default("redis_url_file"),
      help="file holding the Redis URL with its password (mode 0600); wins over --redis-url")
    a("--job-id", default=env_default("job_id"), help="Redis namespace of the job (default: job.name)")
    a("--replica-id", default=env_default("replica_id", _default_replica_id(spec.name)))
    a("--ready-file", default=env_default("ready_file"), help="JSON written once the port is bound and started")
    a("--log-level", default=env_default("log_level", "INFO"))
    a("--max-message-bytes", type=int, default=env_default("max_message_bytes", DEFAULT_MAX_MESSAGE_BYTES))
    a("--lease-ttl", type=float, default=env_default("lease_ttl", 10.0), help="replica lease TTL, seconds")
    a("--grace", type=float, default=env_default("grace", 5.0), help="seconds in-flight RPCs get on shutdown")
    a("--workers", type=int, default=env_default("workers", 8),
      help="worker threads: calls running at once (2 of them serve only Status / GetJob / ListJobs)")
    a("--first-message-timeout", type=float, default=env_default("first_message_timeout_s",
                                                                  limits.FIRST_MESSAGE_TIMEOUT_S),
      help="seconds a call may take to send its request message after it starts (then DEADLINE_EXCEEDED)")
    a("--metrics-port", type=_metrics_port, default=_metrics_port(env_default("metrics_port", "")),
      help="serve Prometheus metrics on http://HOST:PORT/metrics (0 picks a free port; default: off)")
    a("--metrics-host", default=env_default("metrics_host"), help="address the metrics bind (default: --host)")
    a("--memory-limit-gb", type=_memory_limit_gb, default=_memory_limit_gb(env_default("memory_limit_gb", "")),
      help="resident memory this process may take, GB (10**9 bytes): the trainer refuses a micro-batch that would "
           "pass it (RESOURCE_EXHAUSTED naming policy.training.micro_batch_size); default: what the kernel and the "
           "cgroup leave")
    add_security_args(p)
    if spec.add_args is not None:
        spec.add_args(p)
    args = p.parse_args(argv)
    if not args.config:
        p.error(f"--config (or ${ENV['config']}) is required")
    try:
        _read_redis_url_file(args)
    except (FileNotFoundError, ValueError) as exc:
        p.error(str(exc))
    return args


def _redis_url_source(args: argparse.Namespace) -> str:
    """The setting ``args.redis_url`` came from, for error messages."""
    if args.redis_url_file:
        return f"--redis-url-file {args.redis_url_file} (or ${ENV['redis_url_file']})"
    return f"--redis-url (or ${ENV['redis_url']})"


def _read_redis_url_file(args: argparse.Namespace) -> None:
    """``--redis-url-file`` given: its content (one URL, surrounding whitespace removed) becomes ``args.redis_url``."""
    if args.redis_url_file:
        args.redis_url = read_token_file(args.redis_url_file, "--redis-url-file")


def add_security_args(p: argparse.ArgumentParser) -> None:
    """The token scopes, ``--insecure`` and TLS flags (:mod:`services.common.security`)."""
    security.add_security_args(p)


def apply_security_args(args: argparse.Namespace, scopes: Iterable[str] = (SCOPE_SERVICE,)) -> None:
    """Resolve ``args.tokens``, refuse an open non-loopback listener, export the outgoing credentials.

    See :func:`services.common.security.apply_security_args`; its errors become :class:`StartupError`.
    """
    try:
        security.apply_security_args(args, scopes)
    except (ValueError, FileNotFoundError) as exc:
        raise StartupError(str(exc)) from None


def _write_ready_file(path: str, payload: dict) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, target)  # readers never see a half-written file


def _redis(spec: ServiceSpec, args: argparse.Namespace):
    """The job's Redis client. A refused password stops the start (:class:`StartupError` naming the setting);
    an unreachable Redis too for a role that ``needs_redis``, else the role serves and connects later."""
    url = args.redis_url
    try:
        return connect(url)
    except RefitAuthenticationError as exc:
        raise StartupError(f"{exc} given by {_redis_url_source(args)}") from None
    except RefitConnectionError as exc:
        if spec.needs_redis:
            raise
        log.warning("%s; %s serves without its lease until Redis answers (callers reach it by address meanwhile)",
                    exc, spec.name)
        return connect(url, check=False)


def serve(spec: ServiceSpec, argv: Sequence[str] | None = None) -> int:
    """Run ``spec``'s service until SIGTERM/SIGINT; returns the process exit status."""
    args = parse_args(spec, argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s {spec.name}[{args.replica_id}] %(name)s: %(message)s")
    memory.tune_allocator()  # freed heap memory goes back to the kernel: a service's RSS follows what it holds
    if args.memory_limit_gb is not None:
        memory.set_limit(int(args.memory_limit_gb * memory.GB))
    import torch  # every role computes with torch; one thread each unless told otherwise

    torch.set_num_threads(int(os.environ.get(ENV_TORCH_THREADS, "1")))
    compute: ComputeThread | None = None
    try:
        apply_security_args(args, spec.scopes)
        job = load_job_config(args.config)
        job.check_services()  # keys only the in-process loop runs
        store = RefitStore(_redis(spec, args), args.job_id or job.job.name)
        ctx = Context(spec.name, args, job, store)
        if spec.uses_compute_thread(job):  # one OpenMP team per process: services.common.compute says why
            compute = ComputeThread(f"{spec.name}-torch")
            ctx.compute = compute.call
        service = ctx.compute(spec.build, ctx)
    except (ConfigError, StartupError, RefitError, FileNotFoundError, ValueError) as exc:
        log.error("cannot start %s: %s", spec.name, exc)
        print(f"fp8rl {spec.name}: error: {exc}", file=sys.stderr)
        return 2
    except Exception:  # noqa: BLE001 - a bug, not a config problem: traceback, exit 1
        log.exception("cannot start %s", spec.name)
        return 1

    try:
        server, health, port = build_server(service.servicers(), port=args.port, host=args.host,
                                            max_message_bytes=args.max_message_bytes, max_workers=args.workers,
                                            scoped_tokens=args.tokens, tls_cert=args.tls_cert, tls_key=args.tls_key,
                                            observer=ctx.metrics.observe_rpc,
                                            first_message_s=args.first_message_timeout)
        exporter = None if args.metrics_port is None else \
            serve_metrics(ctx.metrics, args.metrics_port, args.metrics_host or args.host)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:  # bad TLS files, port in use
        log.error("cannot start %s: %s", spec.name, exc)
        print(f"fp8rl {spec.name}: error: {exc}", file=sys.stderr)
        service.stop()
        if compute is not None:
            compute.close()
        return 2
    ctx._health, ctx.port = health, port
    advertise = args.advertise_host or (socket.gethostname() if args.host in _WILDCARD_HOSTS else args.host)
    ctx.endpoint = f"{advertise}:{port}"

    def on_signal(signum, _frame):
        log.info("received %s: stopping", signal.Signals(signum).name)
        ctx.stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    lease: RoleLease | None = None
    server.start()
    try:
        service.start(ctx)
    except Exception as exc:  # noqa: BLE001 - never leave a half-started server running
        expected = isinstance(exc, StartupError | RefitError | ValueError)
        log.error("cannot start %s: %s", spec.name, exc, exc_info=None if expected else exc)
        print(f"fp8rl {spec.name}: error: {exc}", file=sys.stderr)
        ctx.failure = exc if expected else RuntimeError(str(exc))
        ctx.stopping.set()
    else:
        if not spec.follows_refit:
            lease = RoleLease(ctx)  # no version: only the endpoint
            lease.start(tolerate_redis_down=True)
        log.info("%s listening on %s (job %s)%s", spec.name, ctx.endpoint, ctx.job_id,
                 f"; metrics on port {exporter.port}" if exporter is not None else "")
        if args.ready_file:
            _write_ready_file(args.ready_file, {"service": spec.name, "pid": os.getpid(), "port": port,
                                                "endpoint": ctx.endpoint, "replica_id": ctx.replica_id,
                                                "metrics_port": exporter.port if exporter is not None else None})
    while not ctx.stopping.wait(0.5):  # a timed wait lets the signal handler run promptly
        pass
    health.enter_graceful_shutdown()  # NOT_SERVING first: probes stop routing before anything closes
    if lease is not None:
        lease.release()
    service.stop()
    server.stop(args.grace).wait()
    if exporter is not None:
        exporter.close()
    if compute is not None:
        compute.close()
    if args.ready_file and Path(args.ready_file).exists():
        Path(args.ready_file).unlink()
    log.info("%s stopped", spec.name)
    if ctx.failure is None:
        return 0
    return 2 if isinstance(ctx.failure, StartupError | RefitError | ValueError) else 1


def main(spec: ServiceSpec, argv: Iterable[str] | None = None) -> None:
    """``python -m services.<role>`` entry point."""
    sys.exit(serve(spec, None if argv is None else list(argv)))
