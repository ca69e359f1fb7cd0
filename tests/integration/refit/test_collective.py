"""The collective refit transport against a real redis-server, real replica processes and gloo on loopback.

Replicas run in spawned processes (one torch thread each) driven over a Pipe: they fetch every shard of a
version through :class:`CollectiveShardSource` (or apply it through a real :class:`RefitSubscriber`) and
send back sha256 digests, which must equal the publisher's bytes exactly. Every wait has a deadline and
every child is killed when its test ends.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator, Mapping

import pytest
import torch

from fp8rl.refit import RefitPublisher, RefitStore, RefitSubscriber, build_shards, connect
from fp8rl.refit.shards import verify_shard
from fp8rl.refit.transport.collective import (
    CollectiveBroadcaster,
    CollectiveShardSource,
    CollectiveTransferError,
    EpochSpec,
)

pytestmark = [pytest.mark.integration, pytest.mark.collective]  # make test-collective; SIGKILLs: chaos

SHARD_BYTES = 64_000
BUCKET_BYTES = 50_000  # smaller than most shards (a shard spans buckets), not a divisor (a bucket spans shards)
TIMEOUTS = {"join_timeout_s": 5.0, "op_timeout_s": 5.0}
REPLY_S = 30.0  # the most any child reply may take


def state(version: int) -> dict[str, torch.Tensor]:
    """~300 KB of BF16/FP32 tensors of uneven sizes (so shards and buckets do not line up)."""
    g = torch.Generator().manual_seed(version)
    sd = {f"model.layers.{i}.weight": torch.randn(96, 96 + 40 * i, generator=g).to(torch.bfloat16) for i in range(5)}
    sd["model.norm.weight"] = torch.full((333,), float(version))
    return sd


def sha(data) -> str:
    return hashlib.sha256(data).hexdigest()


def tensor_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# -- the replica process ----------------------------------------------------------------------------
class _Target:
    """The least a RefitSubscriber needs: a version and an all-or-nothing load."""

    def __init__(self) -> None:
        self.weight_version, self.tensors = None, {}

    def load_weights(self, version, tensors, qkv_scales=None) -> None:
        self.tensors, self.weight_version = {k: v.clone() for k, v in tensors.items()}, version


def _fetch_all(store: RefitStore, source: CollectiveShardSource, version: int, deadline_s: float) -> list[str]:
    """Every shard of ``version``, verified against its manifest; retried (as the subscriber does) until the
    deadline, since a version whose broadcast failed may arrive again in the next epoch."""
    manifest = store.get_manifest(version)
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            digests = []
            for i in range(manifest.num_shards):
                data = source.fetch(manifest, i)
                verify_shard(i, data, manifest.shard_sizes[i], manifest.shard_checksums[i])
                digests.append(sha(data))
            return digests
        except CollectiveTransferError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)


def _replica_main(redis_url: str, job: str, replica_id: str, conn) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format=f"[{replica_id}] %(levelname)s %(name)s: %(message)s")
    store = RefitStore(connect(redis_url), job)
    source = CollectiveShardSource(store, replica_id, fetch_timeout_s=3.0, heartbeat_s=0.3, member_ttl_s=1.5,
                                   poll_s=0.05)
    conn.send(("ready", replica_id))
    held: list[memoryview] = []  # views kept by "hold", as an engine keeps a payload it has not applied yet
    while conn.poll(120):  # the parent went away: stop
        cmd, *args = conn.recv()
        try:
            if cmd == "fetch":
                conn.send(("ok", _fetch_all(store, source, *args)))
            elif cmd == "sync":  # through the real subscriber: assemble() over the received buffers
                store.register_replica(replica_id, "", None, ttl_s=60)
                target = _Target()
                RefitSubscriber(store, target, source, replica_id, requires_scales=False, retries=5,
                                poll_s=0.2).sync_to(args[0])
                conn.send(("ok", tensor_digest(target.tensors)))
            elif cmd == "hold":  # fetch a version and keep its views
                manifest = store.get_manifest(args[0])
                held = [source.fetch(manifest, i) for i in range(manifest.num_shards)]
                conn.send(("ok", [sha(h) for h in held]))
            elif cmd == "held":  # the digests of the kept views now
                conn.send(("ok", [sha(h) for h in held]))
            elif cmd == "stats":
                conn.send(("ok", json.dumps(source.stats())))
            elif cmd == "close":
                source.close()
                conn.send(("ok", "closed"))
                return
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            conn.send(("err", f"{type(exc).__name__}: {exc}"))


def _trainer_main(redis_url: str, job: str, conn) -> None:
    torch.set_num_threads(1)
    store = RefitStore(connect(redis_url), job)
    publisher = RefitPublisher(store, shard_bytes=SHARD_BYTES)
    bc = CollectiveBroadcaster(store, bucket_bytes=BUCKET_BYTES, poll_s=0.2, **TIMEOUTS)
    publish(publisher, bc, 1)
    conn.send(("ok", bc.endpoint))
    conn.poll(120)  # until killed


class Replica:
    """A replica process and its end of the Pipe."""

    def __init__(self, ctx, redis_url: str, job: str, replica_id: str) -> None:
        self.id = replica_id
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_replica_main, args=(redis_url, job, replica_id, child), daemon=True)
        self.proc.start()
        child.close()
        assert self.reply(60.0) == ("ready", replica_id), f"replica {replica_id} did not start"

    def reply(self, timeout_s: float = REPLY_S):
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"replica {self.id} sent nothing within {timeout_s} s")
        return self.conn.recv()

    def ask(self, *cmd, timeout_s: float = REPLY_S):
        self.conn.send(cmd)
        status, value = self.reply(timeout_s)
        assert status == "ok", f"replica {self.id}: {cmd[0]} failed: {value}"
        return value

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)


@pytest.fixture
def store(redis_url: str, job_id: str) -> RefitStore:
    return RefitStore(connect(redis_url), job_id)


@pytest.fixture
def publisher(store: RefitStore) -> RefitPublisher:
    return RefitPublisher(store, shard_bytes=SHARD_BYTES, keep=3)


@pytest.fixture
def broadcaster(store: RefitStore) -> Iterator[CollectiveBroadcaster]:
    bc = CollectiveBroadcaster(store, bucket_bytes=BUCKET_BYTES, poll_s=0.2, no_show_backoff_s=5.0, **TIMEOUTS)
    try:
        yield bc
    finally:
        bc.close(timeout_s=15)


@pytest.fixture
def replicas(redis_url: str, job_id: str) -> Iterator:
    """``start(id)`` → a running :class:`Replica`; all are closed (or killed) when the test ends."""
    ctx, started = mp.get_context("spawn"), []

    def start(replica_id: str) -> Replica:
        started.append(Replica(ctx, redis_url, job_id, replica_id))
        return started[-1]

    try:
        yield start
    finally:
        for r in started:
            if r.proc.is_alive():
                try:
                    r.conn.send(("close",))
                    r.reply(15.0)
                except Exception:  # noqa: BLE001 - killed below
                    pass
            r.kill()


def publish(publisher: RefitPublisher, broadcaster: CollectiveBroadcaster, version: int) -> list[str]:
    """Publish ``version`` (manifest in Redis first), offer it, return the sha256 of each shard."""
    manifest = publisher.publish(state(version), version, recipe="bf16")
    broadcaster.offer(manifest, publisher.shards(version))
    return [sha(s) for s in publisher.shards(version)]


def bucket_layout(sizes: tuple[int, ...], bucket: int) -> tuple[bool, bool]:
    """(a bucket spans two shards, a shard spans two buckets) for the payload's layout."""
    starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    cuts = range(bucket, starts[-1], bucket)
    return (any(any(b < s < b + bucket for s in starts) for b in range(0, starts[-1], bucket)),
            any(any(a < c < b for c in cuts) for a, b in zip(starts[:-1], starts[1:], strict=True)))


def wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.05)


# -- the tests --------------------------------------------------------------------------------------
def test_two_replicas_get_every_version_byte_for_byte(store, publisher, broadcaster, replicas):
    a, b = replicas("r-a"), replicas("r-b")
    for v in (1, 2):
        want = publish(publisher, broadcaster, v)
        sizes = store.get_manifest(v).shard_sizes
        assert len(sizes) >= 4 and bucket_layout(sizes, BUCKET_BYTES) == (True, True)
        for r in (a, b):
            assert r.ask("fetch", v, 20.0) == want, f"replica {r.id}, version {v}"
    want_tensors = tensor_digest(state(2))  # bf16 recipe: the tensors travel unchanged
    for r in (a, b):
        assert r.ask("sync", 2) == want_tensors
    s = broadcaster.stats()
    assert s["versions"] >= 2 and s["failures"] == 0 and s["members"] == ["r-a", "r-b"]
    assert s["bytes"] >= store.get_manifest(1).total_bytes + store.get_manifest(2).total_bytes


def test_received_buffers_are_reused_only_when_no_view_of_them_is_left(store, publisher, broadcaster, replicas):
    """A replica keeps the views of v1 while v2..v5 arrive: v1 is evicted at v3 and its buffer must not be
    written while those views live; v2's buffer (its views dropped) is reused, so reuse does happen."""
    a = replicas("r-a")
    want1 = publish(publisher, broadcaster, 1)
    assert a.ask("hold", 1) == want1
    for v in range(2, 6):
        want = publish(publisher, broadcaster, v)
        assert a.ask("fetch", v, 20.0) == want, f"version {v}"
    assert a.ask("held") == want1, "a view of an evicted version changed: its buffer was reused while held"
    s = json.loads(a.ask("stats"))
    assert s["versions"] >= 5 and s["failures"] == 0
    assert s["reused_buffers"] >= 1, s


