"""The DeepSeek-V3 / Moonlight family (issue 34, first piece): ``deepseek_v3`` checkpoints made by transformers load
into fp8rl and give transformers' own logits; the latent KV cache decodes bitwise like the full forward under batch
invariance, in the absorbed form (the default) and the expanded one, which agree within their bound; the routing
rule (sigmoid, a selection-only bias, group-limited top-k, scaled weights) is DeepSeek's.

transformers' ``DeepseekV3ForCausalLM`` is the reference (random-init, scaled down from the Moonlight shape family:
MLA with and without ``q_lora_rank``, dense first layers, shared experts, ``n_group`` > 1); nothing downloads.
"""

from __future__ import annotations

import pytest
import torch

from fp8rl.engines.base import SamplingParams
from fp8rl.engines.batch import build_train_batch
from fp8rl.engines.torch_rollout import TorchRolloutEngine
from fp8rl.engines.torch_trainer import TorchTrainer, TrainerConfig
from fp8rl.fp8 import Fp8Linear, recipe_for_role
from fp8rl.fp8.convert import convert_model
from fp8rl.fp8.linear import weight_as_computed
from fp8rl.model import KVCache, ModelConfig, load_hf_checkpoint, save_hf_checkpoint
from fp8rl.model.mla import MLAttention, set_absorbed
from fp8rl.model.router import RoutingRule, TopKRouter

from .test_transformer import ATOL_HF

transformers = pytest.importorskip("transformers")


def _reference(q_lora_rank=None, rope_interleave=True, n_group=2, topk_group=1, seed=0):
    """transformers' model of a small Moonlight-shaped config, its correction bias randomized (it is zero at
    init, which would hide a bias used for the weights instead of the choice)."""
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(
        vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=n_group, topk_group=topk_group, first_k_dense_replace=1, q_lora_rank=q_lora_rank, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=64,
        routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=rope_interleave, rope_theta=50000.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    ref = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, b in ref.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.2)
    return ref


def _load(ref, tmp_path):
    ref.save_pretrained(tmp_path / "hf")
    model, cfg = load_hf_checkpoint(tmp_path / "hf")
    return model.eval(), cfg


@pytest.mark.parametrize("q_lora_rank,rope_interleave,n_group,topk_group",
                         [(None, True, 2, 1), (24, True, 4, 2), (24, False, 1, 1)])
def test_logits_equal_transformers(tmp_path, q_lora_rank, rope_interleave, n_group, topk_group):
    ref = _reference(q_lora_rank, rope_interleave, n_group, topk_group)
    model, cfg = _load(ref, tmp_path)
    assert cfg.is_mla and cfg.moe_layers == [1, 2] and cfg.head_dim == 8 and cfg.q_lora_rank == q_lora_rank
    ids = torch.randint(3, 100, (3, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
        got = model(ids)
    torch.testing.assert_close(got, want, atol=ATOL_HF, rtol=0)
    # and back: fp8rl's save is transformers' checkpoint (config keys and per-expert names)
    save_hf_checkpoint(model, cfg, tmp_path / "ours")
    again = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, want, atol=ATOL_HF, rtol=0)


def test_the_correction_bias_chooses_experts_and_never_weighs_them():
    """DeepSeek's rule: the bias moves which experts are chosen; their weights come from the unbiased sigmoid
    scores, renormalised and scaled by routed_scaling_factor."""
    r = TopKRouter(16, 8, RoutingRule(2, True, scoring="sigmoid", n_group=2, topk_group=1, routed_scaling_factor=2.5))
    with torch.no_grad():
        r.weight.normal_(0, 0.3)
    x = torch.randn(50, 16)
    ids0, w0 = r(x)
    with torch.no_grad():
        r.e_score_correction_bias[5] = 10.0  # expert 5 (group 1) always wins its group and the choice
    ids1, w1 = r(x)
    assert bool((ids1 == 5).any(-1).all()) and not bool((ids0 == 5).any(-1).all())
    scores = torch.sigmoid(x @ r.weight.t())
    picked = scores.gather(1, ids1)
    # the router's sigmoid is softmax([x, 0])[0] (batch-invariant): the same function to a few FP32 ulps (2**-24
    # each) through the exp, the sum and the division; 2**-20 allows 16
    torch.testing.assert_close(w1, picked / (picked.sum(-1, keepdim=True) + 1e-20) * 2.5, rtol=2.0**-20, atol=0)
    assert bool((ids1 >= 4).all())  # topk_group 1: both experts from the winning group
    assert "e_score_correction_bias" in r.state_dict() and not any(
        "bias" in n for n, _ in r.named_parameters())  # a buffer: no gradient, shipped with the weights


def test_the_latent_cache_holds_what_mla_compresses(tmp_path):
    _, cfg = _load(_reference(), tmp_path)
    model, _ = load_hf_checkpoint(tmp_path / "hf")
    cache = KVCache.for_model(model, batch_size=2, max_len=10)
    assert cache.k[0].shape == (2, 1, 11, cfg.kv_lora_rank) and cache.v[0].shape == (2, 1, 11, cfg.qk_rope_head_dim)
    per_token = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert per_token < cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)  # 40 vs 4 * (24 + 16)


