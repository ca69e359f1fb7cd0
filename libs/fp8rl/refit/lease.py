"""A role lease kept alive: registered with the holder's endpoint, renewed every ``ttl/3``, re-registered when
lost (expired while Redis was away, or fenced), released on a clean stop.

Every service holds one — the skeleton's for trainer, reward and controller, a :class:`~.follower.RefitFollower`'s
(which reports the version its target holds) for rollout replicas and the calibrator — so a service restarted
on another port is found by whoever resolves its role (:meth:`RefitStore.endpoint_of`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

from .store import RefitStore

__all__ = ["LeaseHolder", "RoleLease"]

log = logging.getLogger(__name__)


class LeaseHolder(Protocol):
    """Who holds a lease: a service's context (:class:`services.common.runtime.Context`) is one."""

    store: RefitStore
    replica_id: str
    endpoint: str  # read when (re)registering: known once the server is bound
    stopping: threading.Event

    @property
    def role(self) -> str: ...

    @property
    def lease_ttl(self) -> float: ...


class RoleLease:
    """``holder``'s lease of its role; ``version()`` is the weight version recorded in it (None: holds none)."""

    def __init__(self, holder: LeaseHolder, version: Callable[[], int | None] = lambda: None) -> None:
        self.holder, self.version = holder, version
        self._thread: threading.Thread | None = None

    def register(self) -> None:
        """(Re)create the lease, recording the version held now."""
        h = self.holder
        h.store.register_replica(h.replica_id, h.endpoint, self.version(), h.lease_ttl, role=h.role)

    def start(self, *, tolerate_redis_down: bool = False) -> None:
        """Register, then renew from a daemon thread until ``holder.stopping`` is set. With
        ``tolerate_redis_down`` a failed first registration is logged and left to the renewing thread."""
        try:
            self.register()
        except Exception as exc:  # noqa: BLE001 - re-raised unless the caller keeps serving without Redis
            if not tolerate_redis_down:
                raise
            log.warning("cannot register the %s lease yet: %s", self.holder.role, exc)
        self._thread = threading.Thread(target=self._renew, name=f"{self.holder.role}-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        h, failing = self.holder, 0
        while not h.stopping.wait(max(0.05, h.lease_ttl / 3)):
            try:
                if not h.store.heartbeat(h.replica_id, self.version()):
                    log.warning("the %s lease of %s expired or was fenced; re-registering", h.role, h.replica_id)
                    self.register()
                if failing:
                    log.info("the %s lease of %s is renewed again after %d failed heartbeats", h.role,
                             h.replica_id, failing)
                failing = 0
            except Exception as exc:  # noqa: BLE001 - Redis away: keep serving, renew when it is back
                failing += 1
                if failing & (failing - 1) == 0:  # the 1st, 2nd, 4th, 8th ... failure: a long outage, a short log
                    log.warning("lease heartbeat failed (%d in a row): %s", failing, exc)

    def release(self) -> None:
        """After ``holder.stopping`` is set: join the thread and drop the lease (a clean stop is not a fence)."""
        if self._thread is None:
            return
        self._thread.join(timeout=5)
        try:
            self.holder.store.release(self.holder.replica_id)
        except Exception as exc:  # noqa: BLE001 - it expires on its own
            log.warning("could not release the %s lease of %s: %s", self.holder.role, self.holder.replica_id, exc)
