"""Blockwise scaling (the default; DeepSeek-V3 / Transformer Engine "blockwise"): weights in 128x128 tiles,
activations and gradients in 1x128 groups along each GEMM's reduction, FP32 scales. The tiles serve both of the
weight's orientations, so dgrad multiplies the forward form's transpose. Its Hopper fast path is
:func:`fp8rl.fp8.linear.fp8_gemm`; every engine runs it (it is what vLLM's block-scaled FP8 checkpoints hold)."""

from __future__ import annotations

import math

from ..quant import (
    BLOCK,
    dequantize_blockwise,
    dequantize_columnwise,
    fake_quantize_columnwise,
    fake_quantize_per_token_group,
    quantize_blockwise,
    quantize_columnwise,
)
from .base import LinearFormat
from .registry import register


class Blockwise(LinearFormat):
    name = "blockwise"
    label = "w 128x128, act 1x128"
    has_fast_gemm = True
    summary = "weights 128x128, activations and gradients 1x128, FP32 scales"

    def scale_shape(self, n, k):
        return (math.ceil(n / BLOCK), math.ceil(k / BLOCK))

    def block_size(self, n, k):
        return (BLOCK, BLOCK)

    def quantize_weight(self, w, *, pow2=False, name=None, out=None):
        return quantize_blockwise(w, pow2_scale=pow2, name=name, out=out)

    def dequantize_weight(self, q, s, out=None):
        return dequantize_blockwise(q, s, out=out)

    def fake_act(self, x, pow2, invariant):
        return fake_quantize_per_token_group(x, pow2_scale=pow2)  # per token already: batch-invariant as it is

    def save_act(self, x, pow2):
        return quantize_columnwise(x, pow2_scale=pow2)  # (T, K), (T/128, K): token-major, no transpose copy

    def load_act(self, saved):
        return dequantize_columnwise(*saved)

    def fake_grad_dgrad(self, g, pow2):
        return fake_quantize_per_token_group(g, pow2_scale=pow2)

    def fake_grad_wgrad(self, g, pow2):
        return fake_quantize_columnwise(g, pow2_scale=pow2)

    def weight_for_dgrad(self, weight, q, s, pow2):
        return dequantize_blockwise(q, s)  # 128x128 tiles serve both orientations


register(Blockwise())
