"""HF checkpoint I/O: save -> transformers round trip, strict name checks, sharded and tied files,
and the config.json mapping."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from fp8rl.model import CausalLM, ModelConfig, load_hf_checkpoint, save_hf_checkpoint
from fp8rl.model.family import family_names

# FP32 both sides: the implementations agree to a few ulps of O(1) logits.
ATOL_HF = 1e-4
# Loading into BF16: 8 mantissa bits on weights and activations of a 2-layer model.
ATOL_BF16 = 0.15


def _ours(arch: str = "llama", **kw) -> CausalLM:
    base = dict(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=1,
        eos_token_id=[2, 3],
    )
    model = CausalLM(ModelConfig(arch, **{**base, **kw})).eval()
    with torch.no_grad():  # O(1) activations so that the comparisons mean something
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    return model


@pytest.mark.parametrize(
    "arch,kw",
    [("llama", {}), ("qwen2", {"tie_word_embeddings": True}), ("qwen3", {"head_dim": 16})],
    ids=["llama_gqa", "qwen2_tied", "qwen3_head_dim"],
)
def test_save_then_transformers_from_pretrained(arch, kw, tmp_path):
    torch.manual_seed(0)
    ours = _ours(arch, **kw)
    save_hf_checkpoint(ours, ours.config, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == arch and cfg["architectures"][0].endswith("ForCausalLM")
    assert cfg["torch_dtype"] == "float32" and cfg["eos_token_id"] == [2, 3]

    hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(hf).__name__ == cfg["architectures"][0]
    ids = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits.float(), atol=ATOL_HF, rtol=0)

    # and back: load our own file, identical logits
    again, cfg2 = load_hf_checkpoint(tmp_path)
    assert cfg2 == ours.config
    with torch.no_grad():
        torch.testing.assert_close(again(ids), ours(ids), atol=0, rtol=0)


def test_tied_embeddings_are_omitted_and_retied(tmp_path):
    torch.manual_seed(1)
    ours = _ours(tie_word_embeddings=True)
    save_hf_checkpoint(ours, ours.config, tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    loaded, _ = load_hf_checkpoint(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_missing_tensor_is_named(tmp_path):
    torch.manual_seed(2)
    ours = _ours()
    save_hf_checkpoint(ours, ours.config, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf_checkpoint(tmp_path)


def test_unexpected_and_misshapen_tensors_are_named(tmp_path):
    torch.manual_seed(3)
    ours = _ours()
    save_hf_checkpoint(ours, ours.config, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)  # llama without attention_bias
    tensors["model.rotary_emb.inv_freq"] = torch.zeros(4)  # legacy buffer: silently ignored
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected 1 tensor\(s\): model\.layers\.0\.self_attn\.q_proj\.bias"):
        load_hf_checkpoint(tmp_path)

    del tensors["model.layers.0.self_attn.q_proj.bias"]
    tensors["model.norm.weight"] = torch.ones(31)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(31,\).*\(32,\)"):
        load_hf_checkpoint(tmp_path)


def test_missing_paths_raise_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_hf_checkpoint(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_ours().config.to_hf_dict()))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_hf_checkpoint(tmp_path)


def test_sharded_checkpoint_loads(tmp_path):
    torch.manual_seed(4)
    ours = _ours("qwen2")
    save_hf_checkpoint(ours, ours.config, tmp_path / "single")
    tensors = load_file(tmp_path / "single" / "model.safetensors")
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    (shard_dir / "config.json").write_text((tmp_path / "single" / "config.json").read_text())
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, shard_dir / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    loaded, _ = load_hf_checkpoint(shard_dir)
    ids = torch.randint(0, 61, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), ours(ids), atol=0, rtol=0)


def test_bf16_load_and_kv_quant_not_saved(tmp_path):
    torch.manual_seed(5)
    ours = _ours("qwen3")
    ours.enable_fp8_kv()
    save_hf_checkpoint(ours, ours.config, tmp_path)
    assert not any("kv_quant" in k for k in load_file(tmp_path / "model.safetensors"))
    ours.disable_fp8_kv()
    bf16, _ = load_hf_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    ids = torch.randint(0, 61, (2, 8))
    with torch.no_grad():
        got, want = bf16(ids), ours(ids)
    assert got.dtype == torch.float32
    err = float((got - want).abs().max())
    assert 0 < err <= ATOL_BF16


def test_hf_dict_mapping():
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = ModelConfig("llama", 61, 32, 48, 2, 4, rope_theta=500000.0, rope_scaling=llama3, tie_word_embeddings=True)
    d = cfg.to_hf_dict("bfloat16")
    assert d["rope_parameters"]["rope_theta"] == 500000.0 and d["rope_scaling"]["factor"] == 8.0
    assert ModelConfig.from_hf_dict(d) == cfg
    # transformers-4 layout: rope_theta + rope_scaling with the old "type" key
    legacy = {k: v for k, v in d.items() if k != "rope_parameters"}
    legacy["rope_scaling"] = {**{k: v for k, v in llama3.items() if k != "rope_type"}, "type": "llama3"}
    assert ModelConfig.from_hf_dict(legacy) == cfg
    supported = re.escape(str(family_names()))  # every registered family, sorted
    with pytest.raises(ValueError, match=r"unsupported model_type 'mistral'.*" + supported):
        ModelConfig.from_hf_dict({**d, "model_type": "mistral"})
    with pytest.raises(ValueError, match="unsupported RoPE type 'yarn'"):
        ModelConfig.from_hf_dict({**d, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}})
    with pytest.raises(ValueError, match=r"lacks required key\(s\) \['hidden_size'\]"):
        ModelConfig.from_hf_dict({k: v for k, v in d.items() if k != "hidden_size"})