def test_a_late_replica_joins_and_gets_the_next_version(store, publisher, broadcaster, replicas):
    a, b = replicas("r-a"), replicas("r-b")
    want = publish(publisher, broadcaster, 1)
    assert a.ask("fetch", 1, 20.0) == want and b.ask("fetch", 1, 20.0) == want
    c = replicas("r-c")
    # its registration re-forms the group: the newest version is re-sent to it without a new offer
    assert c.ask("fetch", 1, 20.0) == [sha(s) for s in publisher.shards(1)]
    want = publish(publisher, broadcaster, 2)
    for r in (a, b, c):
        assert r.ask("fetch", 2, 20.0) == want, f"replica {r.id}"
    s = broadcaster.stats()
    assert s["members"] == ["r-a", "r-b", "r-c"] and s["epochs"] >= 2 and s["failures"] == 0
    assert json.loads(a.ask("stats"))["epochs"] >= 2  # the old members moved to the new epoch
    assert c.ask("close") == "closed"  # a clean leave: the group re-forms without it, nothing fails
    want = publish(publisher, broadcaster, 3)
    for r in (a, b):
        assert r.ask("fetch", 3, 20.0) == want, f"replica {r.id}"
    s = broadcaster.stats()
    assert s["members"] == ["r-a", "r-b"] and s["failures"] == 0 and s["join_failures"] == 0


@pytest.mark.chaos  # SIGKILLs a process: the chaos tier (make test-chaos)
def test_a_killed_replica_is_dropped_and_the_survivor_keeps_receiving(store, publisher, broadcaster, replicas):
    a, b = replicas("r-a"), replicas("r-b")
    want = publish(publisher, broadcaster, 1)
    assert a.ask("fetch", 1, 20.0) == want and b.ask("fetch", 1, 20.0) == want
    epochs = broadcaster.stats()["epochs"]
    b.kill()
    t0 = time.monotonic()
    want = publish(publisher, broadcaster, 2)  # fails on the dead member, then re-sent to the new epoch
    bound = 2 * (TIMEOUTS["join_timeout_s"] + TIMEOUTS["op_timeout_s"])
    assert a.ask("fetch", 2, bound) == want
    assert time.monotonic() - t0 < bound
    want = publish(publisher, broadcaster, 3)
    assert a.ask("fetch", 3, 10.0) == want
    s = broadcaster.stats()
    assert s["members"] == ["r-a"] and s["epochs"] > epochs
    assert s["failures"] + s["join_failures"] >= 1
    assert store.client.sismember(store.keys.collective_members(), "r-b") == 0


@pytest.mark.chaos  # SIGKILLs a process: the chaos tier (make test-chaos)
def test_a_restarted_trainer_re_forms_the_group(redis_url, store, publisher):
    source = CollectiveShardSource(store, "r-local", fetch_timeout_s=20.0, heartbeat_s=0.3, poll_s=0.05)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    trainer = ctx.Process(target=_trainer_main, args=(redis_url, store.job, child), daemon=True)
    trainer.start()
    bc = None
    try:
        assert conn.poll(60) and conn.recv()[0] == "ok"
        manifest = store.get_manifest(1)
        data = [bytes(source.fetch(manifest, i)) for i in range(manifest.num_shards)]
        os.kill(trainer.pid, signal.SIGKILL)  # dies holding the epoch: its store and group vanish
        trainer.join(10)
        t0 = time.monotonic()
        bc = CollectiveBroadcaster(store, bucket_bytes=BUCKET_BYTES, poll_s=0.2, **TIMEOUTS)
        want = publish(publisher, bc, 2)
        manifest = store.get_manifest(2)
        assert [sha(source.fetch(manifest, i)) for i in range(manifest.num_shards)] == want
        assert time.monotonic() - t0 < TIMEOUTS["join_timeout_s"] + TIMEOUTS["op_timeout_s"]
        for i, d in enumerate(data):  # what the first trainer sent was intact
            verify_shard(i, d, store.get_manifest(1).shard_sizes[i], store.get_manifest(1).shard_checksums[i])
        assert source.stats()["epochs"] == 2 and bc.stats()["epoch"] == 1  # the numbering continues
    finally:
        if trainer.is_alive():
            os.kill(trainer.pid, signal.SIGKILL)
        if bc is not None:
            bc.close(timeout_s=15)
        source.close()


