"""convert_model, quantize_state_dict, QKV scales and backend selection."""

import logging

import pytest
import torch
from torch import nn

from fp8rl.fp8 import (
    Fp8InferenceLinear,
    Fp8Linear,
    Fp8Recipe,
    QKVQuantizer,
    QKVScales,
    convert_model,
    dequantize_blockwise,
    fp8_linear_names,
    quantize_state_dict,
    recipe_for_role,
    scales_from_amax_history,
    select_backend,
)

# every test on the fused CPU kernels and on the torch path (tests/unit/conftest.py's native_path)
pytestmark = pytest.mark.usefixtures("native_path")


class _Attn(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.kv_quant = None


class _Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.self_attn = _Attn(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))
        self.input_layernorm = nn.LayerNorm(d)


class _Body(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.embed_tokens = nn.Embedding(50, d)
        self.layers = nn.ModuleList(_Layer(d) for _ in range(n))


class _ToyLM(nn.Module):
    """Structural test double with HF's module layout (the real model is tested in tests/unit/engines)."""

    def __init__(self, d=128, n=4):
        super().__init__()
        self.model = _Body(d, n)
        self.lm_head = nn.Linear(d, 50, bias=False)

    def enable_fp8_kv(self, fp8_attention=True):
        for layer in self.model.layers:
            layer.self_attn.kv_quant = QKVQuantizer(fp8_attention)


@pytest.mark.parametrize("mode,cls", [("train", Fp8Linear), ("inference", Fp8InferenceLinear)])
def test_convert_keeps_embeddings_head_and_first_last_layers(mode, cls):
    m = _ToyLM(n=5)
    recipe = Fp8Recipe(num_first_layers_in_bf16=1, num_last_layers_in_bf16=2)
    convert_model(m, recipe, mode=mode)
    assert type(m.lm_head) is nn.Linear and type(m.model.embed_tokens) is nn.Embedding
    for i, layer in enumerate(m.model.layers):
        expect = cls if i in (1, 2) else nn.Linear
        assert type(layer.self_attn.q_proj) is expect, i
        assert type(layer.mlp[0]) is expect and type(layer.mlp[2]) is expect
        assert type(layer.input_layernorm) is nn.LayerNorm
    assert fp8_linear_names(m, recipe) == [
        f"model.layers.{i}.{n}" for i in (1, 2)
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.0", "mlp.2")
    ]


def test_bf16_recipe_converts_nothing_and_kv_installs_quantizers():
    m = _ToyLM()
    convert_model(m, Fp8Recipe(linear="bf16", kv_cache_dtype="fp8"))
    assert all(type(mod) is not Fp8Linear for mod in m.modules())
    assert all(isinstance(layer.self_attn.kv_quant, QKVQuantizer) for layer in m.model.layers)


def test_recipe_for_role_table():
    assert recipe_for_role("fp8_gen_only", "rollout").fp8_linears
    assert not recipe_for_role("fp8_gen_only", "trainer").fp8_linears
    assert recipe_for_role("fp8_e2e", "trainer").fp8_linears
    assert not recipe_for_role("bf16", "rollout").fp8_linears
    assert recipe_for_role("fp8_e2e", "rollout", kv_cache_dtype="fp8").fp8_kv
    assert not recipe_for_role("fp8_e2e", "trainer", kv_cache_dtype="fp8").fp8_kv
    with pytest.raises(ValueError, match="unknown recipe 'fp4'"):
        recipe_for_role("fp4", "rollout")
    with pytest.raises(ValueError, match="num_first_layers_in_bf16"):
        Fp8Recipe(num_first_layers_in_bf16=-1)


def test_quantize_state_dict_ships_e4m3_plus_scales():
    m = _ToyLM(n=2)
    recipe = Fp8Recipe()
    sd = {k: v.detach().clone() for k, v in m.state_dict().items()}
    qsd = quantize_state_dict(sd, fp8_linear_names(m, recipe))
    key = "model.layers.0.self_attn.q_proj.weight"
    assert qsd[key].dtype == torch.float8_e4m3fn and qsd[key + "_scale"].shape == (1, 1)
    assert torch.allclose(dequantize_blockwise(qsd[key], qsd[key + "_scale"]), sd[key], rtol=0.07, atol=1e-3)
    assert qsd["lm_head.weight"].dtype == torch.float32
    sd[key][0, 0] = float("nan")
    with pytest.raises(ValueError, match="q_proj.weight"):
        quantize_state_dict(sd, fp8_linear_names(m, recipe))


def test_qkv_scales_from_history_percentile_and_margin():
    hist = {"q": [[1.0, 2.0, 4.0]], "k": [[448.0]], "v": [[0.0]]}
    s = scales_from_amax_history(3, hist, percentile=100.0)
    assert s.version == 3
    assert s.q == [pytest.approx(4.0 * 1.05 / 448, rel=1e-7)]
    assert s.k == [pytest.approx(1.05, rel=1e-7)]
    assert s.v == [1.0]  # all-zero tensor -> unit scale
    # a high percentile is robust to one outlier pass among many
    many = {"q": [[1.0] * 2000 + [100.0]], "k": [[1.0]], "v": [[1.0]]}
    assert scales_from_amax_history(0, many).q[0] < 100.0 * 1.05 / 448
    t = s.to_tensor()
    assert t.shape == (1, 3) and QKVScales.from_tensor(3, t).k == s.k
    with pytest.raises(ValueError, match="finite and > 0"):
        QKVScales(0, [1.0], [float("nan")], [1.0])


def test_qkv_quantizer_in_place_and_version_guard():
    qz = QKVQuantizer()
    ptr = qz.k_scale.data_ptr()
    with pytest.raises(RuntimeError, match="placeholder 1.0 scales"):
        qz.require_version(0)
    qz.set_scales(0.1, 0.2, 0.3, version=7)
    assert qz.k_scale.data_ptr() == ptr and float(qz.k_scale) == pytest.approx(0.2)
    qz.require_version(7)
    with pytest.raises(RuntimeError, match="version 8.*version 7"):
        qz.require_version(8)
    k = torch.randn(2, 2, 5, 16) * 10
    kq, vq = qz.quantize_kv(k, k)
    assert kq.dtype == torch.float8_e4m3fn
    k_hat, _ = qz.dequantize_kv(kq, vq, torch.float32)
    assert k.abs().max() < 0.2 * 448  # inside the calibrated range: no saturation
    assert ((k_hat - k).abs() <= 2**-4 * k.abs() + 2**-10 * 0.2 + 1e-7).all()
    p = torch.softmax(torch.randn(4, 9), -1)
    assert torch.equal(qz.round_probs(p), p.to(torch.float8_e4m3fn).float())
    assert torch.equal(QKVQuantizer(fp8_attention=False).round_probs(p), p)


def test_backend_is_reference_on_cpu_and_logged_once(caplog, monkeypatch):
    monkeypatch.delenv("FP8RL_FP8_BACKEND", raising=False)
    assert select_backend("cpu") == "reference"
    from fp8rl.fp8 import backend

    backend._select.cache_clear()
    with caplog.at_level(logging.INFO, logger="fp8rl.fp8.backend"):
        select_backend("cpu")
        select_backend("cpu")
    assert sum("fp8 GEMM backend" in r.message for r in caplog.records) == 1
    monkeypatch.setenv("FP8RL_FP8_BACKEND", "scaled_mm")
    backend._select.cache_clear()
    with pytest.raises(RuntimeError, match="cannot run it"):
        select_backend("cpu")
    backend._select.cache_clear()
