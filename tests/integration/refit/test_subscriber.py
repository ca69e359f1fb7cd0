"""RefitPublisher → Redis → RefitSubscriber → engine.load_weights, against a real redis-server.

The engine here is a test double implementing :class:`RolloutEngine` (a dict of tensors, a version
and scales, with an atomic load); the real engines get their own refit tests.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from types import SimpleNamespace

import pytest
import torch

from fp8rl.engines.base import WeightLoadError
from fp8rl.fp8 import E4M3, QKVScales, quantize_state_dict
from fp8rl.refit import (
    LeaseExpiredError,
    Manifest,
    MissingScalesError,
    RefitFailedError,
    RefitFollower,
    RefitPublisher,
    RefitStore,
    RefitSubscriber,
    StaleVersionError,
    UnknownVersionError,
    connect,
)
from fp8rl.refit.follower import HELD
from fp8rl.refit.scales import encode_scales
from services.common.compute import ComputeThread, OnComputeThread
from services.rollout.server import HoldingTarget, OpenSessions

pytestmark = pytest.mark.integration

PREFIXES = ["model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"]


class DictEngine:
    """A :class:`fp8rl.refit.RefitTarget` (what refit needs, nothing of an engine): holds tensors + version +
    QKV scales; ``load_weights`` validates first, then swaps all at once."""

    def __init__(self, requires_scales: bool) -> None:
        self.requires_scales = requires_scales
        self.tensors: dict[str, torch.Tensor] = {}
        self.scales: QKVScales | None = None
        self._version: int | None = None
        self.loads = 0

    @property
    def weight_version(self) -> int | None:
        return self._version

    def load_weights(
        self, version: int, tensors: Mapping[str, torch.Tensor], qkv_scales: QKVScales | None = None
    ) -> None:
        if self._version is not None and version < self._version:
            raise WeightLoadError(f"version {version} is older than held {self._version}")
        if self.requires_scales and (qkv_scales is None or qkv_scales.version != version):
            raise WeightLoadError(f"version {version} needs its own QKV scales, got {qkv_scales}")
        if self.tensors and set(tensors) != set(self.tensors):
            raise WeightLoadError(f"tensor names changed: {sorted(set(tensors) ^ set(self.tensors))}")
        new = {k: v.clone() for k, v in tensors.items()}
        self.tensors, self.scales, self._version = new, qkv_scales, version
        self.loads += 1


def state(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {
        "model.embed_tokens.weight": torch.randn(16, 128, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(256, 128, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": torch.randn(128, 256, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.ones(128, dtype=torch.bfloat16) * version,
    }


def scales(version: int) -> QKVScales:
    return QKVScales(version, [0.01 * version], [0.02 * version], [0.03 * version])


def same_tensors(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if t.dtype == E4M3 else t

    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(raw(a[k]), raw(b[k])) for k in a)


class FlakySource:
    """Wraps a ShardSource; corrupts (flips one byte of) the first ``bad`` fetches of shard 0, or raises."""

    def __init__(self, inner, bad: float, mode: str = "flip") -> None:
        self.inner, self.bad, self.mode = inner, bad, mode
        self.fetches: dict[int, int] = {}

    def fetch(self, manifest: Manifest, shard_index: int) -> bytes:
        n = self.fetches[shard_index] = self.fetches.get(shard_index, 0) + 1
        data = self.inner.fetch(manifest, shard_index)
        if shard_index == 0 and n <= self.bad:
            if self.mode == "raise":
                raise ConnectionError("stream reset by peer")
            flipped = bytearray(data)
            flipped[len(flipped) // 2] ^= 0x40
            return bytes(flipped)
        return data


@pytest.fixture
def env(redis_url: str, job_id: str):
    store = RefitStore(connect(redis_url), job_id)
    publisher = RefitPublisher(store, shard_bytes=40_000, keep=2)
    store.register_replica("r0", "rollout-0:50052", None, ttl_s=30)
    return store, publisher


def publish(store: RefitStore, publisher: RefitPublisher, version: int, *, with_scales: bool = True) -> None:
    publisher.publish(state(version), version, recipe="fp8_e2e", fp8_prefixes=PREFIXES)
    if with_scales:
        store.put_scales(scales(version))


def test_publish_sync_ack_round_trip(env):
    store, publisher = env
    engine = DictEngine(requires_scales=True)
    sub = RefitSubscriber(store, engine, publisher.source(), "r0", requires_scales=True)
    assert sub.sync_latest() is None and engine.loads == 0  # nothing published yet
    publish(store, publisher, 1)
    assert sub.sync_latest() == 1
    assert engine.weight_version == 1 and engine.scales == scales(1)
    assert same_tensors(engine.tensors, quantize_state_dict(state(1), PREFIXES))
    assert store.wait_for_acks(1, timeout_s=1) == (["r0"], [])
    assert store.live_replicas()["r0"].version == 1
    assert sub.sync_to(1) == 1 and engine.loads == 1  # already held: re-ack only, no reload

    for v in (2, 3):
        publish(store, publisher, v)
    assert publisher.versions() == [2, 3]  # keep=2: version 1 evicted
    with pytest.raises(LookupError, match="version 1 are not held"):
        publisher.shards(1)
    assert sub.sync_latest() == 3 and engine.scales.version == 3
    with pytest.raises(StaleVersionError):
        publisher.publish(state(3), 3, recipe="fp8_e2e", fp8_prefixes=PREFIXES)
    with pytest.raises(UnknownVersionError, match="no manifest for weight version 9"):
        sub.sync_to(9)


def test_corrupt_shard_is_retried_then_applied(env):
    store, publisher = env
    publish(store, publisher, 1)
    assert store.get_manifest(1).num_shards > 1
    for mode in ("flip", "raise"):
        engine = DictEngine(requires_scales=True)
        source = FlakySource(publisher.source(), bad=2, mode=mode)
        RefitSubscriber(store, engine, source, "r0", requires_scales=True, retries=3, poll_s=0.01).sync_to(1)
        assert engine.weight_version == 1 and source.fetches[0] == 3 and source.fetches[1] == 1
        assert same_tensors(engine.tensors, quantize_state_dict(state(1), PREFIXES))


def test_persistent_corruption_keeps_the_old_version_serving(env):
    store, publisher = env
    publish(store, publisher, 1)
    engine = DictEngine(requires_scales=True)
    source = FlakySource(publisher.source(), bad=float("inf"))
    sub = RefitSubscriber(store, engine, source, "r0", requires_scales=True, retries=2, poll_s=0.01)
    source.bad = 0
    sub.sync_to(1)
    old = {k: v.clone() for k, v in engine.tensors.items()}
    publish(store, publisher, 2)
    source.bad = float("inf")
    with pytest.raises(RefitFailedError, match=r"version 2 intact after 3 attempt.*still serving version 1") as ei:
        sub.sync_to(2)
    assert "shard 0" in str(ei.value)
    assert source.fetches[0] == 1 + 3  # one good fetch for v1, then 1 + retries for v2
    assert engine.weight_version == 1 and engine.loads == 1 and engine.scales == scales(1)
    assert same_tensors(engine.tensors, old)
    assert store.acks(2) == set()


def test_stale_version_is_refused(env):
    store, publisher = env
    for v in (1, 2):
        publish(store, publisher, v)
    engine = DictEngine(requires_scales=False)
    sub = RefitSubscriber(store, engine, publisher.source(), "r0", requires_scales=False)
    sub.sync_to(2)
    assert engine.scales is None  # no FP8 KV cache: scales are not passed
    with pytest.raises(StaleVersionError, match="cannot apply on replica 'r0' weight version 1: version 2"):
        sub.sync_to(1)
    assert engine.weight_version == 2 and engine.loads == 1
    assert store.acks(1) == set()


def test_scales_of_another_version_are_never_applied(env):
    store, publisher = env
    publish(store, publisher, 1)
    engine = DictEngine(requires_scales=True)
    sub = RefitSubscriber(store, engine, publisher.source(), "r0", requires_scales=True, scales_timeout_s=0.3,
                          poll_s=0.02)
    sub.sync_to(1)
    publish(store, publisher, 2, with_scales=False)  # only version 1's scales exist
    with pytest.raises(MissingScalesError, match="QKV scales of weight version 2.*still serving version 1"):
        sub.sync_to(2)
    assert engine.weight_version == 1 and engine.scales == scales(1) and engine.loads == 1
    assert store.acks(2) == set()

    # Version 1's scale payload planted under version 2's key is refused, not applied.
    store.client.set(store.keys.scales(2), encode_scales(scales(1)))
    with pytest.raises(ValueError, match="calibrated on version 1"):
        sub.sync_to(2)
    assert engine.weight_version == 1 and engine.scales.version == 1
    store.client.delete(store.keys.scales(2))

    store.put_scales(scales(2))
    assert sub.sync_to(2) == 2 and engine.scales == scales(2)
    assert store.acks(2) == {"r0"}


def test_apply_without_a_live_lease_cannot_ack(env):
    store, publisher = env
    publish(store, publisher, 1)
    engine = DictEngine(requires_scales=True)
    sub = RefitSubscriber(store, engine, publisher.source(), "r-unregistered", requires_scales=True)
    with pytest.raises(LeaseExpiredError, match="re-register"):
        sub.sync_to(1)
    assert store.acks(1) == set()


def test_a_trajectory_opened_after_the_followers_look_still_holds_the_refit(env):
    """The rollout replica's hold (env.partial finish) asked twice: by the follower before it fetches, and again in
    the apply on the compute thread. A Generate that opens a trajectory of the held version between the two looks
    (here: inside the follower's first look, after it answered) holds the refit — the engine keeps its version, the
    follower reports it held with no failure and no back-off — and the version lands once the trajectory ends."""
    store, publisher = env
    engine, sessions, compute = DictEngine(requires_scales=False), OpenSessions(idle_s=60.0), ComputeThread("t")
    try:
        sub = RefitSubscriber(store, OnComputeThread(HoldingTarget(engine, sessions), compute.call),
                              publisher.source(), "r0", requires_scales=False)
        publish(store, publisher, 1, with_scales=False)
        sub.sync_to(1)

        def look(latest):  # the follower's look answers "apply", then a Generate opens trajectory "t" at v1
            why = sessions.hold(engine.weight_version, latest)
            sessions.used(["t"], 1, max_lag=1)
            return why

        holder = SimpleNamespace(store=store, replica_id="r0", endpoint="rollout-0:50052", stopping=threading.Event(),
                                 role="rollout", lease_ttl=30.0)
        follower = RefitFollower(holder, sub, lock=threading.Lock(), hold=look)
        publish(store, publisher, 2, with_scales=False)
        follower._maybe_sync()
        assert engine.weight_version == 1 and engine.loads == 1  # not applied between the trajectory's turns
        assert follower.pending.version == 2 and follower.pending.reason.startswith(f"{HELD}: 1 multi-turn")
        assert follower._failed is None  # a hold, not a failed refit: no back-off
        sessions.release(["t"])
        follower.hold = lambda latest: sessions.hold(engine.weight_version, latest)
        follower._maybe_sync()
        assert (engine.weight_version, follower.pending) == (2, None)
    finally:
        compute.close()
