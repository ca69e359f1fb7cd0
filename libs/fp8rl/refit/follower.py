"""The lease follower: keeps a :class:`~fp8rl.refit.RefitSubscriber` at ``weights:latest`` and its lease alive.

A rollout replica (and the calibrator) runs one: a lease of its role in Redis naming its endpoint and
the version it holds, renewed every TTL/3, and a thread that applies each newly published version as
soon as it is applicable (its QKV scales published too, when the target needs them).

Invariant: the follower never applies a version its target cannot serve correctly — without its
scales, or partially; a failed apply keeps the old version serving and is retried with back-off.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .lease import LeaseHolder, RoleLease
from .store import LeaseExpiredError
from .subscriber import RefitSubscriber

__all__ = ["AWAITING_SCALES", "HELD", "REFIT_FAILED", "PendingRefit", "RefitFollower", "RefitHeld"]

log = logging.getLogger(__name__)

AWAITING_SCALES = "awaiting_scales"  # PendingRefit.reason: v is published, its QKV scales are not (yet)
REFIT_FAILED = "refit_failed"  # PendingRefit.reason: applying v failed; retried with back-off
HELD = "held"  # PendingRefit.reason prefix: the service holds v back (e.g. multi-turn trajectories in flight)


class RefitHeld(Exception):
    """Raised by a refit target's apply when the service holds the version back after all: the hold is asked
    again where the apply runs (a rollout replica's compute thread), so a Generate that opened a trajectory after
    the follower last asked still holds the refit. The engine keeps its version; the follower retries later."""


@dataclass(frozen=True)
class PendingRefit:
    """A published version newer than the one held that the follower saw and has not applied, and why.

    Attributes:
        version: the newest published version (``weights:latest``) when the follower last looked.
        reason: :data:`AWAITING_SCALES`, :data:`REFIT_FAILED`, or :data:`HELD` + ``": why"``.
    """

    version: int
    reason: str


class RefitFollower:
    """Keeps a refit subscriber at ``weights:latest``: a replica lease plus two threads.

    The lease (:class:`~.lease.RoleLease`, recording the target's version) is renewed every ``ttl/3`` and
    re-registered when it was lost (expired or fenced). The follow thread watches the job's events
    stream and, whenever the newest
    published version is newer than the one held and applicable — its QKV scales published too when
    the subscriber ``requires_scales`` — runs ``subscriber.sync_to`` (which applies weights and
    scales together, verified, and acks). A failed sync keeps the old version serving and is
    retried with back-off; events only wake the thread, the decision is always re-read from Redis.

    :attr:`pending` says what the follow thread decided on its last look at Redis: None when the
    engine holds ``weights:latest`` (or nothing is published), else a :class:`PendingRefit` naming
    the version it is deferring and why — so a caller can tell "v was seen and is waiting for its
    scales" from "v was not noticed yet" (a Status RPC reports it).

    Args:
        holder: who holds the lease (:class:`LeaseHolder`: its store, role, id, endpoint, TTL, stop event —
            a service's context is one).
        subscriber: the refit subscriber of this replica's engine.
        lock: serialises syncs with the service's own use of the engine.
        on_change: called after every sync attempt (e.g. to flip health).
        poll_ms: longest wait for an event before Redis is re-read.
        in_order: never move past a version whose QKV scales are still unpublished (the calibrator's: the
            controller asks it to calibrate every version in order, and a calibrator that followed
            ``weights:latest`` past version ``v`` — asynchronous GRPO publishes ahead — could no longer
            calibrate ``v``). It then waits until ``latest - 1`` has its scales; a calibration request syncs
            it forward on demand anyway.
        hold: ``hold(latest)`` → why the service holds ``latest`` back right now (e.g. a rollout replica whose
            multi-turn trajectories of the held version are still in flight: ``env.partial: finish``), or None
            to apply it. Asked on every look; the service bounds how long it holds. A service whose requests
            can open what it holds for between this look and the apply asks again in its target's apply and
            raises :class:`RefitHeld` (the rollout service does, on its compute thread).
    """

    def __init__(self, holder: LeaseHolder, subscriber: RefitSubscriber, *, lock: threading.Lock,
                 on_change: Callable[[], None] = lambda: None, poll_ms: int = 1000, in_order: bool = False,
                 hold: Callable[[int], str | None] | None = None) -> None:
        self.ctx, self.subscriber, self.lock, self.in_order = holder, subscriber, lock, in_order
        self.hold = hold
        self.on_change, self.poll_ms = on_change, poll_ms
        self.store = holder.store
        self.lease = RoleLease(holder, lambda: subscriber.engine.weight_version)
        self._failed: int | None = None
        self._retry_at, self._backoff = 0.0, 0.5
        self._threads: list[threading.Thread] = []
        self.pending: PendingRefit | None = None  # written by the follow thread only; read anywhere

    def start(self) -> None:
        self.lease.start()  # a failed first registration fails the start
        t = threading.Thread(target=self._follow_loop, name=f"{self.ctx.role}-follow", daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self) -> None:
        """Stop both threads and release the lease (a clean stop is not a fence)."""
        self.ctx.stopping.set()
        for t in self._threads:
            t.join(timeout=self.poll_ms / 1000 + 5)
        self.lease.release()

    def register(self) -> None:
        """(Re)create this replica's lease, recording the version held."""
        self.lease.register()

    def sync_to(self, version: int) -> int:
        """``subscriber.sync_to(version)`` under the lock; a lease lost meanwhile is renewed and the ack redone."""
        try:
            with self.lock:
                try:
                    return self.subscriber.sync_to(version)
                except LeaseExpiredError:  # applied, but the lease lapsed: rejoin, then ack what we hold
                    log.warning("lease of %s lapsed during the refit to %d; re-registering", self.ctx.replica_id,
                                version)
                    self.register()
                    self.store.ack(self.ctx.replica_id, version)
                    return version
        finally:
            self.on_change()

    def _maybe_sync(self) -> None:
        latest, held = self.store.latest(), self.subscriber.engine.weight_version
        if latest is None or (held is not None and latest <= held):
            self.pending = None
            return
        if self.in_order and held is not None and self.store.get_scales(latest - 1) is None:
            self.pending = PendingRefit(latest, AWAITING_SCALES)
            return  # version latest - 1 (>= held) is still to be calibrated, here: do not skip past it
        if self.subscriber.requires_scales and self.store.get_scales(latest) is None:
            self.pending = PendingRefit(latest, AWAITING_SCALES)
            return  # the calibrator has not published v's scales: never serve v without them
        if self.hold is not None and held is not None and (why := self.hold(latest)):
            self.pending = PendingRefit(latest, f"{HELD}: {why}")
            return
        if self._failed == latest and time.monotonic() < self._retry_at:
            return
        try:
            self.sync_to(latest)
            self._failed, self._backoff = None, 0.5
            self.pending = None
        except RefitHeld as exc:  # held after all (asked again where the apply runs): no failure, no back-off
            self.pending = PendingRefit(latest, f"{HELD}: {exc}")
        except Exception as exc:  # noqa: BLE001 - any failure keeps the old weights and is retried
            self._backoff = self._backoff * 2 if self._failed == latest else 0.5
            self._failed, self._retry_at = latest, time.monotonic() + min(self._backoff, 30.0)
            self.pending = PendingRefit(latest, REFIT_FAILED)
            log.warning("could not apply weight version %d (still serving %s); retrying in %.1f s: %s",
                        latest, held, min(self._backoff, 30.0), exc)

    def _follow_loop(self) -> None:
        after: str | None = None
        while not self.ctx.stopping.is_set():
            try:
                if after is None:
                    after = self.store.last_event_id()
                self._maybe_sync()
                events = self.store.events(after, block_ms=self.poll_ms)
                if events:
                    after = events[-1].id
                if any(e.type == "replica_fenced" and e.replica == self.ctx.replica_id for e in events):
                    log.warning("replica %s was fenced; rejoining at weights:latest", self.ctx.replica_id)
                    self.register()
            except Exception as exc:  # noqa: BLE001 - Redis down or restarting: keep serving, retry
                log.warning("refit follower: %s; retrying in 1 s", exc)
                self.ctx.stopping.wait(1.0)
