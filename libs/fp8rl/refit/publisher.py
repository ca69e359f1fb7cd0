"""Trainer side of a refit: build a version's shards, hold the newest few to serve, publish the manifest.

Around the gRPC WeightStore (which serves :meth:`RefitPublisher.shards`), two optional data planes:
a :class:`~fp8rl.refit.transport.shm.ShmShardWriter` allocates the shards inside shared-memory files
(same-host replicas map them), and a broadcaster (:mod:`fp8rl.refit.transport.collective`) is offered
each published version to push to its group of replicas.

Invariant: the shards of a version are held (and its shared-memory files complete) before its
manifest appears in Redis, so every published version is servable the moment a replica learns about
it; a version whose build or publish fails leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch

from fp8rl.fp8.payload import is_adapter

from .delta import build_delta, delta_stats
from .manifest import Manifest, build_shards, frozen_checksum
from .shards import DEFAULT_SHARD_BYTES, unpack_tensors
from .store import RefitStore, StaleVersionError
from .transport import InProcessShardSource
from .transport.shm import ShmShardWriter, ShmUnavailableError

log = logging.getLogger(__name__)

__all__ = ["RefitPublisher", "Broadcaster", "REFIT_ROLES"]

REFIT_ROLES = ("rollout", "calibrator")  # the lease roles that pull weight versions


class Broadcaster(Protocol):
    """Pushes published versions to a group of replicas (the ``collective`` transport's trainer side)."""

    endpoint: str

    def offer(self, manifest: Manifest, shards: Sequence[Any]) -> None:
        """Hand over a published version; must not block on the replicas."""

    def close(self) -> None: ...


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
        shm: allocate the shards in shared memory (same-host replicas map them), or None.
        broadcaster: offered every published version (the collective transport), or None.
        delta: also publish each version as a delta against the previous one (:mod:`.delta`), served
            next to the full version; skipped (logged) when the layouts differ.
        lora: a LoRA job (``policy.lora``): the first version published holds every tensor and stays servable
            for good (the frozen base, pinned: replicas that join later pull it); every later version holds the
            adapters alone, its manifest naming the base (``adapters_on``).
    """

    def __init__(
        self, store: RefitStore, shard_bytes: int = DEFAULT_SHARD_BYTES, *, keep: int = 2, endpoint: str = "",
        shm: ShmShardWriter | None = None, broadcaster: Broadcaster | None = None, delta: bool = False,
        lora: bool = False,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.store, self.shard_bytes, self.keep, self.endpoint = store, shard_bytes, keep, endpoint
        self.shm, self.broadcaster, self.delta, self.lora = shm, broadcaster, delta, lora
        self._pinned: dict[str, Any] | None = None  # LoRA: the base's version and frozen_checksum, once published
        self._shards: dict[int, list[Any]] = {}
        self._delta_shards: dict[int, list[Any]] = {}
        self._manifests: dict[int, Manifest] = {}
        self._spare_buffers: list[bytearray] = []  # an evicted version's shard buffers, for the next one
        self._shm_full_logged = False
        self.last_delta: dict[str, float] | None = None  # delta_stats of the newest version, when one was built
        self._lock = threading.Lock()

    def publish(
        self,
        state_dict: Mapping[str, torch.Tensor],
        version: int,
        *,
        recipe: str,
        fp8_prefixes: Iterable[str] = (),
        pow2_scale: bool = False,
        scaling: str = "blockwise",
    ) -> Manifest:
        """Quantize/serialise ``state_dict`` as ``version`` and publish it (see :func:`build_shards`). A LoRA
        publisher whose base is published ships only ``state_dict``'s adapters (the caller may pass them alone:
        :attr:`wants_base` says when every tensor is needed).

        Raises:
            StaleVersionError: ``version`` is not newer than ``weights:latest`` (nothing kept or published).
            ValueError: NaN/Inf in a tensor, or a bad FP8 prefix; a LoRA publisher given adapters alone before its
                base, or no adapters (nothing published).
        """
        adapters_on = None
        if self.lora:
            adapters = {n: t for n, t in state_dict.items() if is_adapter(n)}
            if not adapters:
                raise ValueError(f"weight version {version}: a LoRA job's state dict holds no adapters")
            if self._pinned is not None:
                state_dict, fp8_prefixes, adapters_on = adapters, (), dict(self._pinned)
            elif len(adapters) == len(state_dict):
                raise ValueError(f"weight version {version}: a LoRA job's first version must carry the base too, "
                                 "not the adapters alone")
        latest = self.store.latest()
        if latest is not None and version <= latest:  # cheap early refusal; publish() re-checks atomically
            raise StaleVersionError(version, latest)
        # Make room first, so the version leaving can lend its buffers to this one (keep >= 2 still serves the
        # newest version meanwhile, and it is the delta's base).
        self._evict(max(1, self.keep - 1))
        def build(alloc):
            return build_shards(state_dict, version, job=self.store.job, recipe=recipe, endpoint=self.endpoint,
                                fp8_prefixes=fp8_prefixes, pow2_scale=pow2_scale, scaling=scaling,
                                shard_bytes=self.shard_bytes,
                                alloc=alloc)

        try:
            try:
                manifest, shards = build(self.shm.begin(version) if self.shm else self._alloc)
                extra: dict[str, Any] = self.shm.commit(version) if self.shm else {}
            except ShmUnavailableError as exc:  # shared memory full: this version goes by the other transports
                (log.warning if not self._shm_full_logged else log.debug)(
                    "weight version %d is not in shared memory (%s); replicas pull it over gRPC (said once)", version,
                    exc)
                self._shm_full_logged = True
                self.shm.abort(version)
                manifest, shards = build(self._alloc)
                extra = {}
            self._spare_buffers.clear()  # what this version could not reuse (another size)
            if self.broadcaster is not None:
                extra["collective"] = self.broadcaster.endpoint
            if adapters_on is not None:
                extra["adapters_on"] = adapters_on
            if extra:
                manifest = dataclasses.replace(manifest, **extra)
            delta = self._build_delta(manifest, shards) if self.delta else None
            with self._lock:
                self._shards[version], self._manifests[version] = shards, manifest
                if delta is not None:
                    self._delta_shards[version] = delta[1]
            if delta is not None:
                self.store.put_delta(delta[0])  # before the full manifest: whoever sees v can find its delta
            self.store.publish(manifest)
        except Exception:
            with self._lock:
                self._shards.pop(version, None)
                self._delta_shards.pop(version, None)
                self._manifests.pop(version, None)
            if self.shm:
                self.shm.abort(version)
            raise
        if self.lora and self._pinned is None:  # the base: servable for as long as this publisher lives
            self._pinned = {"version": version, "checksum": frozen_checksum(manifest)}
            log.info("weight version %d carries the frozen LoRA base (%.1f MiB); later versions ship adapters alone",
                     version, manifest.total_bytes / 2**20)
        self._evict(self.keep)
        if self.broadcaster is not None:
            self.broadcaster.offer(manifest, shards)
        return manifest

    def _evict(self, keep: int) -> None:
        """Drop all but the newest ``keep`` versions. Their buffers are recycled for the next version (no fresh
        pages: allocating and faulting them in is most of what building costs here) only when no refit lease
        can still be reading them: every live rollout / calibrator lease holds that version or a newer one
        (a replica never re-reads the version it holds, and one behind it may be reading it right now)."""
        pinned = None if self._pinned is None else self._pinned["version"]
        with self._lock:
            evicted = {v: self._shards.pop(v) for v in sorted(self._shards)[:-keep] if v != pinned}
            for v in evicted:
                self._delta_shards.pop(v, None)
                self._manifests.pop(v, None)
        if not evicted:
            return
        leases = self.store.live_replicas()
        held = [x.version for x in leases.values() if x.role in REFIT_ROLES]
        for v, bufs in evicted.items():
            recycle = all(h is not None and h >= v for h in held)
            if self.shm:
                self.shm.evict(v, recycle=recycle)
            elif recycle:
                self._spare_buffers += [b for b in bufs if isinstance(b, bytearray)]

    @property
    def wants_base(self) -> bool:
        """Whether the next publish must hold every tensor: always, unless this is a LoRA publisher whose base is
        published (then the adapters alone suffice)."""
        return not self.lora or self._pinned is None

    def _alloc(self, index: int, size: int, entries) -> bytearray:
        """A shard buffer: a recycled one of the same size, else a new one."""
        for i, b in enumerate(self._spare_buffers):
            if len(b) == size:
                return self._spare_buffers.pop(i)
        return bytearray(size)

    def _build_delta(self, manifest: Manifest, shards: Sequence[Any]):
        """The delta of ``manifest`` against the newest held version, or None (none held, layout changed)."""
        with self._lock:
            held = sorted(v for v in self._shards if v < manifest.version)
            if not held:
                return None
            base_v = held[-1]
            base, base_shards = self._manifests[base_v], self._shards[base_v]
        out = build_delta(base, unpack_tensors(base.tensors, base_shards), manifest,
                          unpack_tensors(manifest.tensors, shards), shard_bytes=self.shard_bytes)
        if out is None:
            log.info("weight version %d: no delta against %d (the tensor layout changed)", manifest.version, base_v)
            self.last_delta = None
            return None
        st = self.last_delta = delta_stats(manifest, out[0])
        log.info("weight version %d: delta against %d is %.2f%% of the full %.1f MiB (%d tensors sparse, %d whole, "
                 "%d unchanged)", manifest.version, base_v, 100 * st["ratio"], manifest.total_bytes / 2**20,
                 st["tensors_sparse"], st["tensors_whole"], st["tensors_unchanged"])
        return out

    def close(self) -> None:
        """Stop the broadcaster and remove the shared-memory files; held shards stay servable over gRPC."""
        if self.broadcaster is not None:
            self.broadcaster.close()
        if self.shm is not None:
            self.shm.close()

    def versions(self) -> list[int]:
        """Versions whose shards are held, oldest first."""
        with self._lock:
            return sorted(self._shards)

    def shards(self, version: int, *, delta: bool = False) -> list[Any]:
        """The shard bytes of ``version`` (its delta's with ``delta``); ``LookupError`` if not held here."""
        with self._lock:
            held = self._delta_shards if delta else self._shards
            if version not in held:
                what = "delta shards" if delta else "shards"
                raise LookupError(f"{what} of weight version {version} are not held (held: {sorted(held)})")
            return list(held[version])

    def source(self) -> InProcessShardSource:
        """A :class:`ShardSource` serving this publisher's held shards directly (in-process refits)."""
        return InProcessShardSource(_LockedView(self))


class _LockedView(Mapping[int, Sequence[bytes]]):
    """Read-only, lock-taking mapping view of a publisher's held shards."""

    def __init__(self, publisher: RefitPublisher) -> None:
        self._p = publisher

    def __getitem__(self, key: int | tuple[int, str]) -> Sequence[bytes]:
        version, delta = (key[0], True) if isinstance(key, tuple) else (key, False)
        try:
            return self._p.shards(version, delta=delta)
        except LookupError:
            raise KeyError(key) from None

    def __iter__(self):
        return iter(self._p.versions())

    def __len__(self) -> int:
        return len(self._p.versions())
