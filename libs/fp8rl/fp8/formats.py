"""The FP8 scaling formats a linear can run under (``fp8_recipe``): what each GEMM operand is quantized like.

Every format answers the same questions, so the linears (:mod:`fp8rl.fp8.linear`), the refit payload
(:mod:`fp8rl.fp8.payload`), the manifest (:mod:`fp8rl.refit.manifest`) and the engines treat them alike:

==================  ==========================  ===========================  ==========================
operand             blockwise (default)         mxfp8                        tensorwise
==================  ==========================  ===========================  ==========================
weight (forward)    128x128 tiles, FP32 scales  1x32 along K, E8M0 scales     one FP32 scale
weight (dgrad)      the same tiles              1x32 along N, from the        the same scale
                                                high-precision weight
x (forward)         1x128 along K               1x32 along K                  one scale (per token with
                                                                              batch-invariant numerics)
dy (dgrad)          1x128 along N               1x32 along N                  one scale
x, dy (wgrad)       1x128 along T               1x32 along T                  one scale
==================  ==========================  ===========================  ==========================

Each orientation is quantized from the high-precision tensor, never from another quantized copy. The weight's
forward form is what a rollout holds and what a refit ships (``X.weight`` E4M3 + ``X.weight_scale``); its scale
tensor has :meth:`LinearFormat.scale_shape` and :attr:`LinearFormat.scale_dtype` (uint8 E8M0 exponents for mxfp8,
so 0xFF — E8M0's NaN — is refused wherever a scale arrives).

On the reference backend every quantized operand enters its GEMM as its FP32 dequantization (the ``fake_*``
methods: the same numbers as quantizing and dequantizing). Blockwise keeps its Hopper fast path
(:func:`fp8rl.fp8.linear.fp8_gemm`); mxfp8 and tensorwise run the reference GEMMs on every device.
"""

from __future__ import annotations

import math

import torch

from .mxfp8 import E8M0_NAN, MX_BLOCK, dequantize_mxfp8, fake_quantize_mxfp8, quantize_mxfp8
from .quant import (
    BLOCK,
    check_finite,
    dequantize_blockwise,
    dequantize_columnwise,
    fake_quantize_columnwise,
    fake_quantize_per_token_group,
    quantize_blockwise,
    quantize_columnwise,
)
from .tensorwise import dequantize_tensorwise, fake_quantize_tensorwise, quantize_tensorwise

__all__ = ["SCALINGS", "LinearFormat", "linear_format"]

SCALINGS = ("blockwise", "mxfp8", "tensorwise")


