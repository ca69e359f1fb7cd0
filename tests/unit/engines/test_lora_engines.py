"""LoRA in the engines (issue 33): the trainer trains the adapters alone on a frozen base, the rollout computes them
the same way, refits after the base carry the adapters alone, and checkpoints hold the adapters and name their base.

Equality claims are ``torch.equal`` (batch-invariant numerics: no tolerance); each has a negative control that the
same comparison fails when the adapters the rollout serves are not the trainer's.
"""

import re

import pytest
import torch

from fp8rl.engines.base import SamplingParams, WeightLoadError
from fp8rl.engines.batch import build_train_batch
from fp8rl.engines.calibration_model import CalibrationModel
from fp8rl.engines.calibrator import QKVCalibrator
from fp8rl.engines.torch_rollout import TorchRolloutEngine
from fp8rl.engines.torch_trainer import TorchTrainer, TrainerConfig
from fp8rl.fp8 import recipe_for_role
from fp8rl.fp8.payload import is_adapter
from fp8rl.model import CausalLM
from fp8rl.model.lora import LoraSettings

from .conftest import tiny_config

LORA = LoraSettings(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(5)
    cfg = tiny_config(vocab_size=97, hidden_size=192, intermediate_size=320, num_attention_heads=6,
                      num_key_value_heads=2, head_dim=32, initializer_range=0.08)
    return CausalLM(cfg).eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 97, (n,), generator=g).tolist() for n in (2, 19, 7, 31)]


def _engines(model, recipe, kv, lora=LORA, *, lr=2e-2):
    rr = recipe_for_role(recipe, "rollout", kv_cache_dtype=kv, batch_invariant=True)
    tr = recipe_for_role(recipe, "trainer", kv_cache_dtype=kv, batch_invariant=True)
    trainer = TorchTrainer(model, tr, TrainerConfig(micro_batch_size=5, lr=lr, lora=lora))
    engine = TorchRolloutEngine(model, rr, eos_token_ids=[2], max_batch_size=3, lora=lora)
    return trainer, engine


def _scales(trainer, prompts, version):
    return QKVCalibrator(trainer.model, pad_token_id=0).calibrate(version, prompts)


def _batch(engine, prompts, seed):
    samples = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=16, n=2, seed=seed))
    adv = torch.tensor([(-1.0) ** i for i in range(len(samples))])  # a signal, so the adapters move
    return build_train_batch(samples, adv, 2, 0)


def _base_bytes(trainer):
    return {n: t.clone() for n, t in trainer.state_dict().items() if not is_adapter(n)}


@pytest.mark.parametrize("recipe,kv", [("bf16", "auto"), ("fp8_e2e", "fp8")])
def test_lora_trains_adapters_only_and_the_rollout_stays_bitwise_the_trainer(base, prompts, recipe, kv):
    trainer, engine = _engines(base, recipe, kv)
    stale = TorchRolloutEngine(base, engine.recipe, eos_token_ids=[2], max_batch_size=3, lora=LORA)
    if kv == "fp8":
        s0 = _scales(trainer, prompts, 0)
        for e in (engine, stale):
            e.load_scales(s0)
        trainer.load_qkv_scales(s0)
    before = _base_bytes(trainer)
    adapters0 = {n: t.clone() for n, t in trainer.state_dict(adapters_only=True).items()}
    trainer.train_step(_batch(engine, prompts, 3))

    # only the adapters changed; the base's bytes did not, and AdamW holds state for the adapters alone
    after = trainer.state_dict()
    assert all(torch.equal(after[n], t) for n, t in before.items())
    moved = [n for n, t in trainer.state_dict(adapters_only=True).items() if not torch.equal(t, adapters0[n])]
    assert moved and all(n.endswith(".lora_B.weight") or n.endswith(".lora_A.weight") for n in moved)
    assert len(trainer.optimizer.state) == len(adapters0) == 2 * 7 * base.config.num_hidden_layers
    assert all(p.grad is None for n, p in trainer.model.named_parameters() if not is_adapter(n))

    # refit after the base: the adapters alone (the engine keeps its base), with version 1's scales
    s1 = _scales(trainer, prompts, 1) if kv == "fp8" else None
    if s1 is not None:
        trainer.load_qkv_scales(s1)
    engine.load_weights(1, trainer.state_dict(adapters_only=True), s1)
    batch = _batch(engine, prompts, 4)
    mask = batch.loss_mask.bool()
    got, want = trainer.compute_logprobs(batch)[mask], batch.gen_logprobs[mask]
    assert got.numel() > 50
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} logprobs differ"

    # negative control: an engine serving version 0's adapters (same base, same scales) samples other numbers
    stale_base_only = {n: t for n, t in trainer.state_dict().items() if not is_adapter(n)}
    stale.load_weights(1, {**stale_base_only, **adapters0}, s1)
    stale_batch = _batch(stale, prompts, 4)
    m2 = stale_batch.loss_mask.bool()
    assert not torch.equal(trainer.compute_logprobs(stale_batch)[m2], stale_batch.gen_logprobs[m2])


