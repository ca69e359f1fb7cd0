"""Quantizer numerics against plain-PyTorch references with named tolerances."""

import math

import pytest
import torch

from fp8rl.fp8 import (
    E4M3,
    E4M3_MAX,
    compute_scale,
    dequantize_blockwise,
    dequantize_per_tensor,
    dequantize_per_token_group,
    quantize_blockwise,
    quantize_per_tensor,
    quantize_per_token_group,
)

# every test on the fused CPU kernels and on the torch path (tests/unit/conftest.py's native_path)
pytestmark = pytest.mark.usefixtures("native_path")

# E4M3 keeps 3 mantissa bits: half an ulp is 2**-4 relative for normal values.
REL_BOUND_NORMAL = 2.0**-4
# Below the smallest normal (2**-6 * scale) the absolute error is half the subnormal step 2**-9.
ABS_BOUND_SUBNORMAL = 2.0**-10
SMALLEST_NORMAL = 2.0**-6


def _check_roundtrip(x, x_hat, scale_full):
    err = (x - x_hat).abs()
    normal = x.abs() >= SMALLEST_NORMAL * scale_full
    assert (err[normal] <= REL_BOUND_NORMAL * x.abs()[normal] + 1e-12).all()
    assert (err[~normal] <= ABS_BOUND_SUBNORMAL * scale_full[~normal] + 1e-12).all()


def _blockwise_reference(w, bm=128, bn=128):
    """Loop-over-tiles reference, written independently of the vectorised code."""
    m, n = w.shape
    q = torch.empty(m, n, dtype=E4M3)
    s = torch.empty(math.ceil(m / bm), math.ceil(n / bn))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            tile = w[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn].float()
            amax = tile.abs().max()
            sc = amax / 448 if amax > 0 else torch.tensor(1.0)
            s[i, j] = sc
            q[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = (tile / sc).clamp(-448, 448).to(E4M3)
    return q, s


@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (300, 200), (576, 1536), (1, 7), (129, 1)])
def test_blockwise_matches_loop_reference_and_shapes(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * 3
    q, s = quantize_blockwise(w)
    assert q.shape == w.shape and q.dtype == E4M3
    assert s.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)) and s.dtype == torch.float32
    q_ref, s_ref = _blockwise_reference(w)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    w_hat = dequantize_blockwise(q, s)
    s_full = s.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    _check_roundtrip(w, w_hat, s_full)


def test_values_on_grid_roundtrip_exactly():
    torch.manual_seed(1)
    grid = torch.randn(256, 256).to(E4M3).float()
    grid[0, 0] = 448.0  # pin each tile's amax to 448 so scale == 1 exactly
    grid[0, 128] = 448.0
    grid[128, 0] = -448.0
    grid[128, 128] = 448.0
    q, s = quantize_blockwise(grid)
    assert torch.equal(s, torch.ones_like(s))
    assert torch.equal(dequantize_blockwise(q, s), grid)
    # per token group and per tensor too
    rows = grid[:, :128].clone()
    rows[:, 0] = 448.0  # every 1x128 group's amax is 448 -> scale 1
    qg, sg = quantize_per_token_group(rows)
    assert torch.equal(sg, torch.ones_like(sg))
    assert torch.equal(dequantize_per_token_group(qg, sg), rows)
    qt, st = quantize_per_tensor(grid)
    assert float(st) == 1.0 and torch.equal(dequantize_per_tensor(qt, st), grid)


def test_zero_block_gets_unit_scale():
    w = torch.zeros(256, 256)
    w[:128, :128] = torch.randn(128, 128)
    q, s = quantize_blockwise(w)
    assert s[1, 1] == 1.0 and s[0, 1] == 1.0 and s[0, 0] != 1.0
    assert (q.float()[128:, 128:] == 0).all()
    _, sg = quantize_per_token_group(torch.zeros(3, 130))
    assert torch.equal(sg, torch.ones(3, 2))


def test_pow2_scales_are_powers_of_two_and_never_overflow():
    torch.manual_seed(2)
    w = torch.randn(300, 260) * 17
    q, s = quantize_blockwise(w, pow2_scale=True)
    log2 = torch.log2(s)
    assert torch.equal(log2, torch.round(log2))
    q_lin, s_lin = quantize_blockwise(w)
    assert (s >= s_lin).all() and (s < 2 * s_lin).all()
    assert q.float().abs().max() <= E4M3_MAX
    # a scale rounded up means no element hits the clamp
    x = torch.randn(4, 300)
    qx, sx = quantize_per_token_group(x, pow2_scale=True)
    assert torch.equal(torch.log2(sx), torch.round(torch.log2(sx)))
    assert compute_scale(torch.tensor(448.0), pow2_scale=True) == 1.0


def test_per_token_group_shapes_padding_and_reference():
    torch.manual_seed(3)
    x = torch.randn(2, 5, 200) * 4
    q, s = quantize_per_token_group(x)
    assert q.shape == x.shape and s.shape == (2, 5, 2)
    # reference: group by group
    for g in range(2):
        sl = x[..., g * 128:(g + 1) * 128]
        assert torch.allclose(s[..., g], sl.abs().amax(-1) / 448, rtol=0, atol=0)
    x_hat = dequantize_per_token_group(q, s)
    s_full = s.repeat_interleave(128, -1)[..., :200]
    _check_roundtrip(x, x_hat, s_full)


