"""The collective transport of refit shards: the trainer broadcasts each version to every replica at once.

Size (~790 lines): the trainer's broadcaster and the replica's source are the two halves of one epoch protocol
(membership, join, announce, broadcast, end) over one TCPStore layout; they are kept together so the protocol is
read, and changed, in one place.

Trainer side, :class:`CollectiveBroadcaster` runs a ``torch.distributed.TCPStore`` and, per *epoch*
(one fixed set of members), a process group of its own: ``ProcessGroupGloo`` on CPU or
``ProcessGroupNCCL`` on GPU, built directly on a ``PrefixStore`` — never ``init_process_group``, so
the trainer's default group stays free for its own data parallelism. :meth:`~CollectiveBroadcaster.offer`
hands the newest version to a background thread and returns at once: the trainer never waits on replicas.
Replica side, :class:`CollectiveShardSource` is a :class:`~.base.ShardSource` that receives every
broadcast into fresh buffers and serves ``fetch`` from them.

Coordination (Redis keys from :mod:`fp8rl.refit.keys`; ``P = fp8rl:{job}:``):

* membership — a replica adds itself to ``P collective:members`` and renews
  ``P collective:members:{id}`` (TTL ``member_ttl_s``) every ``heartbeat_s``; an expired or deleted
  entry means it left.
* ``P collective:epoch`` — strict JSON :class:`EpochSpec`: epoch number, the TCPStore ``host:port``,
  the ordered member ids (member k is rank k + 1; the trainer is rank 0), backend and timeouts.

Per epoch e, in the TCPStore under ``epoch{e}/`` (TCPStore keys, not Redis keys): each member sets
``hello/{rank}``; the trainer waits up to ``join_timeout_s`` for all of them and sets ``go`` to ``ok``
(everyone then builds the group) or ``abort`` (no-shows are dropped from membership and the trainer
re-forms at once with the rest). The n-th broadcast of the epoch is announced as ``v/{n}`` =
``{"version": v}`` before any collective starts — so a member enters a collective only when one is
coming (a gloo timeout closes the pairs for good: a speculative receive would break the group when a
training step runs long) — and ``v/{n}`` = ``{"end": true}`` ends the epoch. A member whose receive
failed sets ``broken``.

One broadcast of version v from rank 0: an int64 header ``[MAGIC, v, num_shards, total_bytes,
bucket_bytes]``, then the concatenated shard bytes in consecutive buckets of ``bucket_bytes`` (the
last one shorter): small shards share a bucket, a large one spans several. A replica needs only the
header to lay out its buffer — one contiguous ``uint8`` tensor per version; each bucket is received
straight into its slice of it (no copy on gloo) and ``fetch`` returns a writable ``memoryview`` of
shard i. A returned view stays valid after its version leaves the cache: an evicted version's buffer is
reused for a later broadcast only once nothing refers to it any more (every view ``fetch`` handed out,
and every tensor made from one, is gone — seen through a weak reference to the array all views are cut
from). Receiving into pages already touched runs at about 2.5× the speed of a fresh buffer here, whose
page faults cost more than gloo's loopback copy.

Membership changes: before each version, and every ``poll_s`` when idle, the trainer compares the live
members with its epoch's; a difference, or a broken epoch, starts a new epoch (ending the old one) and
re-sends the newest version to the new epoch when someone there does not hold it — so a joiner, and the
survivors of a failed broadcast, get the current version without waiting for the next training step.

Invariants: :meth:`CollectiveShardSource.fetch` returns exactly ``manifest.shard_sizes[i]`` bytes of a
broadcast whose header matched the manifest (version, shard count, total bytes) and whose every bucket
arrived, or raises :class:`CollectiveTransferError` — within ``fetch_timeout_s``, never later. Every wait
here is bounded (``join_timeout_s``, ``op_timeout_s``, ``fetch_timeout_s``); neither side ever blocks
forever on a dead peer. Checksums are not verified here: :class:`fp8rl.refit.RefitSubscriber` verifies
every shard and re-fetches (or falls back) on failure.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import redis
import torch
import torch.distributed as dist

from ..keys import validate_replica_id
from ..manifest import Manifest
from ..store import RefitStore
from .collective_group import (  # noqa: F401 - re-exported: EpochSpec, CollectiveTransferError, BACKENDS
    _LOOPBACK,
    _STORE_POLL_S,
    BACKENDS,
    CollectiveTransferError,
    EpochSpec,
    _await_key,
    _buckets,
    _gloo_device,
    _Group,
    _positive,
    _reject_constant,
    _split_endpoint,
    _td,
)

log = logging.getLogger(__name__)

__all__ = [
    "BACKENDS", "DEFAULT_BUCKET_BYTES", "MAGIC", "CollectiveBroadcaster", "CollectiveShardSource",
    "CollectiveTransferError", "EpochSpec",
]

MiB = 1024 * 1024
DEFAULT_BUCKET_BYTES = 512 * MiB
MAGIC = 0x46503852_4C434F4C  # "FP8RLCOL": the first header word of every broadcast
KEEP_VERSIONS = 2  # received versions a replica holds (the newest two)

# Atomically forget a member whose heartbeat key is gone (it may have re-registered in between).
_PRUNE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
return redis.call('SREM', KEYS[2], ARGV[1])
"""


