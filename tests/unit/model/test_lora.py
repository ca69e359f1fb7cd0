"""LoRA adapters (:mod:`fp8rl.model.lora`) against plain math, on every linear kind the engines hold.

Error model (one place): the adapter's two FP32 GEMMs against the same math in FP64. A length-``k`` FP32 dot
product is off by at most ``γ_k = k·u / (1 - k·u)`` (``u = 2**-24``) times the sum of its terms' magnitudes
(Higham, Accuracy and Stability of Numerical Algorithms, §3.1); two GEMMs in a row stay within ``γ_{k1 + k2}``
of the magnitude of the whole product, which :func:`_bound` evaluates elementwise on the absolute values.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fp8rl.fp8 import Fp8Recipe, convert_model
from fp8rl.model import CausalLM, ModelConfig
from fp8rl.model.lora import (
    DEFAULT_TARGETS,
    LoraSettings,
    apply_lora,
    has_lora,
    lora_computed_state_dict,
    lora_parameters,
    lora_state_dict,
)

U = 2.0 ** -24


def _gamma(k: int) -> float:
    return k * U / (1 - k * U)


def _bound(k: int, magnitude: torch.Tensor) -> torch.Tensor:
    """Elementwise FP32 round-off bound of a chain of GEMMs whose dot products add up to length ``k``."""
    return _gamma(k) * magnitude


def _model(seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                      max_position_embeddings=32, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return CausalLM(cfg)


def _randomize_b(model, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in lora_parameters(model):
            if n.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def test_settings_are_checked_naming_the_key():
    with pytest.raises(ValueError, match="policy.lora.rank"):
        LoraSettings(rank=0)
    with pytest.raises(ValueError, match="policy.lora.dropout"):
        LoraSettings(dropout=1.0)
    assert LoraSettings(rank=8, alpha=16).scaling == 2.0


def test_a_fresh_adapter_changes_no_number_and_only_adapters_train():
    model = _model()
    ids = torch.randint(3, 64, (3, 10))
    before = model(ids)
    names = apply_lora(model, LoraSettings(rank=4, alpha=8))
    assert len(names) == 2 * 7 and has_lora(model)  # 2 layers x the 7 standard projections the default names
    assert {n.rsplit(".", 1)[-1] for n in names} == set(DEFAULT_TARGETS) - {"q_a_proj", "q_b_proj",
                                                                              "kv_a_proj_with_mqa", "kv_b_proj"}
    assert torch.equal(model(ids), before)  # B = 0
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in lora_parameters(model)} and len(trainable) == 2 * len(names)
    sd = model.state_dict()
    assert "model.layers.0.self_attn.q_proj.weight" in sd  # the base keeps its name
    assert sd["model.layers.1.mlp.down_proj.lora_A.weight"].shape == (4, 256)
    assert sd["model.layers.1.mlp.down_proj.lora_B.weight"].shape == (128, 4)
    assert set(lora_state_dict(model)) == trainable
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(model, LoraSettings())
    with pytest.raises(ValueError, match=r"no projection named \['qkv'\]"):
        apply_lora(_model(), LoraSettings(target_modules=("qkv",)))


def test_forward_and_gradients_equal_the_adapter_math():
    model = _model()
    apply_lora(model, LoraSettings(rank=4, alpha=8, target_modules=("q_proj",), dtype="float32"))
    _randomize_b(model)
    proj = model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 5, 128, requires_grad=False)
    y = proj(x)
    a, b, s = proj.lora_A.weight, proj.lora_B.weight, proj.lora_scaling
    # the base part is the projection's own forward; the rest is the adapter, against FP64 math
    low = (y - F.linear(x, proj.weight)).double()
    x64, a64, b64 = x.double(), a.detach().double(), b.detach().double()
    ref = (x64 @ a64.T @ b64.T) * s
    bound = _bound(128 + 4, (x64.abs() @ a64.abs().T @ b64.abs().T) * s) + _bound(1, y.detach().double().abs())
    assert bool(((low - ref).abs() <= bound).all())
    # gradients: only A and B; each against FP64 autograd of the same math, bounded by its magnitude's γ
    g = torch.randn_like(y)
    (y * g).sum().backward()
    assert proj.weight.grad is None
    a_ref, b_ref = a64.clone().requires_grad_(), b64.clone().requires_grad_()
    ((x64 @ a_ref.T @ b_ref.T) * s * g.double()).sum().backward()
    a_mag, b_mag = a64.abs().clone().requires_grad_(), b64.abs().clone().requires_grad_()
    ((x64.abs() @ a_mag.T @ b_mag.T) * s * g.double().abs()).sum().backward()
    k = 2 * 5 + 128 + 4  # the longest chain of sums: tokens, then the features and the rank
    assert bool(((a.grad.double() - a_ref.grad).abs() <= _bound(k, a_mag.grad)).all())
    assert bool(((b.grad.double() - b_ref.grad).abs() <= _bound(k, b_mag.grad)).all())
    # negative control: a wrong scaling is far outside the bound
    assert not bool(((low - 1.5 * ref).abs() <= bound).all())


def test_the_adapter_is_computed_alike_on_the_trainer_and_rollout_fp8_linears_and_is_batch_invariant():
    """fp8_e2e with batch invariance: the trainer's Fp8Linear (master weights) and the rollout's Fp8InferenceLinear
    (E4M3 + scales) run the same base GEMM and the same adapter — logits bitwise equal — and a row's logits are the
    same alone and among other rows."""
    recipe = Fp8Recipe(linear="fp8", batch_invariant=True)
    base = _model()
    trainer = convert_model(copy.deepcopy(base), recipe, mode="train")
    rollout = convert_model(copy.deepcopy(base), recipe, mode="inference")
    for m in (trainer, rollout):
        apply_lora(m, LoraSettings(rank=8, alpha=16))
        _randomize_b(m)
    assert set(lora_state_dict(trainer)) == set(lora_state_dict(rollout))
    ids = torch.randint(3, 64, (5, 12))
    with torch.no_grad():
        lt, lr = trainer(ids), rollout(ids)
        alone = rollout(ids[2:3])
        untouched = convert_model(copy.deepcopy(base), recipe, mode="inference")(ids)
    assert torch.equal(lt, lr)
    assert torch.equal(alone, lr[2:3])
    assert not torch.equal(lr, untouched)  # the adapters act


def test_bfloat16_adapters_compute_with_their_rounding_and_train_the_fp32_masters():
    """``dtype: bfloat16`` (the default): the forward is exactly the FP32 computation on the masters rounded to BF16
    (what a refit ships), and the masters' gradients are that computation's, passed straight through."""
    x = torch.randn(2, 5, 128)
    g = torch.randn(2, 5, 128)
    runs = {}
    for dtype in ("bfloat16", "float32"):
        model = _model()
        apply_lora(model, LoraSettings(rank=4, alpha=8, target_modules=("q_proj",), dtype=dtype))
        _randomize_b(model)
        proj = model.model.layers[0].self_attn.q_proj
        if dtype == "float32":  # the masters pre-rounded: the same numbers the bf16 forward must use
            with torch.no_grad():
                for p in (proj.lora_A.weight, proj.lora_B.weight):
                    p.copy_(p.to(torch.bfloat16).float())
        y = proj(x)
        (y * g).sum().backward()
        runs[dtype] = (y.detach(), proj.lora_A.weight.grad, proj.lora_B.weight.grad, model)
    (y16, ga16, gb16, p16), (y32, ga32, gb32, _) = runs["bfloat16"], runs["float32"]
    assert torch.equal(y16, y32) and torch.equal(ga16, ga32) and torch.equal(gb16, gb32)
    a16 = p16.model.layers[0].self_attn.q_proj.lora_A.weight
    assert a16.dtype == torch.float32  # the masters stay FP32
    shipped = lora_computed_state_dict(p16)
    assert len(shipped) == 4 and {t.dtype for t in shipped.values()} == {torch.bfloat16}  # 2 layers x (A, B)
    assert not torch.equal(a16, a16.to(torch.bfloat16).float())  # the rounding mattered
