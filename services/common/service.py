"""A role, as the skeleton sees it: its :class:`ServiceSpec`, the :class:`Service` it builds, the
:class:`Context` it gets (a :class:`fp8rl.refit.LeaseHolder`: the skeleton keeps its role lease in Redis).
"""

from __future__ import annotations

import abc
import argparse
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fp8rl.config import JobConfig
from fp8rl.metrics import ServiceMetrics
from fp8rl.refit import RefitStore
from fp8rl.rpc.server import SCOPE_SERVICE, ServicerAdder, set_serving

from .compute import inline

log = logging.getLogger("fp8rl.service")

__all__ = ["Context", "Service", "ServiceSpec", "StartupError"]


class StartupError(RuntimeError):
    """The service cannot start with this configuration (exit status 2, message on stderr)."""


class Context:
    """What a service gets from the skeleton: its flags, job, Redis state, endpoint and health switch."""

    def __init__(self, name: str, args: argparse.Namespace, job: JobConfig, store: RefitStore) -> None:
        self.name, self.args, self.job, self.store = name, args, job, store
        self.job_id: str = store.job
        self.replica_id: str = args.replica_id
        self.endpoint = ""  # "host:port" others reach this server at; set once the port is bound
        self.port = 0
        self.stopping = threading.Event()
        self.failure: BaseException | None = None
        self._health = None
        # runs a role's torch work: the process's compute thread (services.common.compute) when the role has
        # one, else the call made inline
        self.compute: Callable[..., Any] = inline
        # the process's Prometheus metrics (fp8rl.metrics); served when --metrics-port is given
        self.metrics = ServiceMetrics(name)

    @property
    def role(self) -> str:
        """The lease role: the service's name."""
        return self.name

    @property
    def lease_ttl(self) -> float:
        return self.args.lease_ttl

    def set_serving(self, serving: bool) -> None:
        """Flip gRPC health for the whole server (ignored once shutdown began)."""
        if self._health is not None and not self.stopping.is_set():
            set_serving(self._health, serving)

    def fail(self, exc: BaseException) -> None:
        """A background thread hit an unrecoverable error: stop the process with exit status 1."""
        log.error("%s: fatal: %s", self.name, exc, exc_info=exc)
        self.failure = exc
        self.stopping.set()


class Service(abc.ABC):
    """One role's wiring: its servicers, what to do once the port is bound, and how to stop."""

    @abc.abstractmethod
    def servicers(self) -> list[ServicerAdder]:
        """``(add_XServicer_to_server, servicer)`` pairs served on the role's port."""

    @abc.abstractmethod
    def start(self, ctx: Context) -> None:
        """The server is listening at ``ctx.endpoint``: publish/register/start threads, then ``ctx.set_serving``."""

    def stop(self) -> None:  # noqa: B027 - optional hook
        """Stop background threads (health is already NOT_SERVING)."""


@dataclass(frozen=True)
class ServiceSpec:
    """A role: its name, default port, constructor, and extra flags.

    Attributes:
        name: ``trainer``, ``rollout``, ``calibrator``...
        default_port: port used when neither ``--port`` nor ``$FP8RL_PORT`` is given.
        build: makes the :class:`Service` from the :class:`Context` (loads models; may raise StartupError).
        add_args: adds the role's own flags to the parser.
        scopes: the token scopes its RPCs belong to (``fp8rl.rpc.server``): the controller's JobService is
            :data:`~fp8rl.rpc.server.SCOPE_CLIENT`, every other role :data:`~fp8rl.rpc.server.SCOPE_SERVICE`.
            Listening off loopback needs a token for each (or ``--insecure``).
        follows_refit: the role's lease is its :class:`~fp8rl.refit.RefitFollower`'s (rollout, calibrator); every other
            role gets a :class:`fp8rl.refit.RoleLease` from the skeleton.
        needs_redis: the role cannot work without Redis (refit state, job records), so an unreachable Redis at
            startup is an error. When false (reward: grading needs no Redis) the service starts anyway and its
            lease registers once Redis answers; until then callers reach it by address.
        compute_thread: whether the role builds its model and runs its torch work on one
            :class:`~services.common.compute.ComputeThread` (``ctx.compute``); a callable decides from the job
            (the rollout: only for the embedded torch engine — vLLM computes in its own processes).
    """

    name: str
    default_port: int
    build: Callable[[Context], Service]
    add_args: Callable[[argparse.ArgumentParser], None] | None = None
    scopes: tuple[str, ...] = (SCOPE_SERVICE,)
    follows_refit: bool = False
    needs_redis: bool = True
    compute_thread: bool | Callable[[JobConfig], bool] = False

    def uses_compute_thread(self, job: JobConfig) -> bool:
        return self.compute_thread(job) if callable(self.compute_thread) else bool(self.compute_thread)
