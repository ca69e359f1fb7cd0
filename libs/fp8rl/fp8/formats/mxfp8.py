"""MXFP8 (OCP microscaling): 1x32 blocks along each GEMM's reduction dimension with E8M0 (power-of-two) scales
stored as uint8 exponents — 0xFF, E8M0's NaN, is refused wherever a scale arrives. dgrad needs the weight quantized
along N, taken from the high-precision master (so a frozen LoRA base keeps its master). Runs on the torch engines
(reference GEMMs on every device) and Megatron; fp8rl's vLLM rollout does not load it."""

from __future__ import annotations

import math

import torch

from ..mxfp8 import E8M0_NAN, MX_BLOCK, dequantize_mxfp8, fake_quantize_mxfp8, quantize_mxfp8
from .base import VLLM_BLOCKWISE_ONLY, LinearFormat
from .registry import register


class Mxfp8(LinearFormat):
    name = "mxfp8"
    scale_dtype = torch.uint8
    label = "mxfp8: 1x32 E8M0"
    summary = ("OCP microscaling: 1x32 blocks along each GEMM's reduction dimension, E8M0 power-of-two "
               "scales")
    freezes_to_fp8 = False
    dgrad_from_master = True
    refusals = {"vllm": VLLM_BLOCKWISE_ONLY}

    def scale_shape(self, n, k):
        return (n, math.ceil(k / MX_BLOCK))

    def block_size(self, n, k):
        return (1, MX_BLOCK)

    def quantize_weight(self, w, *, pow2=False, name=None, out=None):
        if out is not None:
            q, s = quantize_mxfp8(w, dim=1, name=name)
            out[0].copy_(q)
            out[1].copy_(s)
            return out
        return quantize_mxfp8(w, dim=1, name=name)  # E8M0 scales are powers of two: pow2 has nothing to round

    def dequantize_weight(self, q, s, out=None):
        return self._into(dequantize_mxfp8(q, s, dim=1), out)

    def check_scale(self, name, s, weight_shape):
        want = self.scale_shape(*weight_shape)
        if tuple(s.shape) != want:
            raise ValueError(f"{name}: shape {tuple(s.shape)} != expected {want} (mxfp8 scales)")
        if s.dtype != torch.uint8:
            raise ValueError(f"{name}: dtype {s.dtype} != torch.uint8 (mxfp8 scales are E8M0 exponents)")
        nan = s == E8M0_NAN
        if bool(nan.any()):
            raise ValueError(f"{name}: {int(nan.sum())} E8M0 scale(s) are 0xFF (E8M0's NaN)")

    def fake_act(self, x, pow2, invariant):
        return fake_quantize_mxfp8(x, dim=1)  # per token: batch-invariant as it is

    def save_act(self, x, pow2):
        return quantize_mxfp8(x, dim=0)  # 1x32 along T: (T, K) E4M3, (T/32, K) E8M0

    def load_act(self, saved):
        return dequantize_mxfp8(*saved, dim=0)

    def fake_grad_dgrad(self, g, pow2):
        return fake_quantize_mxfp8(g, dim=1)

    def fake_grad_wgrad(self, g, pow2):
        return fake_quantize_mxfp8(g, dim=0)

    def weight_for_dgrad(self, weight, q, s, pow2):
        return fake_quantize_mxfp8(weight.detach(), dim=0)  # column-wise, from the high-precision weight


register(Mxfp8())
