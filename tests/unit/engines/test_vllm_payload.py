"""The vLLM engine's refit payload, without vLLM: what the payload lifecycle hands its workers is, name for name
and byte for byte, the FP8 checkpoint the engine started from (``export_fp8_checkpoint``)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from fp8rl.engines.vllm.launch import export_fp8_checkpoint, payload_spec
from fp8rl.fp8 import Fp8Recipe, QKVScales, RefitPayload, WeightLoadError, quantize_state_dict
from fp8rl.model import CausalLM, save_hf_checkpoint

from .conftest import tiny_config

RECIPE = Fp8Recipe(linear="fp8", kv_cache_dtype="fp8", num_last_layers_in_bf16=1, pow2_weight_scaling_factors=True)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("tied", [False, True])
def test_processed_payload_is_the_checkpoint_vllm_started_from(tmp_path, tied):
    torch.manual_seed(3)
    config = tiny_config(tie_word_embeddings=tied)
    policy = CausalLM(config).eval()
    save_hf_checkpoint(policy, config, tmp_path / "hf")
    exported = load_file(export_fp8_checkpoint(tmp_path / "hf", tmp_path / "fp8", RECIPE) / "model.safetensors")

    spec = payload_spec(config, RECIPE, torch.bfloat16)
    assert spec.num_kv_layers == config.num_hidden_layers and ("lm_head.weight" in spec.tensors) != tied
    master = {k: v for k, v in policy.state_dict().items() if not (tied and k == "lm_head.weight")}
    scales = QKVScales(1, *[[0.01] * config.num_hidden_layers] * 3)
    shipped = quantize_state_dict(master, sorted(spec.fp8_linears), pow2_scale=True)  # as the trainer publishes
    for tensors in (master, shipped):
        got = RefitPayload.create(spec, 1, tensors, scales).process().checkpoint(scale_suffix="weight_scale_inv")
        assert set(got) == set(exported)
        for name, want in exported.items():
            assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
            assert torch.equal(_bytes(got[name]), _bytes(want)), name


def test_the_vllm_spec_refuses_what_the_engine_would_refuse():
    config = tiny_config()
    master = CausalLM(config).state_dict()
    spec = payload_spec(config, RECIPE, torch.bfloat16)
    with pytest.raises(WeightLoadError, match="needs the QKV scales of version 2"):
        RefitPayload.create(spec, 2, master)
    with pytest.raises(WeightLoadError, match="already holds 3"):
        RefitPayload.create(spec, 2, master, held=3)
    bf16 = payload_spec(config, Fp8Recipe(linear="bf16"), torch.float32)
    assert not bf16.fp8_linears and bf16.num_kv_layers is None
    shipped = quantize_state_dict(master, sorted(spec.fp8_linears))
    with pytest.raises(WeightLoadError, match="unknown"):  # E4M3 for a linear vLLM runs in high precision
        RefitPayload.create(bf16, 2, shipped)