@pytest.mark.parametrize("recipe,absorb", [("bf16", True), ("fp8_e2e", True), ("fp8_e2e", False)])
def test_rollout_decode_is_bitwise_the_trainers_forward(tmp_path, recipe, absorb):
    """Batch invariance on MLA: the rollout decodes through the latent cache (absorbed: attending over the cached
    latents; expanded: each step expands every cached latent through kv_b_proj), the trainer recomputes the whole
    sequences in the same form; the logprobs are equal bit for bit. Every MLA and expert linear is FP8 in fp8_e2e;
    the router and its bias stay FP32 and the bias is not trained."""
    model, _ = _load(_reference(24), tmp_path)
    assert set_absorbed(model, absorb) == 3
    rr = recipe_for_role(recipe, "rollout", batch_invariant=True)
    tr = recipe_for_role(recipe, "trainer", batch_invariant=True)
    engine = TorchRolloutEngine(model, rr, eos_token_ids=[2], max_batch_size=3)
    trainer = TorchTrainer(model, tr, TrainerConfig(micro_batch_size=5, lr=1e-2))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (2, 9, 5, 14)]
    samples = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=12, n=2, seed=4))
    batch = build_train_batch(samples, torch.tensor([(-1.0) ** i for i in range(len(samples))]), 2, 0)
    mask = batch.loss_mask.bool()
    got, want = trainer.compute_logprobs(batch)[mask], batch.gen_logprobs[mask]
    assert got.numel() > 40
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} logprobs differ"
    if recipe == "fp8_e2e":
        fp8 = {n.rsplit(".", 1)[-1] for n, m in trainer.model.named_modules() if isinstance(m, Fp8Linear)}
        assert {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj"} <= fp8
    bias = {n: b.clone() for n, b in trainer.model.named_buffers() if n.endswith("e_score_correction_bias")}
    trainer.train_step(batch)
    assert bias and all(torch.equal(b, dict(trainer.model.named_buffers())[n]) for n, b in bias.items())


def _logits_and_grads(model, ids):
    model.zero_grad()
    logits = model(ids)
    (logits.float().square().mean()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_absorbed_form_is_the_expanded_one_reassociated():
    """Without FP8 the two forms are the same sums in another order: logits within the FP32 op-order bound of
    ``ATOL_HF``, and every gradient (kv_b_proj's through both of its halves) within ``ATOL_HF`` of its largest
    entry's scale. The absorbed layers really compute another form (the query is r + p wide there)."""
    ref = _reference(24)
    model = _load_in_memory(ref)
    ids = torch.randint(3, 100, (3, 13), generator=torch.Generator().manual_seed(1))
    seen = []
    hook = model.model.layers[0].self_attn.qkv_point.register_forward_hook(lambda m, a, o: seen.append(o[0].shape[-1]))
    got, g_abs = _logits_and_grads(model, ids)
    set_absorbed(model, False)
    want, g_exp = _logits_and_grads(model, ids)
    hook.remove()
    cfg = model.config
    assert seen == [cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim]
    assert torch.allclose(got, want, atol=ATOL_HF, rtol=0), (got - want).abs().max()
    assert set(g_abs) == set(g_exp) and any("kv_b_proj" in n for n in g_abs)
    for n, g in g_abs.items():
        scale = g_exp[n].abs().max().clamp_min(1e-30)
        assert torch.allclose(g, g_exp[n], atol=ATOL_HF * float(scale), rtol=0), n


def test_the_engines_compute_the_form_their_recipe_names(tmp_path):
    model, _ = _load(_reference(24), tmp_path)
    for absorbed in (True, False):
        rr = recipe_for_role("fp8_e2e", "rollout", batch_invariant=True, mla_absorbed=absorbed)
        engine = TorchRolloutEngine(model, rr, eos_token_ids=[2], max_batch_size=2)
        trainer = TorchTrainer(model, recipe_for_role("fp8_e2e", "trainer", mla_absorbed=absorbed), TrainerConfig())
        for m in (engine.model, trainer.model):
            assert {a.absorb for a in m.modules() if isinstance(a, MLAttention)} == {absorbed}


def _load_in_memory(ref):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        ref.save_pretrained(Path(d))
        return load_hf_checkpoint(Path(d))[0]


def test_in_fp8_the_forms_differ_by_the_latents_e4m3_rounding_alone():
    """fp8_e2e linears: the absorbed form multiplies the unrounded latent by kv_b_proj's dequantized FP8 weight. So
    it equals — within the FP32 op-order bound — the expanded form whose kv_b_proj is a high-precision linear
    holding exactly that dequantized weight; the FP8 expanded form, which rounds the latent to E4M3 (1×128) as the
    linear's input, differs from it by more (the control: that rounding is the whole difference). The trainer's
    gradient reaches kv_b_proj's master weight (straight through its FP8 form)."""
    import copy

    ref = _reference(24)
    fp8 = convert_model(_load_in_memory(ref), recipe_for_role("fp8_e2e", "trainer"))
    ids = torch.randint(3, 100, (3, 13), generator=torch.Generator().manual_seed(1))
    absorbed, grads = _logits_and_grads(fp8, ids)
    assert all(grads[f"model.layers.{i}.self_attn.kv_b_proj.weight"].abs().sum() > 0 for i in range(3))
    unrounded = copy.deepcopy(fp8)
    set_absorbed(unrounded, False)
    for m in unrounded.modules():
        if isinstance(m, MLAttention):
            lin = torch.nn.Linear(m.kv_b_proj.in_features, m.kv_b_proj.out_features, bias=False)
            with torch.no_grad():
                lin.weight.copy_(weight_as_computed(m.kv_b_proj))
            m.kv_b_proj = lin
    set_absorbed(fp8, False)
    with torch.no_grad():
        same, rounded = unrounded(ids), fp8(ids)
    assert torch.allclose(absorbed, same, atol=ATOL_HF, rtol=0), (absorbed - same).abs().max()
    assert (absorbed - rounded).abs().max() > 10 * ATOL_HF


def test_the_fp8_latent_cache_decodes_bitwise_like_the_trainer_with_calibrated_scales(tmp_path):
    """FP8 KV for MLA: the cache holds the latent and the rotary key in E4M3 with their per-tensor scales (the
    QKVScales' k and v); the calibrator measures exactly those tensors; the rollout's decode through the E4M3 cache
    and the trainer's fake-quantized passes give the same logprobs bit for bit. Negative control: the trainer with
    another latent scale does not."""
    import dataclasses

    from fp8rl.engines.calibrator import QKVCalibrator
    from fp8rl.fp8.kv import calibrated_scale
    from fp8rl.fp8.quant import E4M3

    model, cfg = _load(_reference(24), tmp_path)
    rr = recipe_for_role("fp8_e2e", "rollout", kv_cache_dtype="fp8", batch_invariant=True)
    tr = recipe_for_role("fp8_e2e", "trainer", kv_cache_dtype="fp8", batch_invariant=True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (2, 9, 5, 14)]

    # the calibrator's k / v scales are the latent's and the rotary key's amax (one pass: the max over real tokens)
    seen = {"c": [], "pe": []}
    attn = model.model.layers[1].self_attn
    hooks = [attn.kv_a_layernorm.register_forward_hook(lambda m, a, o: seen["c"].append(o.abs().max())),
             attn.kv_a_proj_with_mqa.register_forward_hook(
                 lambda m, a, o: seen["pe"].append(o[..., cfg.kv_lora_rank:].abs().max()))]
    scales = QKVCalibrator(model, pad_token_id=0, max_sequences=1).calibrate(0, prompts[3:])
    for h in hooks:
        h.remove()
    assert scales.k[1] == pytest.approx(calibrated_scale(float(seen["c"][0])), rel=1e-6)
    # the rotary key's amax: RoPE rotates pairs, so its amax is bounded by the pair norms, not equal to the
    # pre-RoPE amax; it must lie within sqrt(2) of it
    pre = calibrated_scale(float(seen["pe"][0]))
    assert pre / 2 ** 0.5 <= scales.v[1] <= pre * 2 ** 0.5

    engine = TorchRolloutEngine(model, rr, eos_token_ids=[2], max_batch_size=3)
    trainer = TorchTrainer(model, tr, TrainerConfig(micro_batch_size=5))
    engine.load_scales(scales)
    trainer.load_qkv_scales(scales)
    assert engine.model.model.layers[0].self_attn.kv_quant is not None
    samples = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=12, n=2, seed=4))
    batch = build_train_batch(samples, torch.zeros(len(samples)), 2, 0)
    mask = batch.loss_mask.bool()
    got, want = trainer.compute_logprobs(batch)[mask], batch.gen_logprobs[mask]
    assert got.numel() > 40
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} logprobs differ"
    cache = KVCache.for_model(engine.model, batch_size=1, max_len=4)
    assert cache.k[0].dtype == E4M3 and cache.k[0].shape[-1] == cfg.kv_lora_rank  # r + p bytes per token and layer

    other = dataclasses.replace(scales, k=[x * 1.5 for x in scales.k])
    trainer.load_qkv_scales(other)
    assert not torch.equal(trainer.compute_logprobs(batch)[mask], want)


