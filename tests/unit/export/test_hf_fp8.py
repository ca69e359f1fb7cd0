"""``--format hf-fp8``: the Hub's blockwise-FP8 layout holds the trainer's own FP8 weights, bit for bit.

The reference for the bytes is the trainer itself: every :class:`Fp8Linear` caches the E4M3 weight and FP32 block
scales its forward and backward GEMMs use (``weight_cache``, refreshed after each optimizer step). The exported
``X.weight`` must be those bytes and ``X.weight_scale_inv`` those scales, for exactly the linears the trainer runs in
FP8 — none of the layers it keeps in BF16, nor ``lm_head`` or the MoE router.

The reference for the meaning is transformers' own dequantization (``Fp8Dequantize``, what ``from_pretrained``
runs on a machine without an FP8 GPU; here called directly, as its ``validate_environment`` wants the
``accelerate`` package, a dev dependency the loading test below uses) and, for partial blocks it cannot read, a
three-line one in this file: both must give the trainer's dequantized weights bitwise, and transformers' model on
those weights the logits of fp8rl's on them within ``ATOL_HF``. Negative case: reading ``weight_scale_inv`` as a
quantization scale (dividing by it) lands far from the trainer's weights.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from fp8rl.export import export_checkpoint
from fp8rl.fp8 import E4M3, Fp8Linear, recipe_for_role
from fp8rl.model import CausalLM, ModelConfig
from tests.unit.model.test_transformer import ATOL_HF

from .conftest import model_dir, train

BLOCK = 128


def fp8_linears(trainer) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Trainer's FP8 linear name -> the (E4M3 weight, FP32 block scale, FP32 dequantized weight) it computes with."""
    out = {}
    for name, m in trainer.model.named_modules():
        if isinstance(m, Fp8Linear):
            q, s = m.weight_cache.get(m.weight, m.pow2_weight_scale)  # a cache hit: the step refreshed it
            out[name] = (q, s, m.weight_cache.dequantize_held())
    return out


def dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """An independent blockwise dequantization that reads partial last blocks: each element times its block's s."""
    rows = torch.arange(q.shape[0]) // BLOCK
    cols = torch.arange(q.shape[1]) // BLOCK
    return q.float() * s[rows][:, cols]


def check_bitwise(files: dict[str, torch.Tensor], trainer) -> dict[str, tuple]:
    linears = fp8_linears(trainer)
    assert linears, "the trainer runs no FP8 linear"
    assert {k.removesuffix(".weight_scale_inv") for k in files if k.endswith(".weight_scale_inv")} == set(linears)
    for name, (q, s, _) in linears.items():
        w, si = files[f"{name}.weight"], files[f"{name}.weight_scale_inv"]
        assert w.dtype == E4M3 and si.dtype == torch.float32, name
        assert si.shape == (math.ceil(q.shape[0] / BLOCK), math.ceil(q.shape[1] / BLOCK)), name
        assert torch.equal(w.view(torch.uint8), q.view(torch.uint8)), name  # the very bytes
        assert torch.equal(si, s), name  # scale_inv = fp8rl's dequantization scale, never inverted
    kept = [k for k, v in files.items() if k not in {f"{n}.weight" for n in linears} and not k.endswith("_inv")]
    assert all(files[k].dtype == torch.float32 for k in kept)
    return linears


def test_fp8_weights_and_scales_are_the_trainers_bitwise(tiny_arith, tmp_path, caplog):
    with caplog.at_level("WARNING"):
        res = export_checkpoint(tiny_arith.ckpt, tmp_path / "fp8", fmt="hf-fp8", progress=False)
    assert "not a multiple" not in caplog.text  # whole 128x128 blocks everywhere
    files = load_file(res.out / "model.safetensors")
    linears = check_bitwise(files, tiny_arith.trainer)
    assert not any(n.startswith("model.layers.3.") for n in linears)  # num_last_layers_in_bf16: 1
    qc = json.loads((res.out / "config.json").read_text())["quantization_config"]
    kept = [f"model.layers.3.{p}" for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                            "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128], "modules_to_not_convert": [*kept, "lm_head"]}
    assert json.loads((res.out / "fp8rl_export.json").read_text())["recipe"]["num_last_layers_in_bf16"] == 1


def test_transformers_dequantizes_it_to_the_trainers_fp8_weights(tiny_arith, tmp_path):
    res = export_checkpoint(tiny_arith.ckpt, tmp_path / "fp8", fmt="hf-fp8", progress=False)
    files = load_file(res.out / "model.safetensors")
    linears = fp8_linears(tiny_arith.trainer)
    theirs = Fp8Dequantize(None)._dequantize_one  # transformers' dequantize-on-load, for one weight
    state = {}
    for k, v in files.items():
        name = k.removesuffix(".weight")
        if name in linears:
            si = files[f"{name}.weight_scale_inv"]
            w = theirs(v, si, torch.float32)
            assert torch.equal(w, linears[name][2]) and torch.equal(dequantize(v, si), w)
            wrong = v.float() / si.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
            assert (wrong - w).abs().max() > 10 * w.abs().max()  # negative case: the other scale convention
            state[k] = w
        elif not k.endswith(".weight_scale_inv"):
            state[k] = v
    # transformers' Llama on the dequantized weights vs fp8rl's on the trainer's dequantized FP8 weights
    cfg = json.loads((res.out / "config.json").read_text())
    cfg.pop("quantization_config")
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), attn_implementation="eager").eval()
    hf.load_state_dict(state, strict=True)
    ours = CausalLM(tiny_arith.trainer.model.config).eval()
    trained = tiny_arith.trainer.state_dict()
    ours.load_state_dict({k: linears[k.removesuffix(".weight")][2] if k.removesuffix(".weight") in linears else v
                          for k, v in trained.items()})
    with torch.no_grad():
        torch.testing.assert_close(hf(tiny_arith.ids).logits.float(), ours(tiny_arith.ids), atol=ATOL_HF, rtol=0)


