"""Trainer side of a refit: build a version's shards, hold the newest few to serve, publish the manifest.

Invariant: the shards of a version are held before its manifest appears in Redis, so every published
version is servable the moment a replica learns about it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence

import torch

from .manifest import Manifest, build_shards
from .shards import DEFAULT_SHARD_BYTES
from .store import RefitStore, StaleVersionError
from .transport import InProcessShardSource

log = logging.getLogger(__name__)

__all__ = ["RefitPublisher"]


class RefitPublisher:
    """Trainer side: builds shards, keeps the newest ``keep`` versions in memory to serve, publishes.

    The shards of a version are held *before* its manifest appears in Redis, so every published
    version is servable the moment a replica learns about it. Thread-safe: a server may call
    :meth:`shards` while the trainer publishes.

    Args:
        store: the job's :class:`RefitStore`.
        shard_bytes: most bytes per shard.
        keep: how many of the newest versions stay servable (older ones are evicted).
        endpoint: ``host:port`` of the WeightStore serving these shards ("" when in-process).
    """

    def __init__(
        self, store: RefitStore, shard_bytes: int = DEFAULT_SHARD_BYTES, *, keep: int = 2, endpoint: str = ""
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.store, self.shard_bytes, self.keep, self.endpoint = store, shard_bytes, keep, endpoint
        self._shards: dict[int, list[bytes]] = {}
        self._lock = threading.Lock()

    def publish(
        self,
        state_dict: Mapping[str, torch.Tensor],
        version: int,
        *,
        recipe: str,
        fp8_prefixes: Iterable[str] = (),
        pow2_scale: bool = False,
    ) -> Manifest:
        """Quantize/serialise ``state_dict`` as ``version`` and publish it (see :func:`build_shards`).

        Raises:
            StaleVersionError: ``version`` is not newer than ``weights:latest`` (nothing kept or published).
            ValueError: NaN/Inf in a tensor, or a bad FP8 prefix (nothing published).
        """
        latest = self.store.latest()
        if latest is not None and version <= latest:  # cheap early refusal; publish() re-checks atomically
            raise StaleVersionError(version, latest)
        manifest, shards = build_shards(
            state_dict, version, job=self.store.job, recipe=recipe, endpoint=self.endpoint,
            fp8_prefixes=fp8_prefixes, pow2_scale=pow2_scale, shard_bytes=self.shard_bytes,
        )
        with self._lock:
            self._shards[version] = shards
        try:
            self.store.publish(manifest)
        except Exception:
            with self._lock:
                self._shards.pop(version, None)
            raise
        with self._lock:
            for v in sorted(self._shards)[:-self.keep]:
                del self._shards[v]
        return manifest

    def versions(self) -> list[int]:
        """Versions whose shards are held, oldest first."""
        with self._lock:
            return sorted(self._shards)

    def shards(self, version: int) -> list[bytes]:
        """The shard bytes of ``version``; ``LookupError`` if it was evicted or never published here."""
        with self._lock:
            if version not in self._shards:
                raise LookupError(f"shards of weight version {version} are not held (held: {sorted(self._shards)})")
            return list(self._shards[version])

    def source(self) -> InProcessShardSource:
        """A :class:`ShardSource` serving this publisher's held shards directly (in-process refits)."""
        return InProcessShardSource(_LockedView(self))


class _LockedView(Mapping[int, Sequence[bytes]]):
    """Read-only, lock-taking mapping view of a publisher's held shards."""

    def __init__(self, publisher: RefitPublisher) -> None:
        self._p = publisher

    def __getitem__(self, version: int) -> Sequence[bytes]:
        try:
            return self._p.shards(version)
        except LookupError:
            raise KeyError(version) from None

    def __iter__(self):
        return iter(self._p.versions())

    def __len__(self) -> int:
        return len(self._p.versions())