def test_configs_the_family_does_not_compute_are_refused():
    base = transformers.DeepseekV3Config(n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
                                         q_lora_rank=None).to_dict()
    ModelConfig.from_hf_dict(base)
    with pytest.raises(ValueError, match="scoring_func 'softmax'"):
        ModelConfig.from_hf_dict({**base, "scoring_func": "softmax"})
    with pytest.raises(ValueError, match="n_group=3 must divide"):
        ModelConfig.from_hf_dict({**base, "n_group": 3})


def test_routing_replay_covers_the_deepseek_router(tmp_path):
    """R3 on this family: the rollout records each token's experts in every MoE layer; the trainer replays them,
    weights gathered from its own sigmoid scores. Under batch invariance the replayed routes are the trainer's own
    (agreement 1, logprobs bitwise); replaying other experts changes the logprobs and the agreement says so."""
    model, cfg = _load(_reference(24), tmp_path)
    rr = recipe_for_role("fp8_e2e", "rollout", batch_invariant=True)
    tr = recipe_for_role("fp8_e2e", "trainer", batch_invariant=True)
    engine = TorchRolloutEngine(model, rr, eos_token_ids=[2], max_batch_size=3, record_routes=True)
    trainer = TorchTrainer(model, tr, TrainerConfig(micro_batch_size=5, router_replay=True))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (3, 8, 6)]
    samples = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=10, n=2, seed=6))
    assert samples[0].routes.shape[1:] == (2, 2)  # 2 MoE layers (first_k_dense_replace 1), top-2
    batch = build_train_batch(samples, torch.zeros(len(samples)), 2, 0, route_shape=cfg.route_shape)
    mask = batch.loss_mask.bool()
    assert torch.equal(trainer.compute_logprobs(batch)[mask], batch.gen_logprobs[mask])
    assert trainer.routing_metrics()["moe/router_agreement"] == 1.0
    forged = batch.routes.clone()
    real = forged >= 0
    forged[real] = (forged[real] + 1) % cfg.num_experts  # other experts, still valid ids
    batch.routes = forged
    assert not torch.equal(trainer.compute_logprobs(batch)[mask], batch.gen_logprobs[mask])
    assert trainer.routing_metrics()["moe/router_agreement"] < 1.0


