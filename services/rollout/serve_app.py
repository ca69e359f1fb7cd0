"""Rollout replicas as a Ray Serve application: scale-out on an existing engine instead of a home-made one.

Each Serve replica is one whole rollout replica — the same :class:`~services.rollout.server.RolloutService`
that ``python -m services.rollout`` runs: its engine, its :class:`~fp8rl.refit.RefitFollower`
(a refit subscriber holding **its own lease** in Redis, named after the Serve replica) and its gRPC server
on a free port, advertised at the node's IP. So nothing else changes: the controller finds the replicas
through their leases and calls ``Generate`` on them directly (pinned to a version), refits reach every
replica through the refit protocol, and a replica Serve replaces rejoins at ``weights:latest``. Serve adds
placement (``num_cpus`` / ``num_gpus`` per replica), restarts of failed replicas, and scaling by a number.

The Serve handle offers ``status()`` and ``generate()`` too (used by tests and Python callers on the cluster).

Run it (the arguments are ``python -m services.rollout`` flags, as one string)::

    serve run services.rollout.serve_app:build_app replicas=4 num_gpus=1 \\
        flags="--config job.yaml --redis-url redis://:PW@redis:6379/0 --job-id fp8rl"

Invariant (DESIGN §3) — unchanged by Serve: a replica serves only the version it holds, weights and
scales applied together; Serve never routes a pinned ``Generate`` elsewhere (the controller does that).
"""

from __future__ import annotations

import logging
import re
import shlex
import socket
from typing import Any

from fp8rl.config import load_job_config
from fp8rl.engines import SamplingParams
from fp8rl.refit import RefitStore, connect
from fp8rl.rpc.server import build_server
from services.common.runtime import Context, apply_security_args, parse_args
from services.rollout.server import SPEC, RolloutService

log = logging.getLogger(__name__)

__all__ = ["RolloutReplica", "deployment", "build_app"]


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray (unit use): the hostname will do
        return socket.gethostname()


def _serve_replica_name(prefix: str) -> str:
    """``prefix-<Serve replica id>``: unique per Serve replica, stable for its lifetime (the lease's name)."""
    try:
        from ray import serve

        rc = serve.get_replica_context()
        rid = getattr(rc, "replica_id", None)
        tag = getattr(rid, "unique_id", None) or getattr(rc, "replica_tag", None) or str(rid)
    except Exception:  # noqa: BLE001 - not inside a Serve replica
        import uuid

        tag = uuid.uuid4().hex[:8]
    return re.sub(r"[^A-Za-z0-9_.\-]", "-", f"{prefix}-{tag}")[:64]


class RolloutReplica:
    """One Serve replica: a rollout service (engine + refit follower + gRPC server), started in ``__init__``.

    Args:
        flags: ``python -m services.rollout`` flags (``--config``, ``--redis-url``, ``--job-id`` ...).
            ``--port`` defaults to 0 (several replicas share a node), ``--replica-id`` to
            ``<prefix>-<Serve replica id>``, ``--advertise-host`` to the node's IP.
        replica_prefix: prefix of the replica ids (and so of the lease names).
    """

    def __init__(self, flags: list[str] | str, replica_prefix: str = "rollout-serve") -> None:
        argv = shlex.split(flags) if isinstance(flags, str) else list(flags)
        given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
        if "--port" not in given:
            argv += ["--port", "0"]
        if "--replica-id" not in given:
            argv += ["--replica-id", _serve_replica_name(replica_prefix)]
        if "--advertise-host" not in given:
            argv += ["--advertise-host", _node_ip()]
        args = parse_args(SPEC, argv)
        logging.basicConfig(level=args.log_level.upper())
        apply_security_args(args)  # the service token / --tls-ca become the credentials of outgoing channels too
        job = load_job_config(args.config)
        store = RefitStore(connect(args.redis_url), args.job_id or job.job.name)
        self.ctx = Context(SPEC.name, args, job, store)
        self.service = RolloutService(self.ctx)
        self.server, health, port = build_server(self.service.servicers(), port=args.port, host=args.host,
                                                 max_message_bytes=args.max_message_bytes, max_workers=args.workers,
                                                 scoped_tokens=args.tokens, tls_cert=args.tls_cert,
                                                 tls_key=args.tls_key)
        self.ctx._health, self.ctx.port = health, port
        self.ctx.endpoint = f"{args.advertise_host}:{port}"
        self.server.start()
        try:
            self.service.start(self.ctx)  # registers the lease, then follows weights:latest
        except BaseException:
            self.server.stop(0)
            raise
        log.info("Serve rollout replica %s serving gRPC at %s", self.ctx.replica_id, self.ctx.endpoint)

    def status(self) -> dict[str, Any]:
        """The replica's id, endpoint, held weight/scales version, readiness and the refit it defers (or None)."""
        e, pending = self.service.engine, self.service.follower.pending
        return {"replica_id": self.ctx.replica_id, "endpoint": self.ctx.endpoint, "weight_version": e.weight_version,
                "scales_version": e.scales_version, "ready": self.service.ready(),
                "pending_version": pending.version if pending else None,
                "pending_reason": pending.reason if pending else None}

    def generate(self, prompts: list[list[int]], weight_version: int, max_tokens: int = 8, n: int = 1,
                 temperature: float = 1.0, seed: int | None = None) -> dict[str, Any]:
        """Samples pinned to ``weight_version`` (VersionMismatchError when this replica holds another)."""
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, n=n, seed=seed)
        samples = self.service.engine.generate(prompts, params, weight_version=weight_version)
        return {"replica_id": self.ctx.replica_id,
                "samples": [{"prompt_index": s.prompt_index, "token_ids": list(s.token_ids),
                             "logprobs": list(s.logprobs), "weight_version": s.weight_version} for s in samples]}

    def check_health(self) -> None:
        """Serve's health hook: a replica whose follower failed is replaced (it rejoins at weights:latest)."""
        if self.ctx.failure is not None:
            raise RuntimeError(f"rollout replica {self.ctx.replica_id} failed: {self.ctx.failure}")

    def __del__(self) -> None:
        ctx = getattr(self, "ctx", None)
        if ctx is None or ctx.stopping.is_set():
            return
        ctx.stopping.set()
        ctx._health.enter_graceful_shutdown()  # NOT_SERVING first, then stop following, then drain
        self.service.stop()
        self.server.stop(ctx.args.grace).wait()


def deployment(replicas: int, *, num_cpus: float = 1.0, num_gpus: float = 0.0, name: str = "rollout"):
    """The Serve deployment of :class:`RolloutReplica` with ``replicas`` replicas and per-replica resources."""
    from ray import serve

    return serve.deployment(RolloutReplica, name=name).options(
        num_replicas=replicas, ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
        health_check_period_s=5, graceful_shutdown_timeout_s=20, max_ongoing_requests=4,
    )


def build_app(args: dict[str, str]):
    """``serve run services.rollout.serve_app:build_app replicas=N num_gpus=G flags="..."`` (Serve app builder)."""
    dep = deployment(int(args.get("replicas", 2)), num_cpus=float(args.get("num_cpus", 1)),
                     num_gpus=float(args.get("num_gpus", 0)))
    return dep.bind(args["flags"], args.get("replica_prefix", "rollout-serve"))
