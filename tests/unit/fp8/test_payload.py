"""The one refit payload lifecycle (fp8rl.fp8.payload): create → process after loading → apply."""

from __future__ import annotations

import copy

import pytest
import torch

from fp8rl.fp8 import (
    E4M3,
    Fp8Recipe,
    PayloadSpec,
    QKVScales,
    RefitPayload,
    WeightLoadError,
    convert_model,
    dequantize_blockwise,
    fp8_linear_names,
    qkv_quantizers,
    quantize_blockwise,
    quantize_state_dict,
)
from fp8rl.model import CausalLM, ModelConfig

RECIPE = Fp8Recipe(linear="fp8", kv_cache_dtype="fp8", num_last_layers_in_bf16=1)
LAYERS = 3
UP = "model.layers.0.mlp.up_proj"


@pytest.fixture(scope="module")
def policy() -> CausalLM:
    torch.manual_seed(5)
    cfg = ModelConfig(architecture="llama", vocab_size=96, hidden_size=256, intermediate_size=384,
                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return CausalLM(cfg).eval()


def converted(policy: CausalLM, recipe: Fp8Recipe = RECIPE) -> CausalLM:
    return convert_model(copy.deepcopy(policy), recipe, mode="inference").eval()


def master(policy: CausalLM, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in policy.state_dict().items()}


def scales(version: int, layers: int = LAYERS) -> QKVScales:
    return QKVScales(version, [0.01] * layers, [0.02] * layers, [0.03] * layers)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every live tensor's bytes (FP8 and scalar buffers included)."""
    return {k: v.detach().reshape(-1).view(torch.uint8).clone() for k, v in model.state_dict().items()}


def test_spec_of_a_converted_model(policy):
    model = converted(policy)
    spec = PayloadSpec.for_model(model)
    assert set(spec.fp8_linears) == set(fp8_linear_names(model, RECIPE))
    assert not any(p.startswith("model.layers.2.") for p in spec.fp8_linears)  # the BF16 last layer
    assert "model.layers.2.self_attn.q_proj.weight" in spec.tensors and "lm_head.weight" in spec.tensors
    assert spec.num_kv_layers == LAYERS and len(qkv_quantizers(model)) == LAYERS
    assert spec.expected_names() == set(policy.state_dict())  # a payload of master weights is the state dict
    assert spec.fp8_linears[UP].scale_shape == (3, 2)  # 384 x 256 in 128 x 128 blocks


def test_master_weights_are_quantized_like_the_trainer_and_applied_in_place_with_their_scales(policy):
    model = converted(policy)
    lin = model.model.layers[0].mlp.up_proj
    ptrs = (lin.weight.data_ptr(), lin.weight_scale.data_ptr(), model.lm_head.weight.data_ptr())
    sd = master(policy)
    processed = RefitPayload.create(PayloadSpec.for_model(model), 1, sd, scales(1)).process()
    q, s = quantize_blockwise(sd[f"{UP}.weight"])
    assert torch.equal(processed.fp8[UP][0].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(processed.fp8[UP][1], s)
    processed.apply(model)
    assert (lin.weight.data_ptr(), lin.weight_scale.data_ptr(), model.lm_head.weight.data_ptr()) == ptrs
    assert torch.equal(lin.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(lin.weight_scale, s)
    assert torch.equal(model.lm_head.weight, sd["lm_head.weight"])
    assert torch.equal(model.model.layers[2].self_attn.q_proj.weight, sd["model.layers.2.self_attn.q_proj.weight"])
    for qz in qkv_quantizers(model):
        assert qz.version == 1 and float(qz.k_scale) == pytest.approx(0.02)

    pow2 = converted(policy, Fp8Recipe(linear="fp8", pow2_weight_scaling_factors=True))
    s2 = RefitPayload.create(PayloadSpec.for_model(pow2), 1, sd).process().fp8[UP][1]
    assert torch.equal(s2, quantize_blockwise(sd[f"{UP}.weight"], pow2_scale=True)[1])
    assert torch.equal(s2, torch.exp2(torch.log2(s2).round()))


def test_shipped_fp8_is_taken_as_it_arrived(policy):
    model = converted(policy)
    shipped = quantize_state_dict(master(policy), fp8_linear_names(model, RECIPE))
    processed = RefitPayload.create(PayloadSpec.for_model(model), 3, shipped, scales(3)).process()
    for prefix, (q, s) in processed.fp8.items():
        assert torch.equal(q.view(torch.uint8), shipped[f"{prefix}.weight"].view(torch.uint8))
        assert torch.equal(s, shipped[f"{prefix}.weight_scale"])
    ckpt = processed.checkpoint(scale_suffix="weight_scale_inv")  # vLLM's checkpoint names
    assert set(ckpt) == {n.replace(".weight_scale", ".weight_scale_inv") for n in shipped}
    assert all(t.is_contiguous() for t in ckpt.values())


def _nan(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[3] = float("nan")
    return t


def _bad_payloads(policy, model):
    sd = master(policy)
    shipped = quantize_state_dict(sd, fp8_linear_names(model, RECIPE))
    s = f"{UP}.weight_scale"
    return {  # name → (tensors, qkv scales, held, message the error must carry)
        "missing": ({k: v for k, v in sd.items() if not k.endswith("v_proj.weight")}, scales(1), None, "missing"),
        "unknown": ({**sd, "model.extra.weight": sd["lm_head.weight"]}, scales(1), None, "unknown"),
        "shape": ({**sd, "model.norm.weight": torch.ones(3)}, scales(1), None, r"model\.norm\.weight: shape"),
        "dtype": ({**sd, "model.norm.weight": sd["model.norm.weight"].long()}, scales(1), None,
                  "model.norm.weight: dtype torch.int64 is not a high-precision float"),
        "nan high precision": ({**sd, "lm_head.weight": _nan(sd["lm_head.weight"])}, scales(1), None,
                               "lm_head.weight"),
        "nan master fp8 weight": ({**sd, f"{UP}.weight": _nan(sd[f"{UP}.weight"])}, scales(1), None,
                                  f"{UP}.weight"),
        "int fp8 weight": ({**sd, f"{UP}.weight": sd[f"{UP}.weight"].long()}, scales(1), None, "is not a float"),
        "no block scale": ({k: v for k, v in shipped.items() if k != s}, scales(1), None,
                           "is E4M3 but .*weight_scale is missing"),
        "block scale grid": ({**shipped, s: torch.ones(2, 2)}, scales(1), None, r"weight_scale: shape \(2, 2\)"),
        "block scale <= 0": ({**shipped, s: -shipped[s]}, scales(1), None, "scales must be > 0"),
        "block scale nan": ({**shipped, s: _nan(shipped[s])}, scales(1), None, "weight_scale"),
        "stale": (sd, scales(1), 2, "refusing weight version 1: this engine already holds 2"),
        "no qkv scales": (sd, None, None, "needs the QKV scales of version 1"),
        "qkv scales of another version": (sd, scales(0), None, "version 0 but the weights are version 1"),
        "qkv scales layers": (sd, scales(1, layers=2), None, "cover 2 layers, model has 3"),
    }


def test_every_bad_payload_is_refused_naming_the_problem_and_nothing_is_applied(policy):
    model = converted(policy)
    spec = PayloadSpec.for_model(model)
    before = snapshot(model)
    for case, (tensors, qkv, held, match) in _bad_payloads(policy, model).items():
        with pytest.raises(WeightLoadError, match=match):
            RefitPayload.create(spec, 1, tensors, qkv, held=held).process().apply(model)
        after = snapshot(model)
        assert all(torch.equal(before[k], after[k]) for k in before), case
    assert all(qz.version is None for qz in qkv_quantizers(model))


def test_high_precision_linears_dequantize_shipped_fp8_only_when_the_spec_says_so(policy):
    model = converted(policy, Fp8Recipe(linear="bf16"))  # e.g. the fp8_gen_only calibrator
    shipped = quantize_state_dict(master(policy), fp8_linear_names(model, RECIPE))
    with pytest.raises(WeightLoadError, match="unknown"):  # the rollout engines take no E4M3 for BF16 linears
        RefitPayload.create(PayloadSpec.for_model(model), 1, shipped)
    RefitPayload.create(PayloadSpec.for_model(model, dequantize_fp8=True), 1, shipped).process().apply(model)
    want = dequantize_blockwise(shipped[f"{UP}.weight"], shipped[f"{UP}.weight_scale"])
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    torch.testing.assert_close(model.model.layers[0].mlp.up_proj.weight, want, rtol=0, atol=0)
    bad = {**shipped, f"{UP}.weight_scale": torch.ones(1, 1)}
    with pytest.raises(WeightLoadError, match=r"up_proj\.weight_scale: shape"):
        RefitPayload.create(PayloadSpec.for_model(model, dequantize_fp8=True), 1, bad)
    assert shipped[f"{UP}.weight"].dtype == E4M3


def test_apply_refuses_a_model_the_payload_was_not_made_for(policy):
    fp8_model = converted(policy)
    processed = RefitPayload.create(PayloadSpec.for_model(fp8_model), 1, master(policy), scales(1)).process()
    other = converted(policy, Fp8Recipe(linear="bf16", kv_cache_dtype="fp8"))
    before = snapshot(other)
    with pytest.raises(WeightLoadError, match="does not fit this model"):
        processed.apply(other)
    after = snapshot(other)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_one_error_type_for_every_engine():
    from fp8rl import engines
    from fp8rl.engines import base

    assert engines.WeightLoadError is base.WeightLoadError is WeightLoadError
    assert issubclass(WeightLoadError, ValueError)
