"""FP8 delta refit: element-sparse deltas against a base version, rebuilt and checked against the full version.

Real redis-server; the in-process source and a real gRPC WeightStore serve the shards; the engine is
the dict double of ``test_subscriber``.
"""

from __future__ import annotations

import pytest
import torch

from fp8rl.refit import CorruptShardError, RefitPublisher, RefitStore, RefitSubscriber, assemble, build_shards, connect
from fp8rl.refit.delta import IDX, VAL, apply_delta, build_delta
from fp8rl.refit.shards import unpack_tensors
from fp8rl.refit.transport.grpc import GrpcShardSource, WeightStoreServicer
from fp8rl.rpc import weights_pb2_grpc
from fp8rl.rpc.server import build_server

from .test_subscriber import PREFIXES, DictEngine, same_tensors, state

pytestmark = pytest.mark.integration


def nudged(version: int, base: int = 1) -> dict[str, torch.Tensor]:
    """``state(base)`` after a small update: a few elements of the FP8 linears move, the norm and the
    embedding are untouched, and one tensor changes everywhere."""
    sd = state(base)
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"].clone()
    sd["model.layers.0.mlp.up_proj.weight"][version, :5] += 0.5
    g = torch.Generator().manual_seed(100 + version)
    sd["model.layers.0.mlp.down_proj.weight"] = torch.randn(128, 256, generator=g).to(torch.bfloat16)
    return sd


def build(sd, v):
    m, shards = build_shards(sd, v, job="j1", recipe="fp8_e2e", endpoint="", fp8_prefixes=PREFIXES, shard_bytes=20_000)
    return m, shards, unpack_tensors(m.tensors, shards)


def test_delta_ships_changed_elements_and_rebuilds_the_full_version_bitwise():
    b, _, bt = build(state(1), 1)
    n, nshards, nt = build(nudged(2), 2)
    d, dshards = build_delta(b, bt, n, nt)
    names = {e.name for e in d.tensors}
    up = "model.layers.0.mlp.up_proj.weight"
    assert {up + IDX, up + VAL} <= names  # a few E4M3 bytes moved: sparse
    assert "model.layers.0.mlp.down_proj.weight" in names  # every element moved: whole
    assert not any(x.startswith(("model.norm", "model.embed_tokens")) for x in names)  # unchanged: not shipped
    assert d.base == 1 and d.version == 2 and d.total_bytes < n.total_bytes / 2
    out = apply_delta(n, d, b, bt, assemble(d, dshards))
    assert same_tensors(out, assemble(n, nshards))
    assert out["model.norm.weight"] is bt["model.norm.weight"]  # unchanged tensors are the base's own


def test_a_delta_that_does_not_fit_is_refused_by_name():
    b, _, bt = build(state(1), 1)
    n, _, nt = build(nudged(2), 2)
    d, dshards = build_delta(b, bt, n, nt)
    parts = assemble(d, dshards)
    up = "model.layers.0.mlp.up_proj.weight"
    wrong = dict(parts)
    wrong[up + VAL] = wrong[up + VAL].clone()
    wrong[up + VAL].view(torch.uint8)[0] ^= 1
    with pytest.raises(CorruptShardError, match=f"'{up}'.*failed its checksum"):
        apply_delta(n, d, b, bt, wrong)
    far = dict(parts)
    far[up + IDX] = far[up + IDX].clone()
    far[up + IDX][0] = 10**7
    with pytest.raises(CorruptShardError, match="does not fit"):
        apply_delta(n, d, b, bt, far)
    missing = {k: v for k, v in parts.items() if not k.startswith(up)}
    with pytest.raises(CorruptShardError, match="does not carry it"):
        apply_delta(n, d, b, bt, missing)
    with pytest.raises(CorruptShardError, match="does not turn the held version"):
        apply_delta(n, d, n, nt, parts)
    other = dict(state(1))
    other["extra.weight"] = torch.zeros(4, dtype=torch.bfloat16)
    o, _, ot = build(other, 3)
    assert build_delta(b, bt, o, ot) is None  # another tensor set: only a full refit expresses it