class LinearFormat:
    """One scaling format (see the module table). Stateless; :func:`linear_format` returns the shared instance."""

    name: str = ""
    scale_dtype: torch.dtype = torch.float32

    def scale_shape(self, n: int, k: int) -> tuple[int, int]:
        """Shape of the scale of an ``(n, k)`` weight in its forward form."""
        raise NotImplementedError

    def block_size(self, n: int, k: int) -> tuple[int, int]:
        """The ``(rows, cols)`` of weight elements one scale covers (the refit manifest records it)."""
        raise NotImplementedError

    def quantize_weight(self, w: torch.Tensor, *, pow2: bool = False, name: str | None = None,
                        out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(E4M3 (n, k), scale)`` of a 2-D high-precision weight in its forward form; ValueError on NaN/Inf.
        ``out`` (blockwise only) writes into given tensors."""
        raise NotImplementedError

    def dequantize_weight(self, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """FP32 ``(n, k)`` of a weight's forward form."""
        raise NotImplementedError

    def check_scale(self, name: str, s: torch.Tensor, weight_shape: tuple[int, int]) -> None:
        """ValueError naming ``name`` unless ``s`` is a valid scale of an ``weight_shape`` weight (shape, dtype,
        value range)."""
        want = self.scale_shape(*weight_shape)
        if tuple(s.shape) != want:
            raise ValueError(f"{name}: shape {tuple(s.shape)} != expected {want} ({self.name} scales)")
        if s.dtype != self.scale_dtype:
            raise ValueError(f"{name}: dtype {s.dtype} != {self.scale_dtype} ({self.name} scales)")
        check_finite(s, name)
        if not bool((s > 0).all()):
            raise ValueError(f"{name}: scales must be > 0")

    # the training GEMMs' operands, as FP32 dequantizations
    def fake_act(self, x: torch.Tensor, pow2: bool, invariant: bool) -> torch.Tensor:
        """The forward activation ``(T, K)`` quantized along K; ``invariant``: batch-invariant numerics."""
        raise NotImplementedError

    def save_act(self, x: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, ...]:
        """What the forward keeps of ``x`` for wgrad: its E4M3 form along T, and scales."""
        raise NotImplementedError

    def load_act(self, saved: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """FP32 ``(T, K)`` of :meth:`save_act`'s tensors."""
        raise NotImplementedError

    def fake_grad_dgrad(self, g: torch.Tensor, pow2: bool) -> torch.Tensor:
        """The output gradient ``(T, N)`` quantized along N (dgrad's reduction)."""
        raise NotImplementedError

    def fake_grad_wgrad(self, g: torch.Tensor, pow2: bool) -> torch.Tensor:
        """The output gradient ``(T, N)`` quantized along T (wgrad's reduction)."""
        raise NotImplementedError

    def weight_for_dgrad(self, weight: torch.Tensor, q: torch.Tensor, s: torch.Tensor, pow2: bool) -> torch.Tensor:
        """FP32 ``(N, K)`` weight as dgrad multiplies it (quantized along N)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"LinearFormat({self.name})"


class Blockwise(LinearFormat):
    name = "blockwise"

    def scale_shape(self, n, k):
        return (math.ceil(n / BLOCK), math.ceil(k / BLOCK))

    def block_size(self, n, k):
        return (BLOCK, BLOCK)

    def quantize_weight(self, w, *, pow2=False, name=None, out=None):
        return quantize_blockwise(w, pow2_scale=pow2, name=name, out=out)

    def dequantize_weight(self, q, s):
        return dequantize_blockwise(q, s)

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


class Mxfp8(LinearFormat):
    name = "mxfp8"
    scale_dtype = torch.uint8

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

    def dequantize_weight(self, q, s):
        return dequantize_mxfp8(q, s, dim=1)

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


class Tensorwise(LinearFormat):
    name = "tensorwise"

    def scale_shape(self, n, k):
        return (1, 1)

    def block_size(self, n, k):
        return (n, k)

    def quantize_weight(self, w, *, pow2=False, name=None, out=None):
        q, s = quantize_tensorwise(w, pow2_scale=pow2, name=name)
        if out is not None:
            out[0].copy_(q)
            out[1].copy_(s)
            return out
        return q, s

    def dequantize_weight(self, q, s):
        return dequantize_tensorwise(q, s)

    def fake_act(self, x, pow2, invariant):
        return fake_quantize_tensorwise(x, pow2_scale=pow2, rows=invariant)

    def save_act(self, x, pow2):
        return quantize_tensorwise(x, pow2_scale=pow2)

    def load_act(self, saved):
        return dequantize_tensorwise(*saved)

    def fake_grad_dgrad(self, g, pow2):
        return fake_quantize_tensorwise(g, pow2_scale=pow2)

    def fake_grad_wgrad(self, g, pow2):
        return fake_quantize_tensorwise(g, pow2_scale=pow2)  # one scale: the same numbers in either orientation

    def weight_for_dgrad(self, weight, q, s, pow2):
        return dequantize_tensorwise(q, s)


_FORMATS = {f.name: f for f in (Blockwise(), Mxfp8(), Tensorwise())}


def linear_format(name: str) -> LinearFormat:
    """The format called ``name`` (one of :data:`SCALINGS`); ValueError naming the choices otherwise."""
    try:
        return _FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown FP8 scaling {name!r}: expected one of {', '.join(SCALINGS)}") from None
