"""MXFP8 quantization (issue 32's format): E4M3 in blocks of 32 along a dimension, one E8M0 scale per block.

References here are independent of the code under test: the scale rule is checked against exact float64
comparisons (smallest power of two >= amax / 448), and the element rounding against a nearest-even search over the
table of all finite E4M3 values (``round_e4m3`` in this folder's conftest: built from the format's bit layout, not
from a cast).
"""

import math

import pytest
import torch

from fp8rl.fp8 import E4M3, dequantize_mxfp8, quantize_mxfp8
from fp8rl.fp8.mxfp8 import E8M0_NAN, e8m0_exponents


def test_the_scale_is_the_smallest_power_of_two_that_keeps_every_element_unsaturated():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 320, generator=g) * torch.logspace(-6, 6, 16).unsqueeze(1)
    x[3, 32:64] = 0.0  # an all-zero block: 2**0
    x[5, 0] = 448.0 * 2.0 ** 3  # a block whose amax / 448 is a power of two exactly
    q, s = quantize_mxfp8(x)
    assert q.dtype == E4M3 and s.dtype == torch.uint8 and s.shape == (16, 10)
    amax = x.double().view(16, 10, 32).abs().amax(-1)
    e = s.double() - 127
    nz = amax > 0
    assert bool((torch.ldexp(torch.full_like(amax, 448.0), e) >= amax)[nz].all())  # nothing saturates
    assert bool((torch.ldexp(torch.full_like(amax, 448.0), e - 1) < amax)[nz].all())  # and no smaller power would do
    assert int(s[3, 1]) == 127 and int(s[5, 0]) == 127 + 3


def test_elements_are_the_nearest_even_e4m3_of_x_over_the_block_scale(round_e4m3):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 96, generator=g) * 3.0
    q, s = quantize_mxfp8(x)
    scale = torch.ldexp(torch.ones(8, 3, dtype=torch.float64), s.long() - 127).repeat_interleave(32, dim=1)
    want = round_e4m3(x.double() / scale)
    assert torch.equal(q.double(), want)
    deq = dequantize_mxfp8(q, s)
    assert torch.equal(deq.double(), want * scale)  # the multiply by a power of two is exact
    # the error model of the module docstring: relative 2**-4 (normal), absolute 2**-10 * 2**e (subnormal)
    err = (deq.double() - x.double()).abs()
    assert bool((err <= torch.maximum(x.double().abs() * 2.0 ** -4, scale * 2.0 ** -10)).all())


def test_blocks_run_along_the_dimension_asked_for_and_a_partial_block_is_zero_padded():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(70, 6, generator=g)
    q0, s0 = quantize_mxfp8(x, dim=0)  # column-wise: blocks of 32 rows, 70 = 2 full blocks + 6
    qt, st = quantize_mxfp8(x.t().contiguous(), dim=-1)
    assert s0.shape == (3, 6) and q0.shape == x.shape
    assert torch.equal(q0.view(torch.uint8), qt.t().view(torch.uint8)) and torch.equal(s0, st.t())
    padded = torch.cat([x, torch.zeros(26, 6)])
    qp, sp = quantize_mxfp8(padded, dim=0)
    assert torch.equal(q0.view(torch.uint8), qp[:70].view(torch.uint8)) and torch.equal(s0, sp)
    assert torch.equal(dequantize_mxfp8(q0, s0, dim=0), dequantize_mxfp8(qp, sp, dim=0)[:70])


def test_scales_take_a_quarter_of_fp32_scale_bytes():
    from fp8rl.fp8 import quantize_per_token_group

    x = torch.randn(128, 256)
    _, s = quantize_mxfp8(x)
    _, fp32 = quantize_per_token_group(x, 32)  # the same blocks with FP32 scales
    assert s.shape == fp32.shape == (128, 8)
    assert s.numel() * s.element_size() * 4 == fp32.numel() * fp32.element_size()


def test_bad_input_is_refused_with_a_message():
    x = torch.randn(4, 64)
    x[1, 3] = math.nan
    with pytest.raises(ValueError, match="non-finite"):
        quantize_mxfp8(x, name="w")
    q, s = quantize_mxfp8(torch.randn(4, 64))
    bad = s.clone()
    bad[2, 1] = E8M0_NAN
    with pytest.raises(ValueError, match="0xFF, E8M0's NaN"):
        dequantize_mxfp8(q, bad, name="layers.0.w")
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_mxfp8(q, s[:, :1])
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp8(q, s.float())


def test_tiny_and_huge_blocks_clamp_to_e8m0s_range():
    # 1e-45 / 448 is below 2**-127: clamped to s = 0; 3e38 needs 2**120 (448 * 2**119 = 2.98e38 < 3e38); zero: 2**0
    assert e8m0_exponents(torch.tensor([1e-45, 3e38, 0.0])).tolist() == [0, 127 + 120, 127]