def test_transformers_loads_the_fp8_directory(tiny_arith, tmp_path):
    """transformers' own loader on the directory (it dequantizes on a CPU-only machine). Needs ``accelerate``,
    a dev dependency (pyproject.toml): skipped where it is missing."""
    pytest.importorskip("accelerate")
    res = export_checkpoint(tiny_arith.ckpt, tmp_path / "fp8", fmt="hf-fp8", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(res.out, dtype=torch.float32, attn_implementation="eager").eval()
    for name, (_, _, deq) in fp8_linears(tiny_arith.trainer).items():
        assert torch.equal(hf.get_submodule(name).weight.float(), deq), name


def test_recorded_recipe_pow2_scales_partial_blocks_and_layer_overrides(tmp_path, caplog):
    """pow2 block scales, a first layer kept in BF16 and an MLP width (320) of partial blocks, all as recorded."""
    torch.manual_seed(5)
    config = ModelConfig(architecture="llama", vocab_size=128, hidden_size=256, intermediate_size=320,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    policy = CausalLM(config)
    policy.name_or_path = str(model_dir(policy, tmp_path / "model"))
    recipe = recipe_for_role("fp8_e2e", "trainer", num_first_layers_in_bf16=1, pow2_weight_scaling_factors=True)
    tr = train(policy, recipe, tmp_path / "trainer-v000001.pt")
    with caplog.at_level("WARNING", logger="fp8rl.export.hf_fp8"):
        res = export_checkpoint(tmp_path / "trainer-v000001.pt", tmp_path / "fp8", fmt="hf-fp8", progress=False)
    assert "6 of 14 FP8 linears have a dimension that is not a multiple of 128 (e.g. model.layers.1.mlp.gate_proj " \
           "(320, 256))" in caplog.text  # readers may refuse partial blocks: said, not hidden
    files = load_file(res.out / "model.safetensors")
    linears = check_bitwise(files, tr)
    assert not any(n.startswith("model.layers.0.") for n in linears)
    s = files["model.layers.1.mlp.up_proj.weight_scale_inv"]
    assert s.shape == (3, 2) and torch.equal(torch.exp2(torch.log2(s).round()), s)  # partial blocks, powers of 2
    assert torch.equal(dequantize(files["model.layers.1.mlp.up_proj.weight"], s),
                       linears["model.layers.1.mlp.up_proj"][2])
    # the layer flags override the recorded recipe: layer 0 now in FP8 too, with the recorded pow2 scales
    again = export_checkpoint(tmp_path / "trainer-v000001.pt", tmp_path / "fp8-all", fmt="hf-fp8", progress=False,
                              num_first_layers_in_bf16=0)
    s0 = load_file(again.out / "model.safetensors")["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert torch.equal(torch.exp2(torch.log2(s0).round()), s0)


def test_moe_experts_in_fp8_router_kept(moe, tmp_path):
    res = export_checkpoint(moe.ckpt, tmp_path / "fp8", fmt="hf-fp8", progress=False)
    files = load_file(res.out / "model.safetensors")
    linears = check_bitwise(files, moe.trainer)
    assert "model.layers.1.mlp.experts.3.down_proj" in linears
    assert files["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    qc = json.loads((res.out / "config.json").read_text())["quantization_config"]
    assert qc["modules_to_not_convert"] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "lm_head"]