def test_an_adapters_only_payload_needs_a_base_and_exactly_the_adapters(base):
    trainer, engine = _engines(base, "fp8_e2e", "auto")
    fresh = TorchRolloutEngine(base, engine.recipe, eos_token_ids=[2], initial_version=None, lora=LORA)
    with pytest.raises(WeightLoadError, match="first refit must carry the base"):
        fresh.load_weights(1, trainer.state_dict(adapters_only=True))
    adapters = trainer.state_dict(adapters_only=True)
    one = next(iter(adapters))
    with pytest.raises(WeightLoadError, match="missing"):  # not all the adapters: a partial base payload, refused
        engine.load_weights(1, {k: v for k, v in adapters.items() if k != one})
    bad = dict(adapters)
    bad[one] = torch.full_like(bad[one], float("nan"))
    with pytest.raises(WeightLoadError, match=one.replace(".", r"\.")):
        engine.load_weights(1, bad)
    assert engine.weight_version == 0
    fresh.load_weights(1, trainer.state_dict())  # base + adapters: accepted, then adapters alone
    fresh.load_weights(2, adapters)
    assert fresh.weight_version == 2


def test_the_calibrator_applies_the_adapters(base, prompts):
    """The QKV scales depend on the adapters (k_proj / v_proj outputs): the calibrator's model loads them."""
    trainer, _ = _engines(base, "fp8_e2e", "fp8")
    trainer.load_qkv_scales(_scales(trainer, prompts, 0))
    with torch.no_grad():  # adapters far from zero: their share of K and V is visible in the amax
        for n, p in trainer.model.named_parameters():
            if n.endswith("lora_B.weight"):
                p.normal_(0, 0.5)
    recipe = recipe_for_role("fp8_e2e", "calibrator", kv_cache_dtype="fp8", batch_invariant=True)
    cal = CalibrationModel(base, recipe, lora=LORA)
    cal.load_weights(1, trainer.state_dict())
    with_adapters = QKVCalibrator(cal.model, pad_token_id=0).calibrate(1, prompts)
    assert with_adapters == _scales(trainer, prompts, 1)  # the same numbers as the trainer's own model (invariant)
    plain = CalibrationModel(base, recipe)
    plain.load_weights(1, {n: t for n, t in trainer.state_dict().items() if not is_adapter(n)})
    assert QKVCalibrator(plain.model, pad_token_id=0).calibrate(1, prompts) != with_adapters