@pytest.fixture
def env(redis_url: str, job_id: str):
    store = RefitStore(connect(redis_url), job_id)
    pub = RefitPublisher(store, shard_bytes=20_000, keep=2, delta=True)
    store.register_replica("r0", "rollout-0:50052", None, ttl_s=30)
    return store, pub


def test_subscriber_pulls_the_delta_when_it_holds_the_base_else_the_full_version(env):
    store, pub = env
    engine = DictEngine(requires_scales=False)
    sub = RefitSubscriber(store, engine, pub.source(), "r0", requires_scales=False, delta=True)
    pub.publish(state(1), 1, recipe="fp8_e2e", fp8_prefixes=PREFIXES)
    assert store.get_delta(1) is None  # nothing to patch yet
    sub.sync_to(1)
    assert sub.last_refit["how"] == "full"
    pub.publish(nudged(2), 2, recipe="fp8_e2e", fp8_prefixes=PREFIXES)
    full = store.get_manifest(2)
    assert store.get_delta(2).base == 1 and pub.last_delta["ratio"] < 0.5
    sub.sync_to(2)
    assert sub.last_refit["how"] == "delta" and sub.last_refit["bytes"] == store.get_delta(2).total_bytes
    assert same_tensors(engine.tensors, assemble(full, pub.shards(2)))
    # a replica that is not at the base pulls the full version
    late = DictEngine(requires_scales=False)
    late_sub = RefitSubscriber(store, late, pub.source(), "r0", requires_scales=False, delta=True)
    pub.publish(nudged(3), 3, recipe="fp8_e2e", fp8_prefixes=PREFIXES)
    late_sub.sync_to(3)
    assert late_sub.last_refit["how"] == "full"
    sub.sync_to(3)
    assert sub.last_refit["how"] == "delta" and same_tensors(engine.tensors, late.tensors)


class CorruptDelta:
    """Flips a byte of every delta shard it serves (full versions pass untouched)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def fetch(self, manifest, i):
        data = self.inner.fetch(manifest, i)
        if manifest.base is None:
            return data
        bad = bytearray(data)
        bad[len(bad) // 2] ^= 0x10
        return bad


def test_a_corrupt_delta_falls_back_to_the_full_version(env):
    store, pub = env
    engine = DictEngine(requires_scales=False)
    sub = RefitSubscriber(store, engine, CorruptDelta(pub.source()), "r0", requires_scales=False, delta=True,
                          retries=1, poll_s=0.001)
    pub.publish(state(1), 1, recipe="fp8_e2e", fp8_prefixes=PREFIXES)
    sub.sync_to(1)
    pub.publish(nudged(2), 2, recipe="fp8_e2e", fp8_prefixes=PREFIXES)
    sub.sync_to(2)
    assert sub.last_refit["how"] == "full" and engine.weight_version == 2
    assert same_tensors(engine.tensors, assemble(store.get_manifest(2), pub.shards(2)))


def test_delta_over_a_real_grpc_weight_store(env):
    store, pub = env
    servicer = WeightStoreServicer(pub)
    server, _, port = build_server([(weights_pb2_grpc.add_WeightStoreServicer_to_server, servicer)], port=0,
                                   host="127.0.0.1", token="", tls_cert="", tls_key="", max_workers=4)
    server.start()
    pub.endpoint = f"127.0.0.1:{port}"
    src = GrpcShardSource()
    try:
        engine = DictEngine(requires_scales=False)
        sub = RefitSubscriber(store, engine, src, "r0", requires_scales=False, delta=True)
        pub.publish(state(1), 1, recipe="fp8_e2e", fp8_prefixes=PREFIXES)
        sub.sync_to(1)
        pub.publish(nudged(2), 2, recipe="fp8_e2e", fp8_prefixes=PREFIXES)
        sub.sync_to(2)
        assert sub.last_refit["how"] == "delta"
        assert same_tensors(engine.tensors, assemble(store.get_manifest(2), pub.shards(2)))
    finally:
        src.close()
        server.stop(grace=None)
