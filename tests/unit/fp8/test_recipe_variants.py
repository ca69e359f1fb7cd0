"""The FP8 recipe variants of issue 32 beside blockwise: tensorwise's quantizer, and both variants' linears and refit
payloads.

References are independent of the code under test: E4M3 rounding from the format's bit layout (``round_e4m3``,
conftest), MXFP8 scales from exact float64 comparisons, tensorwise scales as the plain FP32 quotient ``amax / 448``.
Tolerances, named once: the linears' GEMMs against dequantize-then-matmul differ only in FP32 summation order
(``RTOL_SUM``, ``ATOL_SUM``, as ``test_linear.py``); against an FP32 linear each operand carries a relative rounding
error <= 2**-4, hence ``RTOL_VS_FP32`` on the relative Frobenius error of Gaussian data.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from fp8rl.fp8 import (
    E4M3,
    Fp8InferenceLinear,
    Fp8Linear,
    PayloadSpec,
    RefitPayload,
    WeightLoadError,
    convert_model,
    dequantize_tensorwise,
    fp8_linear,
    fp8_linear_names,
    linear_format,
    quantize_state_dict,
    quantize_tensorwise,
    recipe_for_role,
)
from fp8rl.fp8.mxfp8 import E8M0_NAN

RTOL_SUM, ATOL_SUM = 1e-5, 1e-4
RTOL_VS_FP32 = 0.06
VARIANTS = ("mxfp8", "tensorwise")


# ---------------------------------------------------------------------------------------------------------------
# independent reference quantizers (fake-quantized values, float64)
# ---------------------------------------------------------------------------------------------------------------


def ref_tensorwise(x: torch.Tensor, round_e4m3, rows: bool = False) -> torch.Tensor:
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True) if rows else x.abs().amax().reshape(1, 1)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return round_e4m3((x / scale).double()) * scale.double()


def ref_mxfp8(x: torch.Tensor, dim: int, round_e4m3) -> torch.Tensor:
    """1x32 blocks along ``dim`` of a 2-D tensor, scale = the smallest power of two >= amax / 448."""
    xt = x.double().movedim(dim, -1)
    n = xt.shape[-1]
    pad = -n % 32
    xp = F.pad(xt, (0, pad)).reshape(*xt.shape[:-1], -1, 32)
    amax = xp.abs().amax(-1, keepdim=True)
    e = torch.zeros_like(amax)
    for idx in torch.nonzero(amax.squeeze(-1)):  # a few hundred blocks: plain exact search
        a = float(amax[tuple(idx)])
        k = math.ceil(math.log2(a / 448.0))
        while 448.0 * 2.0**k < a:
            k += 1
        while 448.0 * 2.0 ** (k - 1) >= a:
            k -= 1
        e[tuple(idx)] = k
    scale = torch.pow(2.0, e)
    out = (round_e4m3(xp / scale) * scale).reshape(*xt.shape[:-1], -1)[..., :n]
    return out.movedim(-1, dim)


def ref_operands(fmt: str, x, w, dy, round_e4m3, invariant=False):
    """(x fwd, w fwd, dy dgrad, w dgrad, dy wgrad, x wgrad) as the recipe multiplies them (issue 32's table)."""
    if fmt == "mxfp8":
        return (ref_mxfp8(x, 1, round_e4m3), ref_mxfp8(w, 1, round_e4m3), ref_mxfp8(dy, 1, round_e4m3),
                ref_mxfp8(w, 0, round_e4m3), ref_mxfp8(dy, 0, round_e4m3), ref_mxfp8(x, 0, round_e4m3))
    wt = ref_tensorwise(w, round_e4m3)
    return (ref_tensorwise(x, round_e4m3, rows=invariant), wt, ref_tensorwise(dy, round_e4m3), wt,
            ref_tensorwise(dy, round_e4m3), ref_tensorwise(x, round_e4m3))


# ---------------------------------------------------------------------------------------------------------------
# tensorwise quantizer
# ---------------------------------------------------------------------------------------------------------------


def test_tensorwise_codes_and_scale_are_the_reference_bitwise(round_e4m3):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 200, generator=g) * 3.0
    x[0, 0] = -x.abs().max() * 1.5  # the amax element lands on -448 exactly
    x[1, :5] = torch.tensor([1e-6, -2e-6, 3e-7, 0.0, 1e-30])  # E4M3 subnormals and zero after the divide
    q, s = quantize_tensorwise(x)
    assert q.dtype == E4M3 and s.dtype == torch.float32 and s.shape == (1, 1)
    assert float(s) == float(x.abs().max() / torch.tensor(448.0))  # amax / 448 in FP32
    assert torch.equal(q.double(), round_e4m3((x / s).double()))
    assert float(q[0, 0]) == -448.0
    assert torch.equal(dequantize_tensorwise(q, s), q.float() * s)
    # the per-row form (batch-invariant forward activations): each row its own amax
    qr, sr = quantize_tensorwise(x, rows=True)
    assert sr.shape == (24, 1)
    assert torch.equal(qr.double(), round_e4m3((x / sr).double()))