def test_checkpoints_hold_the_adapters_and_refuse_another_base(base, prompts, tmp_path):
    trainer, engine = _engines(base, "fp8_e2e", "auto")
    trainer.train_step(_batch(engine, prompts, 3))
    path = str(tmp_path / "lora.pt")
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    assert set(saved["model"]) == set(trainer.state_dict(adapters_only=True))  # adapters only, no base
    assert saved["lora"]["rank"] == LORA.rank and len(saved["lora"]["base_checksum"]) == 32

    again, _ = _engines(base, "fp8_e2e", "auto")
    again.load_checkpoint(path)
    assert again.version == 1
    for n, t in trainer.state_dict().items():
        assert torch.equal(again.state_dict()[n], t), n
    b = _batch(engine, prompts, 5)
    trainer.train_step(b)
    again.train_step(b)
    assert all(torch.equal(again.state_dict()[n], t) for n, t in trainer.state_dict().items())  # AdamW resumed

    other = CausalLM(base.config)
    other.load_state_dict(base.state_dict())
    with torch.no_grad():
        other.model.norm.weight.add_(1e-3)  # one tensor of the base differs
    foreign, _ = _engines(other, "fp8_e2e", "auto")
    with pytest.raises(ValueError, match="another base model"):
        foreign.load_checkpoint(path)
    full = TorchTrainer(base, trainer.recipe, TrainerConfig())
    with pytest.raises(ValueError, match="holds LoRA adapters, this trainer trains every weight"):
        full.load_checkpoint(path)
    wider, _ = _engines(base, "fp8_e2e", "auto", lora=LoraSettings(rank=8, alpha=8.0))
    with pytest.raises(ValueError, match="policy.lora.rank"):
        wider.load_checkpoint(path)


@pytest.mark.parametrize("scaling", ["blockwise", "tensorwise", "mxfp8"])
def test_the_trainer_keeps_the_frozen_base_in_fp8_only_with_the_same_numbers(base, scaling):
    """What a LoRA trainer keeps of its base: each FP8 linear's E4M3 weight + scales, no high-precision master
    (mxfp8 keeps its master: its dgrad quantizes the weight along N from it); the logits and the adapters' gradients
    are bitwise those of the same model whose base keeps its masters."""
    import copy

    from fp8rl.fp8 import Fp8Linear, convert_model
    from fp8rl.fp8.quant import E4M3
    from fp8rl.model.lora import apply_lora

    recipe = recipe_for_role("fp8_e2e", "trainer", scaling=scaling)
    trainer = TorchTrainer(base, recipe, TrainerConfig(lora=LORA))
    layers = [m for m in trainer.model.modules() if isinstance(m, Fp8Linear)]
    assert layers
    if scaling == "mxfp8":
        assert not any(m.frozen_fp8 for m in layers)
    else:
        assert all(m.frozen_fp8 and m.weight.dtype == E4M3 and "weight" in m._buffers for m in layers)
        params = dict(trainer.model.named_parameters())
        assert not any(n.endswith(("proj.weight",)) for n in params)  # no master of any projection
    kept = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    masters = sum(m.weight.numel() for m in layers) * 4
    assert kept == (masters if scaling == "mxfp8" else masters // 4)

    plain = convert_model(copy.deepcopy(base), recipe, mode="train")  # the same model, masters kept
    apply_lora(plain, LORA)
    with torch.no_grad():
        theirs = dict(trainer.model.named_parameters())
        for n, p in plain.named_parameters():
            if n.endswith("lora_B.weight"):
                theirs[n].normal_(0, 0.05)
            if "lora_" in n:
                p.copy_(theirs[n])
    ids = torch.randint(3, 97, (3, 11), generator=torch.Generator().manual_seed(2))
    g = torch.randn(3, 11, 97, generator=torch.Generator().manual_seed(3))
    outs = []
    for m in (trainer.model, plain):
        logits = m(ids)
        (logits.float() * g).sum().backward()
        outs.append((logits.detach(), {n: p.grad for n, p in m.named_parameters() if "lora_" in n}))
    assert torch.equal(outs[0][0], outs[1][0])
    assert outs[0][1].keys() == outs[1][1].keys()
    assert all(torch.equal(outs[0][1][n], outs[1][1][n]) for n in outs[0][1])


def _moe():
    """A small Qwen3-MoE (2 layers of 4 experts, top 2), O(1) weights."""
    torch.manual_seed(6)
    cfg = tiny_config(architecture="qwen3_moe", vocab_size=97, hidden_size=128, intermediate_size=256,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_hidden_layers=2, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True)
    m = CausalLM(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) / p.shape[-1] ** 0.5)
    return m.eval()


