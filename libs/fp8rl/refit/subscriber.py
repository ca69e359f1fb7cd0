"""Replica side of a refit: keep one :class:`RefitTarget` (a rollout engine, the calibrator's model) at a
published version.

The transport of shard bytes is behind :class:`~fp8rl.refit.transport.ShardSource`
(:mod:`fp8rl.refit.transport`); the publisher is :mod:`fp8rl.refit.publisher`. This module knows
manifests, Redis and a target's ``load_weights``, never gRPC and never the engines.

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
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch

from fp8rl.fp8 import QKVScales
from fp8rl.fp8.payload import is_adapter

from .delta import apply_delta, owned
from .manifest import Manifest, assemble, frozen_checksum
from .shards import CorruptShardError, verify_shard
from .store import RefitError, RefitStore, StaleVersionError, UnknownVersionError
from .transport import ShardSource

log = logging.getLogger(__name__)

__all__ = ["RefitSubscriber", "RefitTarget", "MissingScalesError", "RefitFailedError"]


class MissingScalesError(RefitError):
    """The QKV scales of the version being applied are not (yet) published; nothing was applied."""


class RefitFailedError(RefitError):
    """Shards could not be fetched intact within the retry budget; the old weights keep serving."""


class RefitTarget(Protocol):
    """What refit needs of whatever it keeps at the published version (a rollout engine, the calibrator's
    model): the versions it holds and an atomic load. Refit never imports the engines."""

    @property
    def weight_version(self) -> int | None: ...

    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor],
                     qkv_scales: QKVScales | None = None) -> None:
        """Apply ``version`` (weights and, for an FP8 KV cache, its scales) all or nothing."""


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
        parallel_fetches: shards fetched (and verified) at once, each on its own thread (a gRPC stream
            each; checksums release the GIL).
        delta: pull a version's delta manifest when it patches the version held (unless the full
            version is in this host's shared memory), keeping a copy of the applied tensors in their
            wire form as the next base (host memory: one payload); any failure of the delta path
            pulls the full version instead.
    """

    def __init__(
        self,
        store: RefitStore,
        engine: RefitTarget,
        source: ShardSource,
        replica_id: str,
        *,
        requires_scales: bool,
        retries: int = 3,
        scales_timeout_s: float = 30.0,
        poll_s: float = 0.05,
        parallel_fetches: int = 4,
        delta: bool = False,
    ) -> None:
        if retries < 0 or parallel_fetches < 1:
            raise ValueError(f"need retries >= 0 and parallel_fetches >= 1, got {retries}, {parallel_fetches}")
        self.parallel_fetches, self.delta = parallel_fetches, delta
        self._base: tuple[Manifest, dict[str, torch.Tensor]] | None = None  # delta base: the applied version
        self.last_refit: dict | None = None  # version, how ("full" / "delta"), bytes pulled, seconds
        self.on_applied: Callable[[dict], None] | None = None  # called with last_refit after each apply
        self.store, self.engine, self.source = store, engine, source
        self.replica_id = replica_id
        self.requires_scales = requires_scales
        # LoRA: frozen_checksum of the base the engine holds (None: no version applied by this subscriber yet)
        self._frozen: str | None = None
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
        tensors, pulled, pulled_bytes = None, manifest, 0
        on = manifest.adapters_on  # LoRA: adapters alone, on a frozen base this replica may not hold
        base_tensors: dict[str, torch.Tensor] = {}
        if on is not None and on["checksum"] != self._frozen:
            base_tensors, pulled_bytes = self._fetch_base(manifest)
        if self.delta and self._base is not None and self._base[0].version == held and not self._same_host(manifest):
            tensors, pulled = self._try_delta(manifest)
        if tensors is None:
            tensors, pulled = self._fetch_verified(manifest), manifest
        pulled_bytes += pulled.total_bytes
        scales = self._wait_for_scales(version) if self.requires_scales else None
        # atomic: raises WeightLoadError, old weights stay
        self.engine.load_weights(version, {**base_tensors, **tensors} if base_tensors else tensors, scales)
        if on is not None:
            self._frozen = on["checksum"]
        else:  # a full version: its base's identity matters only in a LoRA job (it then holds adapters)
            self._frozen = frozen_checksum(manifest) if any(is_adapter(e.name) for e in manifest.tensors) else None
        if self.delta:  # the next delta's base; a full refit's tensors view transport buffers, so they are copied
            self._base = (manifest, tensors if pulled is not manifest else owned(tensors))
        self.store.ack(self.replica_id, version)
        how = ("delta" if pulled is not manifest else "full") + ("+base" if base_tensors else "")
        self.last_refit = {"version": version, "how": how, "bytes": pulled_bytes, "seconds": time.perf_counter() - t0}
        log.info("replica %s applied weight version %d (%d tensors, %s: %d bytes, %.1f MiB) in %.3f s", self.replica_id,
                 version, len(tensors) + len(base_tensors), how, pulled_bytes, pulled_bytes / 2**20,
                 time.perf_counter() - t0)
        if self.on_applied is not None:
            try:
                self.on_applied(self.last_refit)
            except Exception:  # noqa: BLE001 - an observer never fails an applied refit
                log.exception("replica %s: the refit observer failed", self.replica_id)
        return version

    def _fetch_base(self, manifest: Manifest) -> tuple[dict[str, torch.Tensor], int]:
        """The frozen base (every tensor but the adapters) of a LoRA version that holds its adapters alone, pulled
        from the version that shipped it (``manifest.adapters_on``) and checked against the identity it names; and
        the bytes that pull moved.

        Raises:
            UnknownVersionError: the base version's manifest is gone.
            RefitFailedError: it ships another base than the one named, or stayed unfetchable.
        """
        on = manifest.adapters_on
        bm = self.store.get_manifest(on["version"])
        if bm is None:
            raise UnknownVersionError(f"weight version {manifest.version} holds LoRA adapters on base version "
                                      f"{on['version']}, whose manifest is gone")
        shipped = frozen_checksum(bm)
        if shipped != on["checksum"]:
            raise RefitFailedError(f"weight version {manifest.version} names base version {on['version']} with "
                                   f"frozen checksum {on['checksum']}, but that version ships another base "
                                   f"({shipped}); still serving version {self.engine.weight_version}")
        log.info("replica %s pulls the frozen LoRA base (version %d, %.1f MiB) under weight version %d",
                 self.replica_id, bm.version, bm.total_bytes / 2**20, manifest.version)
        return {n: t for n, t in self._fetch_verified(bm).items() if not is_adapter(n)}, bm.total_bytes

    def _same_host(self, manifest: Manifest) -> bool:
        """The full version is mapped from this host's shared memory: no bytes to save, so no delta."""
        choose = getattr(self.source, "choose", None)
        return choose is not None and choose(manifest)[0] == "shm"

    def _try_delta(self, manifest: Manifest) -> tuple[dict[str, torch.Tensor] | None, Manifest]:
        """Version ``manifest.version`` rebuilt from its delta and the held base, or ``(None, manifest)``."""
        base, base_tensors = self._base
        try:
            dm = self.store.get_delta(manifest.version)
        except (RefitError, ValueError) as exc:
            log.warning("replica %s: unreadable delta manifest of version %d (%s); pulling it whole",
                        self.replica_id, manifest.version, exc)
            return None, manifest
        if dm is None or dm.base != base.version:
            return None, manifest
        try:
            parts = self._fetch_verified(dm)
            return apply_delta(manifest, dm, base, base_tensors, parts), dm
        except (RefitFailedError, CorruptShardError) as exc:
            log.warning("replica %s: delta %d -> %d failed (%s); pulling the full version", self.replica_id,
                        dm.base, manifest.version, exc)
            return None, manifest

    def _fetch_verified(self, manifest: Manifest) -> dict[str, torch.Tensor]:
        """All shards fetched and checked; only failed shards are re-fetched, within ``retries``."""
        shards: list[bytes | None] = [None] * manifest.num_shards
        last_error: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                log.warning("replica %s: refit of version %d, retry %d/%d after: %s", self.replica_id,
                            manifest.version, attempt, self.retries, last_error)
                time.sleep(self.poll_s * attempt)
            todo = [i for i, data in enumerate(shards) if data is None]
            workers = min(self.parallel_fetches, len(todo))
            if workers > 1:
                with ThreadPoolExecutor(workers, thread_name_prefix=f"refit-{self.replica_id}") as pool:
                    results = list(pool.map(lambda i: self._fetch_one(manifest, i), todo))
            else:
                results = [self._fetch_one(manifest, i) for i in todo]
            for i, got in zip(todo, results, strict=True):
                if isinstance(got, Exception):
                    last_error = got
                else:
                    shards[i] = got
            if all(s is not None for s in shards):
                try:
                    return assemble(manifest, shards, shards_verified=True)
                except CorruptShardError as exc:  # the manifest and bytes disagree: re-fetch everything
                    last_error = exc
                    shards = [None] * manifest.num_shards
        raise RefitFailedError(
            f"replica {self.replica_id!r} could not fetch weight version {manifest.version} intact after "
            f"{self.retries + 1} attempt(s); still serving version {self.engine.weight_version}. "
            f"Last error: {last_error}"
        ) from last_error

    def _fetch_one(self, manifest: Manifest, i: int):
        """Shard ``i`` fetched and verified, or the exception that stopped it (retried by the caller)."""
        try:
            data = self.source.fetch(manifest, i)
            if not getattr(self.source, "verifies_shards", False):  # a source that checks them itself
                verify_shard(i, data, manifest.shard_sizes[i], manifest.shard_checksums[i])
            return data
        except Exception as exc:  # any transport failure is retried the same way
            return exc

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