def test_a_version_never_broadcast_fails_within_the_fetch_timeout(store, publisher, broadcaster):
    source = CollectiveShardSource(store, "r-local", fetch_timeout_s=0.5, heartbeat_s=0.3, poll_s=0.05)
    try:
        manifest = publisher.publish(state(1), 1, recipe="bf16")  # published, never offered
        assert not source.available(manifest)  # in no epoch, nothing held: a caller goes elsewhere at once
        t0 = time.monotonic()
        with pytest.raises(CollectiveTransferError, match="version 1 did not arrive .* within 0.5 s"):
            source.fetch(manifest, 0)
        assert 0.4 < time.monotonic() - t0 < 2.0
        # a received version whose header disagrees with the manifest the caller holds
        publish(publisher, broadcaster, 2)
        wait_for(lambda: source.versions() == [2], 20.0, "version 2 received")
        assert source.available(store.get_manifest(2))
        other = build_shards(state(99), 2, job=store.job, recipe="bf16", endpoint="", shard_bytes=10**9)[0]
        with pytest.raises(CollectiveTransferError, match="arrived as .* but its manifest says 1 shard"):
            source.fetch(other, 0)
        with pytest.raises(CollectiveTransferError, match="newer version 2 arrived"):  # 1 will never come now
            source.fetch(manifest, 0)
    finally:
        source.close()
    with pytest.raises(CollectiveTransferError, match="closed"):
        source.fetch(manifest, 0)


def test_a_malformed_epoch_is_ignored_and_a_later_valid_one_works(store, publisher):
    epoch_key = store.keys.collective_epoch()
    source = CollectiveShardSource(store, "r-local", fetch_timeout_s=10.0, heartbeat_s=0.3, poll_s=0.05)
    bc = None
    try:
        for bad in (b"{not json", b'{"epoch": NaN}', json.dumps({"epoch": 1, "store": "x:1"}).encode()):
            n = source.stats()["malformed_epochs"]  # read before the write: the poller may see it at once
            store.client.set(epoch_key, bad)
            wait_for(lambda n=n: source.stats()["malformed_epochs"] == n + 1, 5.0, f"malformed epoch {bad!r} seen")
        bc = CollectiveBroadcaster(store, bucket_bytes=BUCKET_BYTES, poll_s=0.2, **TIMEOUTS)
        want = publish(publisher, bc, 1)
        manifest = store.get_manifest(1)
        assert [sha(source.fetch(manifest, i)) for i in range(manifest.num_shards)] == want
        assert source.stats()["epochs"] == 1 and source.stats()["failures"] == 0
    finally:
        if bc is not None:
            bc.close(timeout_s=15)
        source.close()
    assert store.client.get(epoch_key) is None  # the broadcaster withdrew its epoch
    assert store.client.sismember(store.keys.collective_members(), "r-local") == 0


def test_epoch_json_is_strict():
    spec = EpochSpec(3, "127.0.0.1:29500", ("r-a", "r-b"), "gloo", 5.0, 5.0)
    assert EpochSpec.from_json_bytes(spec.to_json_bytes()) == spec
    good = json.loads(spec.to_json_bytes())
    for change, match in (({"members": ["r-a", "r-a"]}, "twice"), ({"members": []}, "no members"),
                          ({"backend": "mpi"}, "backend"), ({"store": "nohost"}, "host:port"),
                          ({"op_timeout_s": 0}, "op_timeout_s"), ({"extra": 1}, "fields"),
                          ({"members": ["bad id"]}, "replica id"), ({"epoch": -1}, "epoch number must be an int >= 0")):
        with pytest.raises(ValueError, match=match):
            EpochSpec.from_json_bytes(json.dumps({**good, **change}).encode())
    with pytest.raises(ValueError, match="non-finite"):
        EpochSpec.from_json_bytes(spec.to_json_bytes().replace(b"5.0", b"Infinity", 1))


def test_offers_that_do_not_match_their_manifest_are_refused(store, publisher, broadcaster):
    manifest = publisher.publish(state(1), 1, recipe="bf16")
    shards = publisher.shards(1)
    with pytest.raises(ValueError, match=f"has {manifest.num_shards} shard.*{manifest.num_shards - 1} offered"):
        broadcaster.offer(manifest, shards[:-1])
    with pytest.raises(ValueError, match="shard 0 of weight version 1 is 3 bytes"):
        broadcaster.offer(manifest, [b"abc", *shards[1:]])
    broadcaster.offer(manifest, shards)
    with pytest.raises(ValueError, match="cannot offer weight version 1: version 1 was offered already"):
        broadcaster.offer(manifest, shards)
