"""Refit transports behind one seam: :class:`ShardSource` (``base``), in memory (``inprocess``), gRPC streams
from the trainer's ``WeightStore`` (``grpc``), shared-memory files on the trainer's host (``shm``), a
``torch.distributed`` broadcast group (``collective``). :func:`make_shard_source` builds one by name;
``auto`` chooses per version (:class:`AutoShardSource`).

Invariant: a transport moves bytes and nothing else — verification and applying stay in the subscriber,
so a transport that fails or delivers garbage costs a retry or a fallback to gRPC, never a wrong weight.
"""

from __future__ import annotations

import logging
import threading

from ..manifest import Manifest
from ..shards import verify_shard
from .base import CountingSource, ShardSource
from .inprocess import InProcessShardSource

log = logging.getLogger(__name__)

__all__ = ["TRANSPORTS", "AutoShardSource", "CountingSource", "InProcessShardSource", "ShardSource",
           "make_shard_source"]

TRANSPORTS = ("auto", "grpc", "shm", "collective", "inprocess")


class AutoShardSource:
    """Picks a transport per version: ``preferred`` ones in order where they can serve it, then gRPC.

    ``refit.transport: auto`` prefers shared memory when the manifest's shm directory is on this host,
    then the collective group when the manifest names one and this replica joined it. An explicit
    ``shm`` or ``collective`` prefers that one alone. Either way a transport that fails for a shard —
    raises, or delivers bytes that fail the shard's checksum — falls back to gRPC for that shard
    (logged), and the choice is logged once each time it changes.

    Args:
        grpc: the fallback source (a :class:`~.grpc.GrpcShardSource`).
        preferred: ``(name, source)`` pairs, most preferred first; a source may offer
            ``available(manifest) -> bool`` (else it is tried whenever listed).
    """

    verifies_shards = True  # every shard it returns passed its checksum (the subscriber does not hash it again)

    def __init__(self, grpc: ShardSource, preferred: list[tuple[str, ShardSource]]) -> None:
        self.grpc, self.preferred = grpc, preferred
        self._chosen: str | None = None
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}  # shards delivered per transport (and "fallback" for failures)

    def choose(self, manifest: Manifest) -> tuple[str, ShardSource]:
        """The transport that will serve ``manifest``'s shards here (a delta's: gRPC, which alone serves them)."""
        if manifest.base is not None:
            return "grpc", self.grpc
        for name, src in self.preferred:
            available = getattr(src, "available", None)
            if available is None or available(manifest):
                return name, src
        return "grpc", self.grpc

    def fetch(self, manifest: Manifest, shard_index: int):
        name, src = self.choose(manifest)
        with self._lock:
            if name != self._chosen:
                log.info("refit transport for weight version %d: %s", manifest.version, name)
                self._chosen = name
        if src is not self.grpc:
            try:
                data = src.fetch(manifest, shard_index)
                # checked here, so a corrupt fast path costs a fallback, not the subscriber's retries
                i = shard_index
                verify_shard(i, data, manifest.shard_sizes[i], manifest.shard_checksums[i])
                self._count(name)
                return data
            except Exception as exc:  # noqa: BLE001 - any failure of the fast path falls back to gRPC
                log.warning("refit via %s failed for shard %d of weight version %d (%s); pulling it over gRPC",
                            name, shard_index, manifest.version, exc)
                self._count("fallback")
        data = self.grpc.fetch(manifest, shard_index)
        i = shard_index
        verify_shard(i, data, manifest.shard_sizes[i], manifest.shard_checksums[i])
        self._count("grpc")
        return data

    def _count(self, name: str) -> None:
        with self._lock:
            self.counts[name] = self.counts.get(name, 0) + 1

    def close(self) -> None:
        for src in [self.grpc] + [s for _, s in self.preferred]:
            close = getattr(src, "close", None)
            if close is not None:
                close()


def make_shard_source(kind: str = "grpc", *, collective: ShardSource | None = None, **kwargs) -> ShardSource:
    """The replica-side :class:`ShardSource` for ``refit.transport`` = ``kind``.

    ``"grpc"`` (:class:`.grpc.GrpcShardSource`, kwargs: its options); ``"shm"``, ``"collective"`` and
    ``"auto"`` (an :class:`AutoShardSource` over those with gRPC as the fallback; ``collective``: this
    replica's :class:`.collective.CollectiveShardSource`, needed by ``"collective"``, optional for
    ``"auto"``); ``"inprocess"`` (:class:`InProcessShardSource`, kwarg ``shards``).
    """
    if kind == "inprocess":
        return InProcessShardSource(**kwargs)
    if kind not in TRANSPORTS:
        raise ValueError(f"unknown refit transport {kind!r}; known: {', '.join(TRANSPORTS)}")
    from .grpc import GrpcShardSource  # the gRPC stack only for those who use it

    grpc = GrpcShardSource(**kwargs)
    if kind == "grpc":
        return grpc
    from .shm import ShmShardSource

    if kind == "collective" and collective is None:
        raise ValueError("refit.transport: collective needs this replica's collective source (refit.collective)")
    preferred: list[tuple[str, ShardSource]] = []
    if kind in ("auto", "shm"):
        preferred.append(("shm", ShmShardSource()))
    if kind in ("auto", "collective") and collective is not None:
        preferred.append(("collective", collective))
    return AutoShardSource(grpc, preferred)
