"""HF <-> Megatron layout: exact round trips, the fused layouts written out by hand, and refusals."""

from __future__ import annotations

import pytest
import torch

from fp8rl.engines.megatron import gate_up_rows, hf_to_megatron, megatron_names, megatron_to_hf, qkv_rows

from .conftest import make_policy, model_config

pytestmark = pytest.mark.megatron


def _hf(kind: str) -> dict[str, torch.Tensor]:
    sd = dict(make_policy(kind).state_dict())
    if model_config(kind).tie_word_embeddings:
        sd.pop("lm_head.weight")
    return sd


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("fused_norms", [False, True])
def test_round_trip_is_bit_exact(kind, fused_norms):
    hf = _hf(kind)
    mg = hf_to_megatron(hf, model_config(kind), fused_norms=fused_norms)
    assert set(mg) == megatron_names(model_config(kind), fused_norms=fused_norms)
    back = megatron_to_hf(mg, model_config(kind), fused_norms=fused_norms)
    assert set(back) == set(hf)
    for k, v in hf.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_fused_qkv_is_grouped_by_kv_head():
    """The layout written out by hand: per KV group g, its query heads, then K head g, then V head g."""
    cfg = model_config("llama")  # 4 query heads, 2 KV heads, head_dim 64
    hf = _hf("llama")
    mg = hf_to_megatron(hf, cfg)
    p = "model.layers.1.self_attn."
    q, k, v = (hf[p + f"{n}_proj.weight"].view(-1, 64, cfg.hidden_size) for n in "qkv")  # (heads, D, C)
    expected = torch.cat([q[0], q[1], k[0], v[0], q[2], q[3], k[1], v[1]])
    assert torch.equal(mg["decoder.layers.1.self_attention.linear_qkv.weight"], expected)
    qi, ki, vi = qkv_rows(cfg)
    assert torch.equal(torch.sort(torch.cat([qi, ki, vi])).values, torch.arange(4 * 64 + 2 * 2 * 64))


def test_fused_qkv_bias_and_gate_up():
    cfg = model_config("qwen2")  # 4 query heads on 1 KV head, head_dim 32, q/k/v bias
    hf = _hf("qwen2")
    mg = hf_to_megatron(hf, cfg)
    p = "model.layers.0."
    bq, bk, bv = (hf[p + f"self_attn.{n}_proj.bias"] for n in "qkv")
    assert torch.equal(mg["decoder.layers.0.self_attention.linear_qkv.bias"], torch.cat([bq, bk, bv]))
    fc1 = mg["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]))
    gate, up = gate_up_rows(cfg)
    assert torch.equal(fc1[up], hf[p + "mlp.up_proj.weight"])
    assert "output_layer.weight" not in mg  # tied: Megatron shares the embedding


def test_missing_unknown_and_misshapen_tensors_are_refused():
    cfg, hf = model_config("llama"), _hf("llama")
    with pytest.raises(ValueError, match="missing"):
        hf_to_megatron({k: v for k, v in hf.items() if "k_proj" not in k}, cfg)
    with pytest.raises(ValueError, match="unknown"):
        hf_to_megatron({**hf, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)}, cfg)
    bad = dict(hf)
    bad["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(64, cfg.hidden_size)
    with pytest.raises(ValueError, match="v_proj"):
        hf_to_megatron(bad, cfg)
    mg = hf_to_megatron(hf, cfg)
    with pytest.raises(ValueError, match="missing"):
        megatron_to_hf({k: v for k, v in mg.items() if "linear_fc2" not in k}, cfg)
