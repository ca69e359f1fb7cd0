"""The shared-memory refit transport: shards allocated in /dev/shm files by the publisher, mapped by replicas.

Real redis-server, real files under a tmpfs (``/dev/shm``), the real subscriber; the engine is the
dict double of ``test_subscriber``.
"""

from __future__ import annotations

import errno
import json
import os
import struct

import pytest
import safetensors
import torch

from fp8rl.refit import RefitPublisher, RefitStore, RefitSubscriber, connect
from fp8rl.refit.transport import AutoShardSource, make_shard_source
from fp8rl.refit.transport.shm import ShmShardSource, ShmShardWriter, ShmUnavailableError

from .test_subscriber import PREFIXES, DictEngine, same_tensors, state

pytestmark = pytest.mark.integration

SHM = "/dev/shm"
if not os.access(SHM, os.W_OK):
    pytest.skip(f"{SHM} is not writable here", allow_module_level=True)


@pytest.fixture
def env(redis_url: str, job_id: str):
    store = RefitStore(connect(redis_url), job_id)
    writer = ShmShardWriter(job_id, SHM)
    pub = RefitPublisher(store, shard_bytes=20_000, keep=2, shm=writer)  # the FP8 linears span shards
    store.register_replica("r0", "rollout-0:50052", None, ttl_s=30)
    yield store, pub, writer
    pub.close()
    assert not writer.dir.exists()


def _tensor_views_of(tensors, buffers) -> bool:
    """Whether every tensor lies inside one of ``buffers`` (a view, not a copy)."""
    spans = []
    for b in buffers:
        t = torch.frombuffer(b, dtype=torch.uint8) if len(b) else None
        if t is not None:
            spans.append((t.data_ptr(), t.data_ptr() + len(b)))
    return all(any(lo <= t.data_ptr() < hi for lo, hi in spans) for t in tensors.values() if t.numel())


def test_shm_refit_maps_the_trainers_files_and_copies_once(env):
    store, pub, writer = env
    m = pub.publish(state(1), 1, recipe="fp8_e2e", fp8_prefixes=PREFIXES)
    assert m.shm == {"dir": str(writer.dir / "v1"), "host": writer.host} and m.num_shards >= 3
    assert store.get_manifest(1) == m  # what Redis holds names the directory
    src = ShmShardSource()
    assert src.available(m)
    shards = [src.fetch(m, i) for i in range(m.num_shards)]
    assert [bytes(s) for s in shards] == [bytes(s) for s in pub.shards(1)]
    from fp8rl.refit import assemble

    tensors = assemble(m, shards)
    whole = {e.name for e in m.tensors if e.offset + e.nbytes <= m.shard_sizes[e.shard]}
    assert whole and len(whole) < len(tensors)  # some tensors span shards (those are copied)
    # the others are assembled in place over the mapping: no copy before the engine's own
    assert _tensor_views_of({n: tensors[n] for n in whole}, shards)
    assert not _tensor_views_of({n: t for n, t in tensors.items() if n not in whole}, shards)
    engine = DictEngine(requires_scales=False)
    sub = RefitSubscriber(store, engine, src, "r0", requires_scales=False)
    assert sub.sync_to(1) == 1
    grpc_like = DictEngine(requires_scales=False)
    RefitSubscriber(store, grpc_like, pub.source(), "r0", requires_scales=False).sync_to(1)
    assert same_tensors(engine.tensors, grpc_like.tensors)


def test_shard_files_are_valid_safetensors(env):
    _, pub, writer = env
    m = pub.publish(state(1), 1, recipe="fp8_e2e", fp8_prefixes=PREFIXES)
    sd = state(1)
    seen = set()
    for i in range(m.num_shards):
        path = writer.dir / "v1" / f"shard-{i:05d}.safetensors"
        (n,) = struct.unpack("<Q", path.read_bytes()[:8])
        assert (8 + n) % 64 == 0  # data region 64-byte aligned
        with safetensors.safe_open(str(path), framework="pt") as f:
            assert f.metadata() == {"format": "fp8rl-refit-shard", "job": m.job, "version": "1", "shard": str(i)}
            for name in f.keys():
                if name.startswith("__"):
                    continue
                seen.add(name)
                if name in sd and not name.startswith(tuple(PREFIXES)):  # pass-through BF16 tensors
                    assert torch.equal(f.get_tensor(name), sd[name])
    whole = {e.name for e in m.tensors if e.offset + e.nbytes <= m.shard_sizes[e.shard]}
    assert seen == whole


def test_versions_leave_shm_with_the_publisher_keep_window_and_orphans_are_removed(env, job_id):
    _, pub, writer = env
    for v in (1, 2, 3):
        pub.publish(state(v), v, recipe="bf16")
    assert writer.versions() == [2, 3] and pub.versions() == [2, 3]
    assert not (writer.dir / "v1").exists()
    orphan = writer.dir.parent / f"fp8rl-{job_id}-{2**22 + 12345}-abc"  # a pid that cannot exist
    orphan.mkdir()
    other = ShmShardWriter(job_id, SHM)
    try:
        assert not orphan.exists() and writer.dir.exists()  # the live writer's directory is kept
    finally:
        other.close()