def test_per_tensor_with_given_scale_saturates():
    x = torch.tensor([1.0, 10.0, -1000.0])
    q, s = quantize_per_tensor(x, scale=0.5)
    assert float(s) == 0.5
    assert torch.equal(dequantize_per_tensor(q, s), torch.tensor([1.0, 10.0, -224.0]))
    with pytest.raises(ValueError, match="finite and > 0"):
        quantize_per_tensor(x, scale=0.0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weight_is_refused_with_its_name(bad):
    w = torch.randn(64, 64)
    w[3, 5] = bad
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*non-finite"):
        quantize_blockwise(w, name="model.layers.0.mlp.up_proj.weight")


def test_wrong_scale_is_caught():
    """Negative case: a scale that does not belong to the tensor fails the round-trip bound."""
    torch.manual_seed(4)
    w = torch.randn(128, 128)
    q, s = quantize_blockwise(w)
    w_bad = dequantize_blockwise(q, s * 1.5)
    s_full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    with pytest.raises(AssertionError):
        _check_roundtrip(w, w_bad, s_full)
    with pytest.raises(ValueError, match="does not match"):
        dequantize_blockwise(q, torch.ones(2, 2))


def test_blockwise_rejects_non_2d():
    with pytest.raises(ValueError, match="2-D"):
        quantize_blockwise(torch.randn(2, 3, 4))


def test_subnormal_amax_never_gives_nan():
    """Tiny gradients (amax below FP32's smallest normal) must quantize to finite values."""
    x = torch.zeros(4, 256)
    x[0, 3] = 1e-40
    x[1, 200] = -3e-39
    for q, s in (quantize_per_token_group(x), quantize_blockwise(x)):
        assert (s > 0).all()
        assert torch.isfinite(q.float()).all()
    q, s = quantize_per_token_group(x)
    assert torch.isfinite(dequantize_per_token_group(q, s)).all()
    assert (dequantize_per_token_group(q, s) - x).abs().max() < 1e-38


@pytest.mark.parametrize("shape", [(3, 256), (4200, 384), (7, 130), (2, 3, 128)])  # 4200x384 > one chunk
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pow2", [False, True])
def test_fake_quantize_is_bitwise_quantize_then_dequantize(shape, dtype, pow2):
    from fp8rl.fp8.quant import fake_quantize_per_token_group

    g = torch.Generator().manual_seed(7)
    x = torch.randn(*shape, generator=g) * torch.logspace(-30, 3, shape[-1])  # subnormal to large groups
    x[0, ..., :128] = 0  # a zero group (scale 1)
    x = x.to(dtype)
    want = dequantize_per_token_group(*quantize_per_token_group(x, pow2_scale=pow2))
    got = fake_quantize_per_token_group(x, pow2_scale=pow2)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    t = x.reshape(-1, shape[-1]).t()  # a non-contiguous view takes the two-step path: still equal
    assert torch.equal(fake_quantize_per_token_group(t, pow2_scale=pow2),
                       dequantize_per_token_group(*quantize_per_token_group(t, pow2_scale=pow2)))


@pytest.mark.parametrize("shape", [(768, 2048), (300, 130), (5, 7), (256, 128)])
@pytest.mark.parametrize("pow2", [False, True])
def test_columnwise_is_the_transpose_quantized_per_token_group(shape, pow2):
    """wgrad's operands, 1x128 along T, quantized token-major: the same codes and scales as quantizing the
    transpose (what the recipe defines), and the same FP32 values out."""
    from fp8rl.fp8.quant import dequantize_columnwise, fake_quantize_columnwise, quantize_columnwise

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3)) * torch.logspace(-20, 2, shape[0])[:, None]
    q, s = quantize_columnwise(x, pow2_scale=pow2)
    qt, st = quantize_per_token_group(x.t().contiguous(), pow2_scale=pow2)
    assert q.shape == x.shape and torch.equal(q.view(torch.uint8), qt.t().contiguous().view(torch.uint8))
    assert torch.equal(s, st.t())
    want = dequantize_per_token_group(qt, st).t()
    assert torch.equal(dequantize_columnwise(q, s), want) and torch.equal(fake_quantize_columnwise(x, pow2_scale=pow2),
                                                                         want)


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (128, 64)])
def test_blockwise_dequantization_is_each_code_times_its_tile_scale(shape):
    """Whole tiles (a broadcast multiply) and ragged edges alike: element (i, j) is its E4M3 value times the scale
    of tile (i // 128, j // 128), one FP32 multiply — checked element by element against a loop over the tiles;
    q is left as it was and a transposed (non-contiguous) q gives its transpose."""
    torch.manual_seed(2)
    q, s = quantize_blockwise(torch.randn(shape) * 5)
    before = q.view(torch.uint8).clone()
    want = torch.empty(shape)
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            tile = (slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128))
            want[tile] = q[tile].float() * s[bi, bj]
    got = dequantize_blockwise(q, s)
    assert torch.equal(got, want) and got.is_contiguous()
    assert torch.equal(q.view(torch.uint8), before)
    assert torch.equal(dequantize_blockwise(q.t(), s.t()), want.t())


def test_columnwise_of_no_tokens_is_empty():
    """An expert no row was routed to quantizes a (0, K) input: no groups, the same as the transpose's."""
    from fp8rl.fp8.quant import dequantize_columnwise, fake_quantize_columnwise, quantize_columnwise

    x = torch.zeros(0, 130)
    q, s = quantize_columnwise(x)
    qt, st = quantize_per_token_group(x.t().contiguous())
    assert (q.shape, s.shape, s.dtype) == ((0, 130), st.t().shape, torch.float32) == ((0, 130), (0, 130), torch.float32)
    assert dequantize_columnwise(q, s).shape == fake_quantize_columnwise(x).shape == (0, 130)
