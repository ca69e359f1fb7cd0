"""CausalLM numerics: equal to transformers' Llama / Qwen2 / Qwen3 on the same weights, KV-cache
decoding equal to the full forward, FP8 KV behaviour, and the qkv_point calibration contract."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from fp8rl.fp8.kv import calibrated_scale
from fp8rl.model import CausalLM, KVCache, ModelConfig, load_hf_checkpoint

# FP32 throughout; the two implementations differ only in op order (matmul vs elementwise RoPE
# angles, where the float casts happen), so a few ulps of O(1) logits.
ATOL_HF = 1e-4
# Cached vs full forward: same ops on differently shaped batches.
ATOL_CACHE = 1e-5
# FP8 K/V (3 mantissa bits) + FP8 Q and probabilities: logits move by a few % of their range.
FP8_KV_REL_BOUND = 0.1
# A k_scale 1000x too small saturates K at ±448·scale: the error must be far above the good one.
FP8_BAD_FACTOR = 5.0

HF_CLASSES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # head_dim 16: wavelengths 6.3 (kept), 19.9 and 62.8 (blended), >= 199 (divided by factor)
    "original_max_position_embeddings": 64,
}
CASES = {
    "llama_gqa": ("llama", dict(num_key_value_heads=2)),
    "llama3_rope_tied": (
        "llama",
        dict(num_key_value_heads=4, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True),
    ),
    "qwen2_bias_mqa": ("qwen2", dict(num_key_value_heads=1)),
    "qwen3_qknorm_head_dim": ("qwen3", dict(num_key_value_heads=2, head_dim=24)),
}


def _scramble(model: torch.nn.Module) -> None:
    """Re-draw weights at O(1) activations scale (default 0.02 init makes logits ~0 and attention uniform)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))


def _hf_model(arch: str, **kw):
    cfg_cls, model_cls = HF_CLASSES[arch]
    base = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
    )
    cfg = cfg_cls(**{**base, **kw})
    cfg._attn_implementation = "eager"
    model = model_cls(cfg).eval()
    _scramble(model)
    return model


def _ours(arch: str = "llama", **kw) -> CausalLM:
    base = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = CausalLM(ModelConfig(arch, **{**base, **kw})).eval()
    _scramble(model)
    return model


def _left_padded(batch: int = 3, t: int = 12, vocab: int = 97) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (batch, t))
    mask = torch.ones(batch, t, dtype=torch.long)
    for row, pad in enumerate([0, 3, 5][:batch]):
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids, mask


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    torch.manual_seed(0)
    arch, kw = CASES[case]
    hf = _hf_model(arch, **kw)
    hf.save_pretrained(tmp_path)
    ours, cfg = load_hf_checkpoint(tmp_path)
    assert set(ours.state_dict()) >= {k for k in hf.state_dict() if "rotary" not in k}
    assert cfg.rope_scaling is None or cfg.rope_scaling["rope_type"] == "llama3"

    ids = torch.randint(0, 97, (2, 40))  # past original_max_position_embeddings/4: every RoPE band used
    with torch.no_grad():
        want = hf(ids).logits.float()
        got = ours(ids)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert want.abs().max() > 1.0  # the comparison is not between near-zero logits
    torch.testing.assert_close(got, want, atol=ATOL_HF, rtol=0)


def test_llama3_rope_differs_from_plain_rope(tmp_path):
    """Negative case: dropping the llama3 frequency adjustment must be visible at ATOL_HF."""
    torch.manual_seed(0)
    hf = _hf_model("llama", **CASES["llama3_rope_tied"][1])
    hf.save_pretrained(tmp_path)
    ours, cfg = load_hf_checkpoint(tmp_path)
    plain = CausalLM(ModelConfig(**{**cfg.__dict__, "rope_scaling": None})).eval()
    plain.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 97, (1, 40))
    with torch.no_grad():
        assert (plain(ids) - hf(ids).logits).abs().max() > 100 * ATOL_HF


def test_left_padding_matches_transformers(tmp_path):
    torch.manual_seed(1)
    hf = _hf_model("qwen3", num_key_value_heads=2)
    hf.save_pretrained(tmp_path)
    ours, _ = load_hf_checkpoint(tmp_path)
    ids, mask = _left_padded()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, position_ids=pos).logits
        got = ours(ids, attention_mask=mask)  # default position_ids are the same cumsum
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], atol=ATOL_HF, rtol=0)
    # a left-padded row equals the same prompt run unpadded
    with torch.no_grad():
        alone = ours(ids[1:2, 3:])
    torch.testing.assert_close(got[1, 3:], alone[0], atol=ATOL_CACHE, rtol=0)


def _decode_incrementally(model, ids, mask, prefill: int, cache: KVCache) -> torch.Tensor:
    out = [model(ids[:, :prefill], attention_mask=mask[:, :prefill], kv_cache=cache)]
    for t in range(prefill, ids.shape[1]):
        out.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], kv_cache=cache))
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_kv_cache_decoding_equals_full_forward(arch):
    torch.manual_seed(2)
    model = _ours(arch)
    ids, mask = _left_padded()
    cache = KVCache.for_model(model, batch_size=3, max_len=16)
    assert cache.dtype(0) == torch.float32
    with torch.no_grad():
        full = model(ids, attention_mask=mask)
        inc = _decode_incrementally(model, ids, mask, prefill=6, cache=cache)
    assert cache.length == ids.shape[1]
    keep = mask.bool()
    torch.testing.assert_close(inc[keep], full[keep], atol=ATOL_CACHE, rtol=0)

    # no mask: plain positions arange(L, L + T)
    cache.reset()
    with torch.no_grad():
        full = model(ids[:1].repeat(3, 1))
        inc = _decode_incrementally(model, ids[:1].repeat(3, 1), torch.ones_like(mask), 4, cache)
    torch.testing.assert_close(inc, full, atol=ATOL_CACHE, rtol=0)