def test_a_foreign_or_broken_shm_file_falls_back_to_grpc(env):
    store, pub, writer = env
    m = pub.publish(state(1), 1, recipe="bf16")
    path = writer.dir / "v1" / "shard-00001.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # a flipped byte in shard 1's data, in a new file (the trainer's own pages stay intact)
    path.with_suffix(".new").write_bytes(bytes(raw))
    os.replace(path.with_suffix(".new"), path)
    auto = AutoShardSource(pub.source(), [("shm", ShmShardSource())])
    engine = DictEngine(requires_scales=False)
    RefitSubscriber(store, engine, auto, "r0", requires_scales=False).sync_to(1)
    assert auto.counts["fallback"] == 1 and auto.counts["grpc"] == 1 and auto.counts["shm"] == m.num_shards - 1
    ref = DictEngine(requires_scales=False)
    RefitSubscriber(store, ref, pub.source(), "r0", requires_scales=False).sync_to(1)
    assert same_tensors(engine.tensors, ref.tensors)
    # another host's manifest: shm is not even tried
    foreign = type(m)(**{**m.__dict__, "shm": {"dir": m.shm["dir"], "host": "another-host"}})
    assert auto.choose(foreign)[0] == "grpc"
    with pytest.raises(ShmUnavailableError, match="another-host"):
        ShmShardSource().fetch(foreign, 0)
    # a file of another version at the right path is refused by its metadata
    hdr_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    meta = json.loads(path.read_bytes()[8:8 + hdr_len])
    assert meta["__metadata__"]["version"] == "1"
    with pytest.raises(ShmUnavailableError, match="expected"):
        ShmShardSource().fetch(type(m)(**{**m.__dict__, "job": "other-job"}), 0)


def test_full_shared_memory_publishes_over_grpc_only(env, monkeypatch):
    store, pub, _ = env

    def full(fd, offset, length):  # what a full tmpfs answers
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    m = pub.publish(state(1), 1, recipe="bf16")
    assert m.shm is None and store.get_manifest(1).shm is None
    engine = DictEngine(requires_scales=False)
    auto = make_shard_source("auto")
    auto.grpc = pub.source()  # the in-process stand-in for the WeightStore the manifest would name
    RefitSubscriber(store, engine, auto, "r0", requires_scales=False).sync_to(1)
    assert auto.counts == {"grpc": m.num_shards}


def test_evicted_files_are_recycled_only_when_no_replica_can_still_read_them(env):
    store, pub, writer = env
    engine = DictEngine(requires_scales=False)
    src = ShmShardSource()
    sub = RefitSubscriber(store, engine, AutoShardSource(pub.source(), [("shm", src)]), "r0", requires_scales=False)
    inodes = {}
    for v in (1, 2, 3, 4, 5):  # the replica follows every version: the version evicted by v is recycled for v
        pub.publish(state(v), v, recipe="fp8_e2e", fp8_prefixes=PREFIXES)
        inodes[v] = os.stat(writer.dir / f"v{v}" / "shard-00000.safetensors").st_ino
        sub.sync_to(v)
        ref = DictEngine(requires_scales=False)
        RefitSubscriber(store, ref, pub.source(), "r0", requires_scales=False).sync_to(v)
        assert same_tensors(engine.tensors, ref.tensors), v  # bytes read through a reused mapping are v's
        assert sub.source.counts.get("fallback", 0) == 0
    assert inodes[3] == inodes[1] and inodes[4] == inodes[2] and inodes[5] == inodes[3]
    assert writer.versions() == [4, 5]
    # a replica still at version 3 when 6 evicts 4 may be reading 4 right now: 4's files are deleted, not reused
    store.register_replica("slow", "rollout-1:50052", 3, ttl_s=30)
    pub.publish(state(6), 6, recipe="fp8_e2e", fp8_prefixes=PREFIXES)
    inodes[6] = os.stat(writer.dir / "v6" / "shard-00000.safetensors").st_ino
    assert inodes[6] != inodes[4]
    store.register_replica("slow", "rollout-1:50052", 6, ttl_s=30)  # every lease at 5 or newer: 5 is recycled
    pub.publish(state(7), 7, recipe="fp8_e2e", fp8_prefixes=PREFIXES)
    assert os.stat(writer.dir / "v7" / "shard-00000.safetensors").st_ino == inodes[5]
    store.register_replica("slower", "rollout-2:50052", None, ttl_s=30)  # holds nothing yet: could read any
    pub.publish(state(8), 8, recipe="fp8_e2e", fp8_prefixes=PREFIXES)
    assert os.stat(writer.dir / "v8" / "shard-00000.safetensors").st_ino != inodes[6]
