"""Both ends of a refit: the publisher (trainer side) and the subscriber (one rollout replica).

The transport of shard bytes is behind :class:`ShardSource` (the gRPC ``WeightStore.Stream``
client implements it elsewhere; :class:`InProcessShardSource` serves tests and the in-process
loop). This module knows manifests, Redis and an engine's ``load_weights``, never gRPC.

Invariants of :meth:`RefitSubscriber.sync_to` (DESIGN §3):

* it never applies a version older than the engine's current one;
* it applies v only after every shard and every tensor matched its checksum; a corrupt or failed
  fetch is retried, and when retries run out the old weights keep serving;
* with ``requires_scales`` it applies v only together with the QKV scales calibrated on exactly v
  (never another version's, never 1.0 placeholders), in one ``engine.load_weights`` call;
* it acks v in Redis only after the engine holds v.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from fp8rl.engines.base import RolloutEngine

from .manifest import Manifest, assemble, build_shards
from .shards import DEFAULT_SHARD_BYTES, CorruptShardError, verify_shard
from .store import RefitError, RefitStore, StaleVersionError, UnknownVersionError

log = logging.getLogger(__name__)

__all__ = [
    "ShardSource", "InProcessShardSource", "RefitSubscriber", "RefitPublisher", "MissingScalesError",
    "RefitFailedError",
]


class MissingScalesError(RefitError):
    """The QKV scales of the version being applied are not (yet) published; nothing was applied."""


class RefitFailedError(RefitError):
    """Shards could not be fetched intact within the retry budget; the old weights keep serving."""


@runtime_checkable
class ShardSource(Protocol):
    """Fetches the bytes of one shard of a published version (from wherever they are served)."""

    def fetch(self, manifest: Manifest, shard_index: int) -> bytes:
        """The bytes of shard ``shard_index`` of ``manifest.version``; may raise on transport errors."""
        ...


class InProcessShardSource:
    """A :class:`ShardSource` over an in-memory ``{version: [shard bytes, ...]}`` mapping (a live view).

    Args:
        shards: version → list of shard bytes; read at every fetch, so later additions are seen.
    """

    def __init__(self, shards: Mapping[int, Sequence[bytes]]) -> None:
        self._shards = shards

    def fetch(self, manifest: Manifest, shard_index: int) -> bytes:
        try:
            shards = self._shards[manifest.version]
        except KeyError:
            raise LookupError(f"no shards held for weight version {manifest.version}") from None
        if not 0 <= shard_index < len(shards):
            raise LookupError(f"weight version {manifest.version} has {len(shards)} shards, asked for {shard_index}")
        return shards[shard_index]


class RefitSubscriber:
    """Keeps one rollout engine at the published weight version.

    Args:
        store: the job's :class:`RefitStore`.
        engine: the rollout engine refitted in place.
        source: where shard bytes come from.
        replica_id: this replica's id (it must hold a live lease to ack).
        requires_scales: the engine runs an FP8 KV cache and needs the version's QKV scales.
        retries: re-fetches allowed after the first attempt (corrupt shards or fetch errors).
        scales_timeout_s: how long to wait for the version's scales to be published.
        poll_s: polling period while waiting for scales; also the base of the retry back-off.
    """

    def __init__(
        self,
        store: RefitStore,
        engine: RolloutEngine,
        source: ShardSource,
        replica_id: str,
        *,
        requires_scales: bool,
        retries: int = 3,
        scales_timeout_s: float = 30.0,
        poll_s: float = 0.05,
    ) -> None:
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.store, self.engine, self.source = store, engine, source
        self.replica_id = replica_id
        self.requires_scales = requires_scales
        self.retries, self.scales_timeout_s, self.poll_s = retries, scales_timeout_s, poll_s

    def sync_latest(self) -> int | None:
        """Sync to ``weights:latest``; returns the version held afterwards (None if nothing is published)."""
        latest = self.store.latest()
        if latest is None:
            return self.engine.weight_version
        return self.sync_to(latest)

    def sync_to(self, version: int) -> int:
        """Fetch, verify and apply ``version``, then ack it; returns ``version``.

        Holding ``version`` already only re-acks it.

        Raises:
            StaleVersionError: ``version`` is older than the engine's.
            UnknownVersionError: ``version`` was never published.
            MissingScalesError: ``requires_scales`` and v's scales did not appear in time.
            RefitFailedError: shards stayed corrupt/unfetchable after ``retries`` re-fetches.
            WeightLoadError: the engine refused the payload.
            LeaseExpiredError: applied, but this replica's lease is gone (re-register, then re-ack).
            In every case but the last the engine still serves its old version.
        """
        held = self.engine.weight_version
        if held is not None and version < held:
            raise StaleVersionError(version, held, what=f"apply on replica {self.replica_id!r}")
        if held == version:
            self.store.ack(self.replica_id, version)
            return version
        manifest = self.store.get_manifest(version)
        if manifest is None:
            raise UnknownVersionError(f"no manifest for weight version {version} (latest: {self.store.latest()})")
        t0 = time.perf_counter()
        tensors = self._fetch_verified(manifest)
        scales = self._wait_for_scales(version) if self.requires_scales else None
        self.engine.load_weights(version, tensors, scales)  # atomic: raises WeightLoadError, old weights stay
        self.store.ack(self.replica_id, version)
        log.info("replica %s applied weight version %d (%d tensors, %.1f MiB) in %.3f s", self.replica_id,
                 version, len(tensors), manifest.total_bytes / 2**20, time.perf_counter() - t0)
        return version

    def _fetch_verified(self, manifest: Manifest) -> dict[str, torch.Tensor]:
        """All shards fetched and checked; only failed shards are re-fetched, within ``retries``."""
        shards: list[bytes | None] = [None] * manifest.num_shards
        last_error: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                log.warning("replica %s: refit of version %d, retry %d/%d after: %s", self.replica_id,
                            manifest.version, attempt, self.retries, last_error)
                time.sleep(self.poll_s * attempt)
            for i, data in enumerate(shards):
                if data is not None:
                    continue
                try:
                    data = self.source.fetch(manifest, i)
                    verify_shard(i, data, manifest.shard_sizes[i], manifest.shard_checksums[i])
                except Exception as exc:  # any transport failure is retried the same way
                    last_error = exc
                    continue
                shards[i] = data
            if all(s is not None for s in shards):
                try:
                    return assemble(manifest, shards)
                except CorruptShardError as exc:  # the manifest and bytes disagree: re-fetch everything
                    last_error = exc
                    shards = [None] * manifest.num_shards
        raise RefitFailedError(
            f"replica {self.replica_id!r} could not fetch weight version {manifest.version} intact after "
            f"{self.retries + 1} attempt(s); still serving version {self.engine.weight_version}. "
            f"Last error: {last_error}"
        ) from last_error

    def _wait_for_scales(self, version: int):
        deadline = time.monotonic() + self.scales_timeout_s
        while True:
            scales = self.store.get_scales(version)
            if scales is not None:
                if scales.version != version:  # decode_scales checks this too; never apply another version's
                    raise MissingScalesError(f"scales for weight version {version} carry version {scales.version}")
                return scales
            if time.monotonic() >= deadline:
                raise MissingScalesError(
                    f"replica {self.replica_id!r} needs the QKV scales of weight version {version}, but none were "
                    f"published within {self.scales_timeout_s} s; still serving version {self.engine.weight_version}"
                )
            time.sleep(self.poll_s)


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