@dataclass
class _Offer:
    manifest: Manifest
    shards: Sequence[Any]


@dataclass
class _Epoch:
    spec: EpochSpec
    store: Any  # PrefixStore over the broadcaster's TCPStore
    group: _Group
    seq: int = 0  # announcements made so far


class CollectiveBroadcaster:
    """Trainer side: broadcasts each offered version to the live members from a background thread.

    Args:
        store: the job's :class:`RefitStore` (membership and the epoch are read/written there).
        host: an address of this trainer that every replica can reach: the TCPStore is announced as
            ``host:port`` and gloo binds to it.
        port: the TCPStore port (0: a free one; see :attr:`endpoint`).
        backend: ``gloo`` (CPU tensors) or ``nccl`` (GPU).
        bucket_bytes: most bytes per broadcast bucket.
        join_timeout_s: how long forming an epoch may wait for its members.
        op_timeout_s: how long one collective may take before the epoch counts as broken.
        poll_s: how often the idle thread checks membership.
        no_show_backoff_s: a member that did not join is left out of new epochs for this long.
    """

    def __init__(self, store: RefitStore, *, host: str = "127.0.0.1", port: int = 0, backend: str = "gloo",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, join_timeout_s: float = 30.0,
                 op_timeout_s: float = 60.0, poll_s: float = 0.5, no_show_backoff_s: float = 30.0) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"collective backend must be one of {BACKENDS}, got {backend!r}")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be an int >= 1, got {bucket_bytes!r}")
        self.store, self.backend, self.bucket_bytes, self.host = store, backend, bucket_bytes, host
        self.join_timeout_s = _positive("join_timeout_s", join_timeout_s)
        self.op_timeout_s = _positive("op_timeout_s", op_timeout_s)
        self.poll_s = _positive("poll_s", poll_s)
        self.no_show_backoff_s = _positive("no_show_backoff_s", no_show_backoff_s)
        self._device = _Group.local_device(backend, host)  # fail here, not in the thread
        self._tcp = dist.TCPStore(host, port, None, True, _td(join_timeout_s), wait_for_workers=False)
        self.endpoint = f"{host}:{self._tcp.port}"
        self._prune = store.client.register_script(_PRUNE)
        prior = self._read_epoch()  # a restarted trainer continues the numbering
        self._next_epoch = 0 if prior is None else prior.epoch + 1
        self._epoch: _Epoch | None = None
        self._pending: _Offer | None = None
        self._newest_offered = -1
        self._last: _Offer | None = None
        self._delivered: tuple[int, frozenset[str]] = (-1, frozenset())  # (version, members that got it)
        self._no_show: dict[str, float] = {}  # member id -> monotonic time it may join again
        self._staging: torch.Tensor | None = None
        self._stats = {"versions": 0, "bytes": 0, "seconds": 0.0, "epochs": 0, "failures": 0,
                       "join_failures": 0, "superseded": 0, "last_version": None}
        self._cv = threading.Condition()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="collective-broadcaster", daemon=True)
        self._thread.start()

    # -- public ------------------------------------------------------------------------------
    def offer(self, manifest: Manifest, shards: Sequence[Any]) -> None:
        """Queue ``manifest.version`` for broadcast and return at once (a still-pending older one is dropped).

        The manifest must already be published in Redis (replicas fetch with it).

        Raises:
            ValueError: the shards do not match the manifest (count or a size, naming the shard), or the
                version is not newer than the last one offered.
            RuntimeError: the broadcaster is closed.
        """
        if len(shards) != manifest.num_shards:
            raise ValueError(f"weight version {manifest.version} has {manifest.num_shards} shard(s) in its "
                             f"manifest, {len(shards)} offered")
        for i, (s, size) in enumerate(zip(shards, manifest.shard_sizes, strict=True)):
            if memoryview(s).nbytes != size:
                raise ValueError(f"shard {i} of weight version {manifest.version} is {memoryview(s).nbytes} "
                                 f"bytes, its manifest says {size}")
        with self._cv:
            if self._stopping.is_set():
                raise RuntimeError("the collective broadcaster is closed")
            if manifest.version <= self._newest_offered:
                raise ValueError(f"cannot offer weight version {manifest.version}: version {self._newest_offered} "
                                 f"was offered already (versions only increase)")
            self._newest_offered = manifest.version
            if self._pending is not None:
                self._stats["superseded"] += 1
                log.info("collective: weight version %d superseded by %d before it was broadcast",
                         self._pending.manifest.version, manifest.version)
            self._pending = _Offer(manifest, list(shards))
            self._cv.notify_all()

    def stats(self) -> dict[str, Any]:
        """Counters: versions broadcast, bytes, seconds, epochs formed, failures, join_failures,
        superseded (dropped before broadcast), last_version, epoch (current number or None), members."""
        with self._cv:
            out = dict(self._stats)
        ep = self._epoch
        out["epoch"], out["members"] = (ep.spec.epoch, list(ep.spec.members)) if ep else (None, [])
        return out

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the thread (waiting at most ``timeout_s``, default join + op timeout), end the epoch,
        withdraw ``P collective:epoch`` if it is ours, and close the TCPStore."""
        with self._cv:
            self._stopping.set()
            self._cv.notify_all()
        limit = self.join_timeout_s + self.op_timeout_s + 5 if timeout_s is None else timeout_s
        self._thread.join(limit)
        if self._thread.is_alive():
            log.warning("collective broadcaster thread still busy after %.1f s; leaving it (daemon)", limit)
            return
        try:
            current = self._read_epoch()
            if current is not None and current.store == self.endpoint:
                self.store.client.delete(self.store.keys.collective_epoch())
        except Exception as exc:  # noqa: BLE001 - the next trainer overwrites it anyway
            log.warning("could not withdraw the collective epoch from Redis: %s", exc)
        self._tcp = None  # the server stops with its last reference

    # -- thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        errors = 0
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending is not None or self._stopping.is_set(), self.poll_s)
                if self._stopping.is_set():
                    break
                job, self._pending = self._pending, None
            try:
                self._deliver(job) if job is not None else self._tick()
                errors = 0
            except Exception as exc:  # noqa: BLE001 - the thread must survive Redis outages and our own bugs
                errors += 1
                if errors & (errors - 1) == 0:  # the 1st, 2nd, 4th, ... in a row: a long outage, a short log
                    log.warning("collective broadcaster (%d error(s) in a row): %s: %s", errors,
                                type(exc).__name__, exc)
        self._teardown()

    def _deliver(self, job: _Offer) -> None:
        self._last = job
        members = self._members()
        if self._needs_new_epoch(members) and not self._form(members):
            return
        if self._epoch is not None:
            self._broadcast(job)

    def _tick(self) -> None:
        """Idle: follow membership changes and broken epochs; re-send the newest version to who lacks it."""
        members = self._members()
        if not self._needs_new_epoch(members) or not self._form(members):
            return
        version, got = self._delivered
        if self._last is not None and self._epoch is not None and (
                version != self._last.manifest.version or not got.issuperset(self._epoch.spec.members)):
            self._broadcast(self._last)

    def _needs_new_epoch(self, members: list[str]) -> bool:
        ep = self._epoch
        if not members:
            if ep is not None:
                log.info("collective: no live members; ending epoch %d", ep.spec.epoch)
                self._teardown()
            return False
        if ep is None or list(ep.spec.members) != members:
            return True
        try:
            broken = ep.store.check(["broken"])
        except Exception:  # noqa: BLE001 - our own store failing: re-form
            broken = True
        if broken:
            log.warning("collective: a member reported epoch %d broken; re-forming", ep.spec.epoch)
        return broken

    def _members(self) -> list[str]:
        """The live members; with Redis away, the current epoch's (the group itself does not need Redis)."""
        try:
            return self._live_members()
        except redis.RedisError:
            if self._epoch is None:
                raise
            return list(self._epoch.spec.members)

    def _live_members(self) -> list[str]:
        """Sorted ids with a live heartbeat, less those in their no-show backoff; forgets expired ones."""
        k, r = self.store.keys, self.store.client
        ids = []
        for raw in r.smembers(k.collective_members()):
            rid = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
            try:
                ids.append(validate_replica_id(rid))
            except ValueError as exc:  # someone else's bad write must not stop every broadcast
                log.warning("collective: removing an invalid member from Redis: %s", exc)
                r.srem(k.collective_members(), raw)
        ids.sort()
        pipe = r.pipeline(transaction=False)
        for rid in ids:
            pipe.exists(k.collective_member(rid))
        now, live = time.monotonic(), []
        for rid, alive in zip(ids, pipe.execute(), strict=True):
            if not alive:
                self._prune(keys=[k.collective_member(rid), k.collective_members()], args=[rid])
            elif self._no_show.get(rid, 0.0) <= now:
                self._no_show.pop(rid, None)
                live.append(rid)
        return live

    def _form(self, members: list[str]) -> bool:
        """Form a new epoch of ``members``; members that do not show up are dropped and the rest retried."""
        while members and not self._stopping.is_set():
            ok, missing = self._try_form(members)
            if ok:
                return True
            if not missing:  # everyone said hello but the group could not be built: next version/tick
                return False
            members = [m for m in members if m not in missing]
        return False

    def _try_form(self, members: list[str]) -> tuple[bool, list[str]]:
        self._teardown()
        e = self._next_epoch
        self._next_epoch += 1
        spec = EpochSpec(e, self.endpoint, tuple(members), self.backend, self.join_timeout_s, self.op_timeout_s)
        self.store.client.set(self.store.keys.collective_epoch(), spec.to_json_bytes())
        prefix = dist.PrefixStore(f"epoch{e}/", self._tcp)
        deadline = time.monotonic() + self.join_timeout_s
        next_liveness = time.monotonic() + 0.5
        while True:
            missing = [m for r, m in enumerate(members, 1) if not prefix.check([f"hello/{r}"])]
            if not missing or time.monotonic() >= deadline or self._stopping.wait(_STORE_POLL_S):
                break
            if time.monotonic() >= next_liveness:  # a missing member whose heartbeat ran out will never come
                next_liveness = time.monotonic() + 0.5
                k, pipe = self.store.keys, self.store.client.pipeline(transaction=False)
                for m in missing:
                    pipe.exists(k.collective_member(m))
                if not all(pipe.execute()):
                    break
        if missing:
            prefix.set("go", "abort")
            self._drop(missing)
            with self._cv:
                self._stats["join_failures"] += 1
            log.warning("collective epoch %d: member(s) %s did not join (waited %.1f s of %.1f); dropped them, "
                        "re-forming with %s", e, missing, self.join_timeout_s - (deadline - time.monotonic()),
                        self.join_timeout_s, [m for m in members if m not in missing])
            return False, missing
        prefix.set("go", "ok")
        try:
            group = _Group(self.backend, prefix, 0, len(members) + 1, join_timeout_s=self.join_timeout_s,
                           op_timeout_s=self.op_timeout_s, device=self._device)
        except Exception as exc:  # noqa: BLE001 - a member died between hello and the rendezvous
            failed = [m for r, m in enumerate(members, 1) if prefix.check([f"nojoin/{r}"])]
            if failed:
                self._drop(failed)
            with self._cv:
                self._stats["join_failures"] += 1
            log.warning("collective epoch %d: building the %s group of %s failed: %s%s", e, self.backend, members,
                        exc, f" (could not build it: {failed}, dropped)" if failed else "")
            return False, failed
        self._epoch = _Epoch(spec, prefix, group)
        with self._cv:
            self._stats["epochs"] += 1
        log.info("collective epoch %d formed: %s over %s, members %s", e, self.backend, self.endpoint, members)
        return True, []

    def _drop(self, ids: list[str]) -> None:
        k = self.store.keys
        until = time.monotonic() + self.no_show_backoff_s
        pipe = self.store.client.pipeline(transaction=False)
        for rid in ids:
            self._no_show[rid] = until
            pipe.delete(k.collective_member(rid))
            pipe.srem(k.collective_members(), rid)
        pipe.execute()

    def _teardown(self) -> None:
        """End the current epoch: announce its end (members waiting leave) and close the group."""
        ep, self._epoch = self._epoch, None
        if ep is None:
            return
        try:
            ep.store.set(f"v/{ep.seq}", b'{"end":true}')
        except Exception as exc:  # noqa: BLE001 - members also notice the closed group or a new epoch
            log.debug("collective epoch %d: announcing its end failed: %s", ep.spec.epoch, exc)
        ep.group.close()

    def _broadcast(self, job: _Offer) -> None:
        ep, m = self._epoch, job.manifest
        assert ep is not None
        t0 = time.perf_counter()
        try:
            ep.store.set(f"v/{ep.seq}", json.dumps({"version": m.version}).encode())
            ep.seq += 1
            ep.group.send(torch.tensor([MAGIC, m.version, m.num_shards, m.total_bytes, self.bucket_bytes],
                                       dtype=torch.int64))
            starts = list(accumulate(m.shard_sizes, initial=0))
            for off, size in _buckets(m.total_bytes, self.bucket_bytes):
                ep.group.send(self._bucket(job.shards, starts, off, size))
        except Exception as exc:  # noqa: BLE001 - a member died or timed out: this epoch is done
            with self._cv:
                self._stats["failures"] += 1
            self._delivered = (m.version, frozenset())
            log.warning("collective broadcast of weight version %d to epoch %d (members %s) failed after %.2f s: "
                        "%s; re-forming with the live members", m.version, ep.spec.epoch, list(ep.spec.members),
                        time.perf_counter() - t0, exc)
            self._teardown()  # closing our connections now ends the members' pending receives
            return
        dt = time.perf_counter() - t0
        self._delivered = (m.version, frozenset(ep.spec.members))
        with self._cv:
            s = self._stats
            s["versions"] += 1
            s["bytes"] += m.total_bytes
            s["seconds"] += dt
            s["last_version"] = m.version
        log.info("collective: broadcast weight version %d (%.1f MiB) to %d member(s) in %.3f s", m.version,
                 m.total_bytes / MiB, len(ep.spec.members), dt)

    def _bucket(self, shards: Sequence[Any], starts: list[int], off: int, size: int) -> torch.Tensor:
        """The bucket ``[off, off + size)`` of the concatenated shards as a uint8 tensor: a view when it lies
        in one writable shard, else a copy into a staging buffer reused across buckets."""
        i = bisect.bisect_right(starts, off) - 1  # the shard holding byte `off` (never an empty one)
        src = memoryview(shards[i]).cast("B")
        local = off - starts[i]
        if local + size <= len(src) and not src.readonly:
            return torch.frombuffer(src, dtype=torch.uint8, count=size, offset=local)
        if self._staging is None or self._staging.numel() < size:
            self._staging = torch.empty(size, dtype=torch.uint8)
        dst = memoryview(self._staging.numpy()).cast("B")
        done = 0
        while done < size:
            src = memoryview(shards[i]).cast("B")
            local = off + done - starts[i]
            n = min(size - done, len(src) - local)  # 0 for an empty shard
            dst[done:done + n] = src[local:local + n]
            done += n
            i += 1
        return self._staging[:size]

    def _read_epoch(self) -> EpochSpec | None:
        raw = self.store.client.get(self.store.keys.collective_epoch())
        return None if raw is None else _parse_epoch(raw, "the collective broadcaster")