SHARED = LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "gate_proj", "up_proj", "down_proj"),
                      share_experts=True)


def test_experts_sharing_adapters_hold_one_per_projection_and_compute_per_expert_adapters_set_alike(prompts):
    """share_experts: every expert of a layer carries the same adapter parameters (one per projection, named under
    expert 0); the model computes what per-expert adapters all set to those values compute (bitwise), and the
    shared adapter's gradient is the sum of the per-expert ones (FP32 summation order only). A dense model has
    nothing to share: refused by name."""
    import dataclasses

    from fp8rl.model.lora import apply_lora, lora_parameters, lora_state_dict

    shared, each = _moe(), _moe()
    apply_lora(shared, SHARED)
    apply_lora(each, dataclasses.replace(SHARED, share_experts=False))
    names = [n for n, _ in lora_parameters(shared)]
    experts = [n for n in names if ".experts." in n]
    assert experts and all(".experts.0." in n for n in experts) and len(experts) == 2 * 3 * 2  # A, B × 3 × 2 layers
    assert len(lora_state_dict(each)) - len(lora_state_dict(shared)) == 3 * len(experts)  # 4 experts: 3 copies fewer
    layer = shared.model.layers[0].mlp.experts
    assert all(e.gate_proj.lora_A is layer[0].gate_proj.lora_A for e in layer)
    with torch.no_grad():
        for _, p in lora_parameters(shared):
            p.normal_(0, 0.05)
        mine = dict(lora_parameters(shared))
        for n, p in lora_parameters(each):
            p.copy_(mine[re.sub(r"\.experts\.\d+\.", ".experts.0.", n)])
    ids = torch.tensor([p[:7] + [5] * (7 - len(p[:7])) for p in prompts])
    a, b = shared(ids), each(ids)
    assert torch.equal(a, b)
    a.square().mean().backward()
    b.square().mean().backward()
    g_each = dict(lora_parameters(each))
    for n, p in lora_parameters(shared):
        if ".experts." not in n:
            assert torch.equal(p.grad, g_each[n].grad)
            continue
        total = sum(g_each[n.replace(".experts.0.", f".experts.{e}.")].grad for e in range(4))
        assert torch.allclose(p.grad, total, rtol=1e-5, atol=1e-7 * float(total.abs().max())), n
    with pytest.raises(ValueError, match="share_experts: no mixture-of-experts expert projection"):
        apply_lora(CausalLM(tiny_config()), SHARED)


@pytest.mark.parametrize("recipe,kv", [("fp8_e2e", "auto")])
def test_shared_expert_adapters_train_refit_alone_and_keep_the_rollout_bitwise(prompts, recipe, kv):
    """Shared adapters through the engines: a whole refit (base and adapters) and an adapters-only one name each
    shared adapter once (expert 0's names, no per-expert copies); a train step moves them, and the rollout's logprobs
    stay the trainer's bitwise."""
    base = _moe()
    trainer, engine = _engines(base, recipe, kv, SHARED, lr=5e-2)
    whole = trainer.state_dict()
    assert not any(".experts.1." in n and is_adapter(n) for n in whole)
    engine.load_weights(0, whole, None)  # the first refit: the base with the adapters
    before = {n: t.clone() for n, t in trainer.state_dict(adapters_only=True).items()}
    trainer.train_step(_batch(engine, prompts, 3))
    payload = trainer.state_dict(adapters_only=True)
    assert payload.keys() == before.keys() and not any(".experts.1." in n for n in payload)
    assert any(".experts.0." in n and not torch.equal(t, before[n]) for n, t in payload.items())
    engine.load_weights(1, payload, None)
    batch = _batch(engine, prompts, 4)
    mask = batch.loss_mask.bool()
    got, want = trainer.compute_logprobs(batch)[mask], batch.gen_logprobs[mask]
    assert got.numel() > 50 and torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} differ"
