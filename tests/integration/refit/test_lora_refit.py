"""Refit of a LoRA job (issue 33), real trainer and rollout engines over a real redis-server: the first version
carries the frozen base, every later one the adapters alone; a replica that joins late pulls the base and the
current adapters; the delta path works between adapter versions. Bytes are counted where the transport hands
them over (what moved), not computed from shapes."""

from __future__ import annotations

import pytest
import torch

from fp8rl.engines.base import SamplingParams
from fp8rl.engines.batch import build_train_batch
from fp8rl.engines.torch_rollout import TorchRolloutEngine
from fp8rl.engines.torch_trainer import TorchTrainer, TrainerConfig
from fp8rl.fp8 import fp8_linear_names, recipe_for_role
from fp8rl.fp8.payload import is_adapter
from fp8rl.model import CausalLM, ModelConfig
from fp8rl.model.lora import LoraSettings
from fp8rl.refit import RefitPublisher, RefitStore, RefitSubscriber, connect
from fp8rl.refit.manifest import frozen_checksum
from fp8rl.refit.transport import CountingSource

pytestmark = pytest.mark.integration

LORA = LoraSettings(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(3)
    cfg = ModelConfig(architecture="llama", vocab_size=97, hidden_size=256, intermediate_size=384,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return CausalLM(cfg).eval()


def _step(trainer, engine, seed):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (4, 9)]
    samples = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=seed))
    trainer.train_step(build_train_batch(samples, torch.tensor([1.0, -1.0, 1.0, -1.0]), 2, 0))


@pytest.mark.parametrize("delta", [False, True])
def test_adapters_only_after_the_base_and_a_late_replica_gets_both(redis_url, job_id, base, delta):
    store = RefitStore(connect(redis_url), job_id)
    rr = recipe_for_role("fp8_e2e", "rollout")
    trainer = TorchTrainer(base, recipe_for_role("fp8_e2e", "trainer"), TrainerConfig(lr=1e-2, lora=LORA))
    prefixes = fp8_linear_names(base, rr)
    publisher = RefitPublisher(store, keep=2, delta=delta, lora=True)

    def publish(v):
        sd = trainer.state_dict() if publisher.wants_base else trainer.state_dict(adapters_only=True)
        return publisher.publish(sd, v, recipe="fp8_e2e", fp8_prefixes=prefixes)

    early = TorchRolloutEngine(base, rr, eos_token_ids=[2], initial_version=None, lora=LORA)
    src = CountingSource(publisher.source())
    store.register_replica("early", "", None, ttl_s=30)
    sub = RefitSubscriber(store, early, src, "early", requires_scales=False, delta=delta)

    m1 = publish(1)
    assert m1.adapters_on is None and any(not is_adapter(e.name) for e in m1.tensors)
    sub.sync_to(1)
    assert src.bytes == m1.total_bytes
    sizes = {}
    for v in (2, 3, 4):
        _step(trainer, early, v)
        m = publish(v)
        assert m.adapters_on == {"version": 1, "checksum": frozen_checksum(m1)}
        assert all(is_adapter(e.name) for e in m.tensors)
        before = src.bytes
        sub.sync_to(v)
        sizes[v] = src.bytes - before
        assert sizes[v] <= m.total_bytes
    assert publisher.versions() == [1, 3, 4]  # the base stays servable beside the newest two
    adapter_bytes = sum(t.numel() * t.element_size() for t in trainer.state_dict(adapters_only=True).values())
    assert sizes[2] >= adapter_bytes and sizes[2] < 0.2 * m1.total_bytes
    if delta:  # between two adapter versions: the delta (never larger); v2 had no adapter-only version before it
        assert sub.last_refit["how"] == "delta"

    # a replica joining at version 4 pulls the base (version 1) and version 4's adapters
    late = TorchRolloutEngine(base, rr, eos_token_ids=[2], initial_version=None, lora=LORA)
    late_src = CountingSource(publisher.source())
    store.register_replica("late", "", None, ttl_s=30)
    late_sub = RefitSubscriber(store, late, late_src, "late", requires_scales=False, delta=delta)
    late_sub.sync_to(4)
    assert late_sub.last_refit["how"] == "full+base"
    assert late_src.bytes == m1.total_bytes + store.get_manifest(4).total_bytes == late_sub.last_refit["bytes"]
    mine, theirs = dict(late.model.named_parameters()), dict(early.model.named_parameters())
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[n], theirs[n]) for n in mine)
    assert all(torch.equal(a, b) for a, b in zip(late.model.buffers(), early.model.buffers(), strict=True))
    publisher.close()


def test_a_version_naming_another_base_is_refused(redis_url, job_id, base):
    """The checksum in adapters_on is checked against the base version's manifest before anything is applied."""
    import dataclasses

    store = RefitStore(connect(redis_url), job_id)
    trainer = TorchTrainer(base, recipe_for_role("bf16", "trainer"), TrainerConfig(lora=LORA))
    publisher = RefitPublisher(store, lora=True)
    publisher.publish(trainer.state_dict(), 1, recipe="bf16")
    m2 = publisher.publish(trainer.state_dict(adapters_only=True), 2, recipe="bf16")
    forged = dataclasses.replace(m2, version=3, adapters_on={"version": 1, "checksum": "0" * 32})
    store.publish(forged)
    engine = TorchRolloutEngine(base, recipe_for_role("bf16", "rollout"), eos_token_ids=[2], initial_version=None,
                                lora=LORA)
    store.register_replica("r", "", None, ttl_s=30)
    sub = RefitSubscriber(store, engine, publisher.source(), "r", requires_scales=False)
    from fp8rl.refit import RefitFailedError

    with pytest.raises(RefitFailedError, match="ships another base"):
        sub.sync_to(3)
    assert engine.weight_version is None
    with pytest.raises(ValueError, match="first version must carry the base"):
        RefitPublisher(store, lora=True).publish(trainer.state_dict(adapters_only=True), 5, recipe="bf16")