def _parse_epoch(raw: bytes, who: str) -> EpochSpec | None:
    """The epoch in ``raw``, or None (logged) when it is malformed: a bad write must not stop a receiver."""
    try:
        return EpochSpec.from_json_bytes(raw)
    except ValueError as exc:
        log.warning("%s: ignoring a malformed collective epoch in Redis (%r): %s", who, raw[:80], exc)
        return None


@dataclass
class _Received:
    version: int
    num_shards: int
    total_bytes: int
    buffer: torch.Tensor  # (total_bytes,) uint8; reused only after every view of it is gone
    view: memoryview  # of ``buffer.numpy()``: every view fetch returns is cut from it


SPARE_BUFFERS = 1  # evicted receive buffers a replica keeps for reuse (each is a whole version)


class _BufferPool:
    """Evicted receive buffers, each handed out again only when nothing refers to its array any more."""

    def __init__(self, keep: int = SPARE_BUFFERS) -> None:
        self.keep, self.reused = keep, 0  # reused: buffers handed out again
        self._spare: list[tuple[torch.Tensor, weakref.ref]] = []  # newest last

    def retire(self, buffer: torch.Tensor, view: memoryview | None) -> None:
        """Offer ``buffer`` for reuse; ``view`` is the memoryview every handed-out view was cut from (None:
        no view was ever handed out)."""
        ref = weakref.ref(view.obj) if view is not None else (lambda: None)
        self._spare.append((buffer, ref))
        del self._spare[:-self.keep]

    def take(self, nbytes: int) -> torch.Tensor:
        """A (nbytes,) uint8 buffer: a spare of that size nothing refers to, else a fresh one."""
        for i, (buf, ref) in enumerate(self._spare):
            if buf.numel() == nbytes and ref() is None:
                del self._spare[i]
                self.reused += 1
                return buf
        return torch.empty(nbytes, dtype=torch.uint8)