def test_tensorwise_zeros_pow2_and_bad_input():
    q, s = quantize_tensorwise(torch.zeros(3, 7))
    assert float(s) == 1.0 and not bool(q.float().any())  # an all-zero tensor: scale 1
    x = torch.tensor([[3.0, -100.0]])
    _, s2 = quantize_tensorwise(x, pow2_scale=True)
    assert float(s2) == 0.25  # 100 / 448 = 0.223 rounded up to a power of two
    bad = torch.randn(4, 4)
    bad[2, 2] = math.inf
    with pytest.raises(ValueError, match="non-finite"):
        quantize_tensorwise(bad, name="w")
    with pytest.raises(ValueError, match="tensorwise scale"):
        dequantize_tensorwise(q, torch.ones(3, 7))


def test_mxfp8_subnormals_and_the_448_boundary(round_e4m3):
    from fp8rl.fp8 import dequantize_mxfp8, quantize_mxfp8

    x = torch.zeros(2, 40)  # a width that is not a multiple of 32
    x[0, 0] = 448.0  # amax / 448 = 1: scale 2**0, the element is 448 exactly
    x[0, 1] = 2.0**-9  # E4M3's smallest subnormal at scale 1
    x[0, 2] = 2.0**-11  # rounds to zero (below half the smallest subnormal, ties to even)
    x[1, 33] = -449.0  # just over 448: scale 2**1
    q, s = quantize_mxfp8(x)
    assert s.tolist() == [[127, 127], [127, 128]]
    assert q[0, :3].float().tolist() == [448.0, 2.0**-9, 0.0]
    assert float(q[1, 33]) == float(round_e4m3(torch.tensor(-449.0 / 2, dtype=torch.float64)))
    assert torch.equal(dequantize_mxfp8(q, s).double(), ref_mxfp8(x, 1, round_e4m3))


# ---------------------------------------------------------------------------------------------------------------
# the linears
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scaling", VARIANTS)
@pytest.mark.parametrize("t,k,n", [(40, 256, 130), (7, 100, 70)])
def test_forward_dgrad_wgrad_are_dequantize_and_matmul_of_the_reference_operands(round_e4m3, scaling, t, k, n):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, k, generator=g, requires_grad=True)
    w = torch.randn(n, k, generator=g, requires_grad=True)
    dy = torch.randn(t, n, generator=g)
    y = fp8_linear(x, w, scaling=scaling)
    y.backward(dy)
    xf, wf, dyd, wd, dyw, xw = (o.float() for o in ref_operands(scaling, x.detach(), w.detach(), dy, round_e4m3))
    torch.testing.assert_close(y, xf @ wf.t(), rtol=RTOL_SUM, atol=ATOL_SUM)
    torch.testing.assert_close(x.grad, dyd @ wd, rtol=RTOL_SUM, atol=ATOL_SUM)
    torch.testing.assert_close(w.grad, dyw.t() @ xw, rtol=RTOL_SUM, atol=ATOL_SUM)
    # and they are FP8 approximations of the FP32 linear (each operand <= 2**-4 relative)
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    F.linear(xr, wr).backward(dy)
    for got, want in ((y, F.linear(x, w)), (x.grad, xr.grad), (w.grad, wr.grad)):
        assert ((got - want).norm() / want.norm()).item() < RTOL_VS_FP32


