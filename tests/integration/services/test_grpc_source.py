"""GrpcShardSource ↔ WeightStoreServicer over a real loopback gRPC server and a real Redis.

Faults are injected on the *server* side — a publisher that corrupts the bytes it hands out, a
servicer that cuts its stream short — so the client code under test runs unmodified. The tests
run in file order on one job: v1 (corrupt once), v2 (corrupt for good, then clean), v3 (a big
synthetic shard for resume), then eviction and range errors.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from fp8rl.engines import SamplingParams, TorchRolloutEngine
from fp8rl.fp8 import Fp8Recipe, fp8_linear_names
from fp8rl.presets import load_policy
from fp8rl.refit import Manifest, RefitFailedError, RefitPublisher, RefitStore, RefitSubscriber, connect
from fp8rl.refit.transport.grpc import MIN_CHUNK_BYTES, GrpcShardSource, ShardTransferError, WeightStoreServicer
from fp8rl.rpc import weights_pb2, weights_pb2_grpc
from fp8rl.rpc.channel import make_channel
from fp8rl.rpc.server import build_server

pytestmark = pytest.mark.integration

RECIPE = Fp8Recipe(linear="fp8")  # FP8 linears, BF16 KV: no QKV scales needed for these refits
PROMPT = [1, 40, 41, 42]


class TamperingPublisher(RefitPublisher):
    """Hands out shard 0 with one byte flipped for the next ``corrupt`` calls (a bad disk, a bad NIC)."""

    corrupt = 0.0
    calls = 0

    def shards(self, version: int, *, delta: bool = False) -> list[bytes]:
        out = super().shards(version, delta=delta)
        self.calls += 1
        if self.corrupt > 0:
            self.corrupt -= 1
            bad = bytearray(out[0])
            bad[len(bad) // 2] ^= 0x10
            out[0] = bytes(bad)
        return out


class FaultyWeightStore(WeightStoreServicer):
    """Cuts the next streams short: after one chunk with ``end`` (no ``last``) or ``abort`` (UNAVAILABLE), or
    before any chunk with ``empty``."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.faults: list[str] = []
        self.offsets: list[int] = []

    def StreamShards(self, request, context):
        self.offsets.append(request.offset)
        fault = self.faults.pop(0) if self.faults else None
        if fault == "empty":
            return
        for i, chunk in enumerate(super().StreamShards(request, context)):
            if i == 1 and fault == "end":
                return
            if i == 1 and fault == "abort":
                context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset (injected)")
            yield chunk


@pytest.fixture(scope="module")
def env(redis_url, module_job_id, tiny_checkpoint):
    store = RefitStore(connect(redis_url), module_job_id)
    publisher = TamperingPublisher(store, keep=2)
    servicer = FaultyWeightStore(publisher, chunk_bytes=MIN_CHUNK_BYTES)
    server, _, port = build_server([(weights_pb2_grpc.add_WeightStoreServicer_to_server, servicer)], port=0,
                                   host="127.0.0.1", token="", tls_cert="", tls_key="")
    server.start()
    publisher.endpoint = f"127.0.0.1:{port}"
    policy, tok, _ = load_policy(str(tiny_checkpoint))
    engine = TorchRolloutEngine(policy, RECIPE, eos_token_ids=[tok.eos_id], pad_token_id=tok.pad_id,
                                initial_version=None)
    store.register_replica("r0", "127.0.0.1:1", None, ttl_s=60)
    source = GrpcShardSource(backoff_s=0.01)
    sub = RefitSubscriber(store, engine, source, "r0", requires_scales=False, retries=2, poll_s=0.01)
    yield store, publisher, servicer, engine, sub, source, policy
    source.close()
    server.stop(0)


def publish(publisher: RefitPublisher, policy, version: int) -> Manifest:
    g = torch.Generator().manual_seed(version)
    sd = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in policy.state_dict().items()}
    return publisher.publish(sd, version, recipe="fp8_e2e", fp8_prefixes=fp8_linear_names(policy, RECIPE))


def greedy(engine, version: int):
    return engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=5), weight_version=version)[0]


def test_a_corrupt_shard_is_rejected_and_refetched(env):
    store, publisher, servicer, engine, sub, _, policy = env
    publish(publisher, policy, 1)
    publisher.corrupt, publisher.calls = 1, 0
    assert sub.sync_to(1) == 1
    assert publisher.calls == 2  # the corrupt copy failed its checksum; the re-fetch was clean
    assert engine.weight_version == 1 and store.acks(1) == {"r0"}
    assert greedy(engine, 1).weight_version == 1


def test_persistent_corruption_keeps_the_old_weights_serving(env):
    store, publisher, servicer, engine, sub, _, policy = env
    before = greedy(engine, 1)
    publish(publisher, policy, 2)
    publisher.corrupt = float("inf")
    with pytest.raises(RefitFailedError, match=r"version 2 intact after 3 attempt.*still serving version 1.*checksum"):
        sub.sync_to(2)
    assert engine.weight_version == 1 and store.acks(2) == set()
    after = greedy(engine, 1)
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs
    publisher.corrupt = 0
    assert sub.sync_to(2) == 2 and engine.weight_version == 2


def test_a_cut_stream_resumes_from_the_bytes_received(env):
    store, publisher, servicer, _, _, source, _ = env
    g = torch.Generator().manual_seed(3)
    manifest = publisher.publish({"big": torch.randn(700_000, generator=g)}, 3, recipe="bf16")  # 2.7 MiB: 3 chunks
    servicer.faults, servicer.offsets = ["end", "abort"], []
    assert source.fetch(manifest, 0) == publisher.shards(3)[0]
    assert servicer.offsets == [0, MIN_CHUNK_BYTES, 2 * MIN_CHUNK_BYTES]

    servicer.faults = ["empty"] * 4  # more cuts than max_resumes=3: a clear error, not a hang
    with pytest.raises(ShardTransferError, match=r"cut short 4 time\(s\)"):
        source.fetch(manifest, 0)
    servicer.faults = []


def test_evicted_versions_and_bad_offsets_are_refused(env):
    store, publisher, _, _, _, source, _ = env
    assert publisher.versions() == [2, 3]  # keep=2
    with pytest.raises(ShardTransferError, match="NOT_FOUND.*version 1 are not held"):
        source.fetch(store.get_manifest(1), 0)
    stub = weights_pb2_grpc.WeightStoreStub(make_channel(publisher.endpoint, token="", tls_ca=""))
    got = stub.GetManifest(weights_pb2.GetManifestRequest(version=3), timeout=5)
    assert Manifest.from_json_bytes(got.manifest) == store.get_manifest(3)
    size = store.get_manifest(3).shard_sizes[0]
    with pytest.raises(grpc.RpcError) as ei:
        list(stub.StreamShards(weights_pb2.StreamShardsRequest(version=3, shard_index=0, offset=size + 1), timeout=5))
    assert ei.value.code() == grpc.StatusCode.OUT_OF_RANGE
    tail = list(stub.StreamShards(weights_pb2.StreamShardsRequest(version=3, shard_index=0, offset=size), timeout=5))
    assert [(c.offset, c.data, c.last) for c in tail] == [(size, b"", True)]
    with pytest.raises(grpc.RpcError) as ei:
        list(stub.StreamShards(weights_pb2.StreamShardsRequest(version=3, shard_index=7), timeout=5))
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND
