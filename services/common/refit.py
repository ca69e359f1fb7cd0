"""The refit data plane of a service, built from the job's ``refit`` section (one place for every role).

Trainer: :func:`build_publisher` — a :class:`RefitPublisher` that allocates shards in shared memory
when ``refit.transport`` is ``auto`` or ``shm`` (and the directory is writable; else gRPC only, logged).
With ``refit.collective`` the trainer also broadcasts (:func:`start_broadcaster`, once its endpoint is known).
Replicas (rollout, calibrator): :func:`build_subscriber` — the :class:`ShardSource` of ``refit.transport``
with gRPC as the fallback, ``refit.parallel_streams`` streams at once, deltas with ``refit.delta``, and a
collective group member with ``refit.collective``.
"""

from __future__ import annotations

import logging

from fp8rl.refit import RefitPublisher, RefitStore, RefitSubscriber, RefitTarget
from fp8rl.refit.transport import ShardSource, make_shard_source
from fp8rl.refit.transport.shm import ShmShardWriter, ShmUnavailableError

log = logging.getLogger(__name__)

__all__ = ["build_publisher", "build_subscriber", "start_broadcaster"]


def build_publisher(store: RefitStore, refit, *, shard_bytes: int, lora: bool = False) -> RefitPublisher:
    """The trainer's publisher for the job's ``refit`` config section (``lora``: the job trains LoRA adapters, so
    versions after the base ship them alone)."""
    shm = None
    if refit.transport in ("auto", "shm"):
        try:
            shm = ShmShardWriter(store.job, refit.shm_root)
        except ShmUnavailableError as exc:
            if refit.transport == "shm":
                raise
            log.warning("refit.transport auto: no shared memory (%s); replicas pull over gRPC", exc)
    log.info("refit: transport %s, shared memory %s", refit.transport, shm.dir if shm else "off")
    return RefitPublisher(store, shard_bytes=shard_bytes, shm=shm, delta=refit.delta, lora=lora)


def start_broadcaster(publisher: RefitPublisher, refit, endpoint: str) -> None:
    """With ``refit.collective``, give the publisher a broadcaster whose store listens on the trainer's host
    (the host part of ``endpoint``, the address replicas reach the trainer at)."""
    if not refit.collective or refit.transport == "grpc" or refit.transport == "shm":
        return
    from fp8rl.refit.transport.collective import CollectiveBroadcaster

    host = endpoint.rpartition(":")[0] or "127.0.0.1"
    publisher.broadcaster = CollectiveBroadcaster(publisher.store, host=host)
    log.info("refit: collective broadcast group store at %s", publisher.broadcaster.endpoint)


def build_subscriber(store: RefitStore, target: RefitTarget, replica_id: str, refit, *,
                     requires_scales: bool, metrics=None) -> tuple[RefitSubscriber, ShardSource]:
    """A replica's subscriber and its shard source for the job's ``refit`` config section.

    ``metrics`` (:class:`fp8rl.metrics.ServiceMetrics`): every applied version is counted there."""
    collective = None
    if refit.collective and refit.transport in ("auto", "collective"):
        from fp8rl.refit.transport.collective import CollectiveShardSource

        collective = CollectiveShardSource(store, replica_id)
    elif refit.transport == "collective":
        raise ValueError("refit.transport: collective needs refit.collective: true (the trainer must broadcast)")
    source = make_shard_source(refit.transport, collective=collective)
    sub = RefitSubscriber(store, target, source, replica_id, requires_scales=requires_scales,
                          parallel_fetches=refit.parallel_streams, delta=refit.delta)
    if metrics is not None:
        sub.on_applied = lambda r: metrics.observe_refit("apply", r["version"], r["bytes"], r["seconds"])
    return sub, source