def test_mxfp8_dgrad_quantizes_the_weight_along_n_not_the_forward_form(round_e4m3):
    """Negative control of the orientation. Rescaling by a power of two keeps a normal element's mantissa, so the two
    orientations differ where an element falls below its block's E4M3 normal range (amax / 2**15): row 0 of the
    weight is 1e6 times the others, so along N (blocks of 32 rows) rows 1..31 lose their bits, along K (each row its
    own blocks) they keep them. dy is zero on output 0, so dx is made of rows 1..31 only."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 96, generator=g, requires_grad=True)
    w = torch.randn(64, 96, generator=g)
    w[0] *= 1e6
    dy = torch.randn(16, 64, generator=g)
    dy[:, 0] = 0.0
    fp8_linear(x, w, scaling="mxfp8").backward(dy)
    dyd = ref_mxfp8(dy, 1, round_e4m3).float()
    along_n, along_k = ref_mxfp8(w, 0, round_e4m3).float(), ref_mxfp8(w, 1, round_e4m3).float()
    torch.testing.assert_close(x.grad, dyd @ along_n, rtol=RTOL_SUM, atol=ATOL_SUM)
    wrong = dyd @ along_k
    assert float((x.grad - wrong).norm() / wrong.norm()) > 0.1


@pytest.mark.parametrize("scaling", VARIANTS)
@pytest.mark.parametrize("row_tile", [None, 8])
def test_the_rollouts_linear_is_the_trainers_bitwise(scaling, row_tile):
    torch.manual_seed(3)
    lin = torch.nn.Linear(200, 96, bias=True)
    train = Fp8Linear.from_linear(lin, scaling=scaling)
    infer = Fp8InferenceLinear.from_linear(lin, scaling=scaling)
    train.row_tile = infer.row_tile = row_tile
    assert infer.weight_scale.dtype == linear_format(scaling).scale_dtype
    x = torch.randn(2, 5, 200)
    with torch.no_grad():
        assert torch.equal(infer(x), train(x))
        if row_tile is not None:  # batch-invariant: a row's numbers do not depend on the rows beside it
            assert torch.equal(infer(x[:1, 2:3]), train(x)[:1, 2:3])


def test_an_inference_linear_refuses_a_bad_scale_and_keeps_serving():
    torch.manual_seed(4)
    lin = torch.nn.Linear(64, 32)
    infer = Fp8InferenceLinear.from_linear(lin, scaling="mxfp8")
    x = torch.randn(3, 64)
    before = infer(x)
    q, s = linear_format("mxfp8").quantize_weight(torch.randn(32, 64))
    bad = s.clone()
    bad[5, 1] = E8M0_NAN
    with pytest.raises(ValueError, match="0xFF"):
        infer.load_quantized(q, bad)
    with pytest.raises(ValueError, match="dtype"):
        infer.load_quantized(q, s.float())
    assert torch.equal(infer(x), before)
    tw = Fp8InferenceLinear.from_linear(lin, scaling="tensorwise")
    q_tw, _ = linear_format("tensorwise").quantize_weight(lin.weight.detach())
    with pytest.raises(ValueError, match="> 0"):
        tw.load_quantized(q_tw, torch.zeros(1, 1))


# ---------------------------------------------------------------------------------------------------------------
# refit payloads
# ---------------------------------------------------------------------------------------------------------------


def _tiny(scaling):
    from fp8rl.model import CausalLM, ModelConfig

    torch.manual_seed(5)
    cfg = ModelConfig(architecture="llama", vocab_size=50, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=3, num_key_value_heads=1, head_dim=32, max_position_embeddings=64,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    master = CausalLM(cfg).eval()
    recipe = recipe_for_role("fp8_e2e", "rollout", scaling=scaling)
    import copy

    return master, convert_model(copy.deepcopy(master), recipe, mode="inference"), recipe


@pytest.mark.parametrize("scaling", VARIANTS)
def test_a_payload_round_trips_in_each_format_and_a_corrupt_scale_is_refused(scaling):
    master, engine, recipe = _tiny(scaling)
    spec = PayloadSpec.for_model(engine)
    prefixes = fp8_linear_names(master, recipe)
    assert prefixes and all(spec.fp8_linears[p].scaling == scaling for p in prefixes)
    with torch.no_grad():
        for p in master.parameters():
            p.add_(0.01 * torch.randn_like(p))
    sd = {k: v for k, v in master.state_dict().items() if k in spec.tensors or k.removesuffix(".weight") in prefixes}
    shipped = quantize_state_dict(sd, prefixes, scaling=scaling)
    scale = shipped[f"{prefixes[0]}.weight_scale"]
    assert scale.dtype == linear_format(scaling).scale_dtype
    ids = torch.randint(0, 50, (2, 9))
    RefitPayload.create(spec, 1, shipped).process().apply(engine)
    from_shipped = engine(ids)
    RefitPayload.create(spec, 2, sd).process().apply(engine)  # master weights, quantized by the engine
    assert torch.equal(engine(ids), from_shipped)
    bad = dict(shipped)
    broken = scale.clone()
    if scaling == "mxfp8":
        broken.view(-1)[7] = E8M0_NAN  # one corrupted E8M0 byte
        match = "0xFF"
    else:
        broken.fill_(float("nan"))
        match = "non-finite"
    bad[f"{prefixes[0]}.weight_scale"] = broken
    with pytest.raises(WeightLoadError, match=match):
        RefitPayload.create(spec, 3, bad)
    wrong = dict(shipped)  # another format's scale for this layer
    other = "tensorwise" if scaling == "mxfp8" else "mxfp8"
    wrong[f"{prefixes[0]}.weight_scale"] = linear_format(other).quantize_weight(sd[f"{prefixes[0]}.weight"])[1]
    with pytest.raises(WeightLoadError, match="weight_scale"):
        RefitPayload.create(spec, 3, wrong)
    assert torch.equal(engine(ids), from_shipped)  # nothing was touched


def test_mxfp8_scales_take_a_quarter_of_fp32_scale_bytes_per_block_and_travel_through_shards():
    from fp8rl.refit.manifest import assemble, build_shards

    master, engine, recipe = _tiny("mxfp8")
    sd = dict(master.state_dict())
    prefixes = fp8_linear_names(master, recipe)
    m, shards = build_shards(sd, 1, job="j", recipe="fp8_e2e", endpoint="", fp8_prefixes=prefixes, scaling="mxfp8")
    scales = [e for e in m.tensors if e.name.endswith(".weight_scale")]
    assert scales and all(e.dtype == "uint8" and e.block_size == (1, 32) for e in scales)
    # one byte per 32 weights: a quarter of an FP32 scale over the same 32
    w = sd[f"{prefixes[0]}.weight"]
    e0 = next(e for e in scales if e.name == f"{prefixes[0]}.weight_scale")
    assert e0.nbytes == w.shape[0] * math.ceil(w.shape[1] / 32)
    tensors = assemble(m, shards)
    spec = PayloadSpec.for_model(engine)
    RefitPayload.create(spec, 1, {k: v for k, v in tensors.items()
                                  if k in spec.tensors or k.endswith((".weight", ".weight_scale"))}).process()