def test_kv_cache_overflow_and_shape_errors():
    torch.manual_seed(3)
    model = _ours()
    cache = KVCache.for_model(model, batch_size=2, max_len=8)
    with torch.no_grad():
        model(torch.zeros(2, 6, dtype=torch.long), kv_cache=cache)
        with pytest.raises(RuntimeError, match="overflow.*max_len=8"):
            model(torch.zeros(2, 3, dtype=torch.long), kv_cache=cache)
        assert cache.length == 6  # the failed call wrote nothing
        with pytest.raises(ValueError, match="batch size 2"):
            model(torch.zeros(3, 1, dtype=torch.long), kv_cache=cache)
        with pytest.raises(ValueError, match=r"attention_mask must be \(B, S\) = \(2, 7\)"):
            model(torch.zeros(2, 1, dtype=torch.long), attention_mask=torch.ones(2, 1), kv_cache=cache)


def _calibrate(model: CausalLM, ids: torch.Tensor) -> list[tuple[float, float, float]]:
    """Per-layer Q/K/V amax read through the qkv_point hooks, turned into scales."""
    amax: dict[int, list[float]] = {}
    hooks = [
        layer.self_attn.qkv_point.register_forward_hook(
            lambda mod, args, out, i=i: amax.__setitem__(i, [float(t.abs().max()) for t in out])
        )
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return [tuple(calibrated_scale(a) for a in amax[i]) for i in range(model.num_layers)]


def test_fp8_kv_bounded_change_and_wrong_scale_fails():
    torch.manual_seed(4)
    model = _ours("qwen3")
    ids = torch.randint(0, 97, (2, 16))
    scales = _calibrate(model, ids)
    with torch.no_grad():
        ref = model(ids)
    quants = model.enable_fp8_kv(fp8_attention=True)
    assert len(quants) == model.num_layers
    for quant, (q, k, v) in zip(quants, scales, strict=True):
        quant.set_scales(q, k, v, version=0)
    with torch.no_grad():
        fp8 = model(ids)
    err_good = float((fp8 - ref).abs().max())
    assert 0 < err_good <= FP8_KV_REL_BOUND * float(ref.abs().max())

    # the FP8 cache holds E4M3 and decoding through it reproduces the full FP8 forward
    cache = KVCache.for_model(model, batch_size=2, max_len=16)
    assert all(k.dtype == torch.float8_e4m3fn for k in cache.k + cache.v)
    with torch.no_grad():
        inc = _decode_incrementally(model, ids, torch.ones_like(ids), prefill=10, cache=cache)
    torch.testing.assert_close(inc, fp8, atol=ATOL_CACHE, rtol=0)

    # negative case: a k_scale 1000x too small clips K and wrecks the logits
    q, k, v = scales[0]
    quants[0].set_scales(q, k / 1000, v, version=0)
    with torch.no_grad():
        bad = model(ids)
    assert float((bad - ref).abs().max()) > FP8_BAD_FACTOR * err_good

    model.disable_fp8_kv()
    assert model.kv_quantizers == []
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref, atol=0, rtol=0)
    # a cache built for FP8 must not silently serve a BF16/FP32 model
    with pytest.raises(RuntimeError, match="rebuild the cache"), torch.no_grad():
        model(ids[:, :1], kv_cache=KVCache(model.num_layers, 2, 2, 4, 16, dtype=torch.float8_e4m3fn))


def test_qkv_point_sees_post_rope_q_k_v():
    torch.manual_seed(5)
    model = _ours("qwen3", head_dim=8)
    B, T, H, Hkv, D = 2, 5, 4, 2, 8
    ids = torch.randint(0, 97, (B, T))
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    seen = {}
    model.model.layers[0].self_attn.qkv_point.register_forward_hook(lambda m, a, out: seen.update(qkv=out))
    with torch.no_grad():
        model(ids, position_ids=pos)
    q, k, v = seen["qkv"]
    assert q.shape == (B, H, T, D) and k.shape == (B, Hkv, T, D) and v.shape == (B, Hkv, T, D)

    # manual recomputation of q in float64: QK-norm, then RoPE pairs (j, j + D/2) rotated by pos * theta_j
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        h = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
        x = attn.q_norm(attn.q_proj(h).view(B, T, H, D)).double()  # (B, T, H, D)
    theta = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    ang = pos.double()[:, :, None, None] * theta  # (B, T, 1, D/2)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    want = torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], dim=-1)
    torch.testing.assert_close(q.double(), want.transpose(1, 2), atol=1e-5, rtol=0)
    # negative: without RoPE the hooked q would differ
    assert (x.transpose(1, 2) - q.double()).abs().max() > 0.1


def test_config_validation():
    with pytest.raises(ValueError, match="divide num_attention_heads=4"):
        ModelConfig("llama", 97, 64, 96, 2, 4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        ModelConfig("gpt2", 97, 64, 96, 2, 4)
    with pytest.raises(ValueError, match="only qwen3/qwen3_moe/qwen3_vl have q_norm"):
        ModelConfig("llama", 97, 64, 96, 2, 4, qk_norm=True)
    with pytest.raises(ValueError, match="llama3 rope_scaling lacks"):
        ModelConfig("llama", 97, 64, 96, 2, 4, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    cfg = ModelConfig("qwen2", 97, 64, 96, 2, 4)
    assert cfg.attention_bias and not cfg.o_proj_bias and cfg.head_dim == 16 and cfg.num_key_value_heads == 4