class CollectiveShardSource:
    """Replica side: a :class:`~.base.ShardSource` serving the versions the trainer broadcast to it.

    Construction registers the replica as a member and starts a heartbeat thread and a receiver thread
    (which joins every epoch that lists this replica and receives its broadcasts); :meth:`close` leaves.

    Args:
        store: the job's :class:`RefitStore`.
        replica_id: this replica's id (its membership entry; its rank comes from the epoch).
        fetch_timeout_s: how long :meth:`fetch` waits for a version to arrive.
        heartbeat_s: how often the membership entry is renewed.
        member_ttl_s: how long the entry lives unrenewed (default ``max(3 s, 3 * heartbeat_s)``).
        host: the address gloo binds on this replica (None: 127.0.0.1 when the trainer's store is on
            loopback, else gloo's default interface — ``GLOO_SOCKET_IFNAME`` or the hostname).
        poll_s: how often the receiver reads ``P collective:epoch`` while in no epoch.
    """

    def __init__(self, store: RefitStore, replica_id: str, *, fetch_timeout_s: float = 30.0,
                 heartbeat_s: float = 1.0, member_ttl_s: float | None = None, host: str | None = None,
                 poll_s: float = 0.1) -> None:
        self.store, self.replica_id, self.host = store, validate_replica_id(replica_id), host
        self.fetch_timeout_s = _positive("fetch_timeout_s", fetch_timeout_s)
        self.heartbeat_s = _positive("heartbeat_s", heartbeat_s)
        self.member_ttl_s = _positive("member_ttl_s", max(3.0, 3 * heartbeat_s) if member_ttl_s is None
                                      else member_ttl_s)
        if self.member_ttl_s <= self.heartbeat_s:
            raise ValueError(f"member_ttl_s ({self.member_ttl_s}) must exceed heartbeat_s ({self.heartbeat_s})")
        self.poll_s = _positive("poll_s", poll_s)
        self._cv = threading.Condition()
        self._stopping = threading.Event()
        self._closed = False
        self._cache: dict[int, _Received] = {}
        self._pool = _BufferPool()  # touched only by the receiver thread
        self._failed: dict[int, str] = {}  # version -> why its broadcast failed here
        self._epoch: int | None = None  # the epoch joined now, and its store's endpoint
        self._epoch_store: str | None = None
        self._stats = {"versions": 0, "bytes": 0, "seconds": 0.0, "epochs": 0, "failures": 0,
                       "malformed_epochs": 0}
        self._register()  # synchronous: once constructed, the trainer can see this member
        self._threads = [threading.Thread(target=self._heartbeat, name=f"collective-hb-{replica_id}", daemon=True),
                         threading.Thread(target=self._receive_loop, name=f"collective-rx-{replica_id}",
                                          daemon=True)]
        for t in self._threads:
            t.start()

    # -- public ------------------------------------------------------------------------------
    def fetch(self, manifest: Manifest, shard_index: int) -> memoryview:
        """Shard ``shard_index`` of ``manifest.version`` as received (a writable view, exactly its size).

        Waits up to ``fetch_timeout_s`` for the version; raises sooner when its broadcast failed here or
        a newer version arrived instead (the trainer only broadcasts its newest).

        Raises:
            CollectiveTransferError: not received in time, failed, superseded, closed, or the received
                header disagrees with the manifest.
        """
        v = manifest.version
        if not 0 <= shard_index < manifest.num_shards:
            raise CollectiveTransferError(f"weight version {v} has {manifest.num_shards} shard(s), asked for "
                                          f"shard {shard_index}")
        deadline = time.monotonic() + self.fetch_timeout_s
        with self._cv:
            while (rec := self._cache.get(v)) is None:
                if self._closed:
                    raise CollectiveTransferError(f"replica {self.replica_id!r}: the collective source is closed")
                if v in self._failed:
                    raise CollectiveTransferError(f"replica {self.replica_id!r}: the broadcast of weight version "
                                                  f"{v} failed here: {self._failed[v]}")
                newer = [u for u in self._cache if u > v]
                if newer:  # the trainer only broadcasts its newest: v will not come (or was evicted)
                    raise CollectiveTransferError(f"replica {self.replica_id!r}: weight version {v} is not held "
                                                  f"here (held: {sorted(self._cache)}); newer version "
                                                  f"{max(newer)} arrived")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveTransferError(
                        f"replica {self.replica_id!r}: weight version {v} did not arrive by collective broadcast "
                        f"within {self.fetch_timeout_s} s (held: {sorted(self._cache)}, epoch: {self._epoch})")
                self._cv.wait(left)
        if (rec.num_shards, rec.total_bytes) != (manifest.num_shards, manifest.total_bytes):
            raise CollectiveTransferError(
                f"replica {self.replica_id!r}: weight version {v} arrived as {rec.num_shards} shard(s), "
                f"{rec.total_bytes} bytes, but its manifest says {manifest.num_shards} shard(s), "
                f"{manifest.total_bytes} bytes")
        start = sum(manifest.shard_sizes[:shard_index])
        return rec.view[start:start + manifest.shard_sizes[shard_index]]

    def available(self, manifest: Manifest) -> bool:
        """Whether :meth:`fetch` can be expected to serve ``manifest``: the version is held here, or this replica
        is in an epoch of the group the manifest names (``manifest.collective``, where the manifest has that
        field; "" means the trainer broadcasts nothing) and that version's broadcast has not failed here."""
        with self._cv:
            v = manifest.version
            if v in self._cache:
                return True
            named = getattr(manifest, "collective", None)
            return (v not in self._failed and self._epoch_store is not None and named != ""
                    and (named is None or named == self._epoch_store))

    def versions(self) -> list[int]:
        """Versions held, oldest first."""
        with self._cv:
            return sorted(self._cache)

    def stats(self) -> dict[str, Any]:
        """Counters: versions received, bytes, seconds, epochs joined, failures, malformed_epochs,
        reused_buffers (broadcasts received into an evicted version's buffer); epoch."""
        with self._cv:
            return {**self._stats, "reused_buffers": self._pool.reused, "epoch": self._epoch}

    def close(self, timeout_s: float = 10.0) -> None:
        """Leave membership (the trainer re-forms without us), stop the threads (waiting at most
        ``timeout_s``: a receive in flight ends within the epoch's op timeout), fail pending fetches."""
        self._stopping.set()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        deadline = time.monotonic() + timeout_s
        self._threads[0].join(max(0.0, deadline - time.monotonic()))  # no heartbeat may re-add us after we leave
        k = self.store.keys
        try:
            self.store.client.pipeline(transaction=False).delete(k.collective_member(self.replica_id)) \
                .srem(k.collective_members(), self.replica_id).execute()
        except Exception as exc:  # noqa: BLE001 - the entry expires on its own
            log.warning("replica %s could not leave the collective membership: %s", self.replica_id, exc)
        self._threads[1].join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            log.warning("replica %s: a collective thread is still busy after %.1f s (daemon; it ends on its own)",
                        self.replica_id, timeout_s)

    # -- membership --------------------------------------------------------------------------
    def _register(self) -> None:
        k = self.store.keys
        entry = json.dumps({"pid": os.getpid(), "ttl_ms": int(self.member_ttl_s * 1000)}).encode()
        self.store.client.pipeline(transaction=False).set(
            k.collective_member(self.replica_id), entry, px=int(self.member_ttl_s * 1000)
        ).sadd(k.collective_members(), self.replica_id).execute()

    def _heartbeat(self) -> None:
        failing = 0
        while not self._stopping.wait(self.heartbeat_s):
            try:
                self._register()
                failing = 0
            except Exception as exc:  # noqa: BLE001 - Redis away: keep trying
                failing += 1
                if failing & (failing - 1) == 0:  # 1st, 2nd, 4th, ... failure
                    log.warning("replica %s: collective heartbeat failed (%d in a row): %s", self.replica_id,
                                failing, exc)

    # -- receiving ---------------------------------------------------------------------------
    def _receive_loop(self) -> None:
        seen_raw: bytes | None = None
        spec: EpochSpec | None = None
        done: tuple[int, str] | None = None  # the last epoch joined (never rejoined)
        errors = 0
        while not self._stopping.is_set():
            try:
                raw = self.store.client.get(self.store.keys.collective_epoch())
                if raw != seen_raw:
                    seen_raw = raw
                    spec = None if raw is None else _parse_epoch(raw, f"replica {self.replica_id}")
                    if raw is not None and spec is None:
                        with self._cv:
                            self._stats["malformed_epochs"] += 1
                errors = 0
                if spec is not None and self.replica_id in spec.members and spec.key != done:
                    done = spec.key
                    self._serve_epoch(spec)
                    continue
            except Exception as exc:  # noqa: BLE001 - Redis away, a dead trainer store: wait for the next epoch
                errors += 1
                if errors & (errors - 1) == 0:  # the 1st, 2nd, 4th, ... in a row
                    log.warning("replica %s: collective receiver (%d error(s) in a row): %s: %s", self.replica_id,
                                errors, type(exc).__name__, exc)
            finally:
                with self._cv:
                    self._epoch = self._epoch_store = None
            self._stopping.wait(self.poll_s)

    def _serve_epoch(self, spec: EpochSpec) -> None:
        """Join ``spec`` and receive its broadcasts until it ends, breaks, or we stop."""
        rank, world = spec.members.index(self.replica_id) + 1, len(spec.members) + 1
        host, port = _split_endpoint(spec.store)
        tcp = dist.TCPStore(host, port, None, False, _td(spec.join_timeout_s))
        prefix = dist.PrefixStore(f"epoch{spec.epoch}/", tcp)
        prefix.set(f"hello/{rank}", self.replica_id)
        go = _await_key(prefix, "go", spec.join_timeout_s, self._stopping)
        if go != b"ok":
            log.info("replica %s: collective epoch %d was not formed (%s)", self.replica_id, spec.epoch,
                     "aborted by the trainer" if go else "no go in time")
            return
        bind = self.host if self.host is not None else ("127.0.0.1" if host.startswith(_LOOPBACK) else None)
        try:
            device = _Group.local_device(spec.backend, bind)
        except Exception as exc:  # our own fault (no GPU, no such interface): the trainer drops us for a while
            prefix.set(f"nojoin/{rank}", f"{type(exc).__name__}: {exc}"[:500])
            raise
        group = _Group(spec.backend, prefix, rank, world, join_timeout_s=spec.join_timeout_s,
                       op_timeout_s=spec.op_timeout_s, device=device)
        with self._cv:
            self._epoch, self._epoch_store = spec.epoch, spec.store
            self._stats["epochs"] += 1
        log.info("replica %s joined collective epoch %d as rank %d of %d", self.replica_id, spec.epoch, rank, world)
        try:
            n = 0
            while not self._stopping.is_set():
                ann = self._await_announcement(prefix, f"v/{n}", spec)
                if ann is None or ann.get("end"):
                    return
                n += 1
                if not self._receive_version(group, spec, ann.get("version")):
                    try:
                        prefix.set("broken", self.replica_id)
                    except Exception:  # noqa: BLE001 - the trainer's own broadcast fails then
                        pass
                    return
        finally:
            group.close()

    def _await_announcement(self, prefix, key: str, spec: EpochSpec) -> dict | None:
        """The next announcement of this epoch, or None when Redis names another epoch or we stop."""
        next_redis_check, seen = time.monotonic() + self.poll_s * 10, spec.to_json_bytes()
        while not self._stopping.is_set():
            if prefix.check([key]):
                ann = json.loads(prefix.get(key))
                return ann if isinstance(ann, dict) else None
            if time.monotonic() >= next_redis_check:  # a trainer that moved on without ending this epoch
                next_redis_check = time.monotonic() + self.poll_s * 10
                try:
                    raw = self.store.client.get(self.store.keys.collective_epoch())
                except redis.RedisError as exc:  # Redis away: the group itself does not need it; stay
                    log.debug("replica %s: cannot read the collective epoch: %s", self.replica_id, exc)
                    raw = seen
                if raw is None:
                    return None
                if raw != seen:  # parsed (and a malformed one logged) once per value
                    seen, current = raw, _parse_epoch(raw, f"replica {self.replica_id}")
                    if current is not None and current.key != spec.key:
                        return None
            self._stopping.wait(_STORE_POLL_S)
        return None

    def _receive_version(self, group: _Group, spec: EpochSpec, version: object) -> bool:
        """Receive one announced broadcast into a fresh buffer; False when it failed (leave the epoch)."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            log.warning("replica %s: collective epoch %d announced a bad version %r; leaving it", self.replica_id,
                        spec.epoch, version)
            return False
        t0 = time.perf_counter()
        buffer = None
        try:
            header = torch.zeros(5, dtype=torch.int64)
            group.recv_into(header)
            magic, v, num_shards, total, bucket = header.tolist()
            if magic != MAGIC or v != version or num_shards < 1 or total < 0 or bucket < 1:
                raise CollectiveTransferError(f"bad broadcast header {header.tolist()} for announced version "
                                              f"{version}")
            buffer = self._pool.take(total)  # (total,) the shards back to back
            for off, size in _buckets(total, bucket):
                group.recv_into(buffer[off:off + size])  # straight into place: no copy on gloo
        except Exception as exc:  # noqa: BLE001 - a dead peer, a timeout, a bad header
            if buffer is not None:
                self._pool.retire(buffer, None)  # half-written, never handed out
            with self._cv:
                self._failed[version] = f"epoch {spec.epoch}: {exc}"
                for old in sorted(self._failed)[:-8]:
                    del self._failed[old]
                self._stats["failures"] += 1
                self._cv.notify_all()
            log.warning("replica %s: receiving weight version %d in collective epoch %d failed after %.2f s: %s",
                        self.replica_id, version, spec.epoch, time.perf_counter() - t0, exc)
            return False
        dt = time.perf_counter() - t0
        rec = _Received(v, num_shards, total, buffer, memoryview(buffer.numpy()).cast("B"))
        with self._cv:
            self._cache[v] = rec
            evicted = [self._cache.pop(old) for old in sorted(self._cache)[:-KEEP_VERSIONS]]
            self._failed.pop(v, None)
            s = self._stats
            s["versions"] += 1
            s["bytes"] += total
            s["seconds"] += dt
            self._cv.notify_all()
        while evicted:  # this frame keeps no reference to an evicted version once it is retired
            gone = evicted.pop()
            self._pool.retire(gone.buffer, gone.view)
            del gone
        log.info("replica %s received weight version %d (%.1f MiB) in %.3f s", self.replica_id, v, total / MiB, dt)
        return True