def test_lora_on_mla_adapts_the_latent_projections_and_keeps_the_engines_bitwise(tmp_path):
    """Issue 33 on this family: the default targets find MLA's projections (and the experts'); the rollout's and the
    trainer's logprobs stay bitwise equal with trained adapters under batch invariance."""
    from fp8rl.model.lora import LoraSettings

    model, _ = _load(_reference(24), tmp_path)
    lora = LoraSettings(rank=4, alpha=8.0)
    rr = recipe_for_role("fp8_e2e", "rollout", batch_invariant=True)
    tr = recipe_for_role("fp8_e2e", "trainer", batch_invariant=True)
    trainer = TorchTrainer(model, tr, TrainerConfig(micro_batch_size=5, lr=2e-2, lora=lora))
    engine = TorchRolloutEngine(model, rr, eos_token_ids=[2], max_batch_size=3, lora=lora)
    adapted = {n.split(".")[-3] for n in trainer.state_dict(adapters_only=True)}
    assert {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "down_proj"} <= adapted
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (2, 9, 5)]
    batch = build_train_batch(engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=10, n=2, seed=4)),
                              torch.tensor([1.0, -1.0] * 3), 2, 0)
    trainer.train_step(batch)
    engine.load_weights(1, trainer.state_dict(adapters_only=True))
    batch = build_train_batch(engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=10, n=2, seed=5)),
                              torch.zeros(6), 2, 0)
    mask = batch.loss_mask.bool()
    assert torch.equal(trainer.compute_logprobs(batch)[mask], batch.gen_logprobs[mask])
