"""MXFP8 (OCP Microscaling): E4M3 elements in blocks of 32 consecutive values, one E8M0 scale per block.

The format (issue 32; ``FP8.md``)::

    x ≈ q.float() * 2 ** (s - 127)        s: uint8, the block's biased exponent (E8M0)
    2 ** (s - 127) = the smallest power of two >= amax / 448      (no element saturates)

An all-zero block gets ``2 ** 0`` (``s = 127``). The exponent is clamped to E8M0's finite range [-127, 127]
(``s`` in [0, 254]); ``s = 255`` is E8M0's NaN and is refused wherever a scale is read. Scales are one byte per 32
values — a quarter of an FP32 scale per 32 values, 1/128 of the elements' bytes.

Blocks run along ``dim`` (the GEMM's reduction dimension of the operand: a weight is quantized row-wise for the
forward and column-wise for dgrad, activations and gradients token-wise); a ``dim`` whose length is not a multiple
of 32 is zero-padded internally, as the blockwise path pads: ``q`` has the input's shape, the scale tensor has
``ceil(n / 32)`` entries along ``dim``. Dividing by a power of two is exact, so the only rounding is the cast to
E4M3 (round to nearest even): a normal element round-trips within a relative 2**-4, a subnormal one within
2**-10 · 2**e absolute.
"""

from __future__ import annotations

import math

import torch

from .quant import E4M3, E4M3_MAX, check_finite

__all__ = ["MX_BLOCK", "E8M0_BIAS", "E8M0_NAN", "e8m0_exponents", "e8m0_to_float", "quantize_mxfp8",
           "dequantize_mxfp8", "fake_quantize_mxfp8"]

MX_BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 0xFF
_E_MIN, _E_MAX = -127, 127


def e8m0_exponents(amax: torch.Tensor) -> torch.Tensor:
    """The biased E8M0 exponent (uint8) of each block's scale: the smallest ``e`` with ``2**e * 448 >= amax``,
    clamped to [-127, 127]; 127 (``2**0``) where ``amax`` is 0.

    Exact, from the FP32 bits of ``amax`` (no logarithm): with ``amax = m * 2**E``, ``m`` in [0.5, 1)
    (:func:`torch.frexp`) and ``448 = 0.875 * 2**9``, the smallest such ``e`` is ``E - 9`` when ``m <= 0.875``, else
    ``E - 8``."""
    m, ex = torch.frexp(amax.float())
    e = torch.where(m <= 0.875, ex - 9, ex - 8)
    e = torch.where(amax > 0, e, torch.zeros_like(e)).clamp_(_E_MIN, _E_MAX)
    return (e + E8M0_BIAS).to(torch.uint8)


def e8m0_to_float(scale: torch.Tensor, *, name: str | None = None) -> torch.Tensor:
    """``2 ** (s - 127)`` in FP32 (exact: every E8M0 value is an FP32, 2**-127 a subnormal one); ValueError for a
    scale that is not uint8 or holds E8M0's NaN (0xFF)."""
    label = f"{name}: " if name else ""
    if scale.dtype != torch.uint8:
        raise ValueError(f"{label}an MXFP8 scale is uint8 (biased E8M0 exponents), got {scale.dtype}")
    nan = scale == E8M0_NAN
    if bool(nan.any()):
        raise ValueError(f"{label}{int(nan.sum())} MXFP8 scale(s) are 0xFF, E8M0's NaN")
    return torch.ldexp(torch.ones(scale.shape, dtype=torch.float32), scale.to(torch.int32) - E8M0_BIAS)


def quantize_mxfp8(x: torch.Tensor, dim: int = -1, *, name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``q`` E4M3 of ``x``'s shape, ``scale`` uint8 E8M0 with ``ceil(n / 32)`` entries along ``dim``
    (see the module docstring). ValueError naming ``name`` for a NaN or Inf in ``x``."""
    check_finite(x, name)
    blocks, dim, n = _blocks(x, dim)
    s = e8m0_exponents(blocks.abs().amax(dim=-1))
    q = (blocks / e8m0_to_float(s).unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    q = q.reshape(*blocks.shape[:-2], -1)[..., :n]
    return q.movedim(-1, dim).contiguous(), s.movedim(-1, dim).contiguous()


def _blocks(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, int, int]:
    """``x`` as FP32 ``(..., g, 32)`` blocks along ``dim`` (moved last, zero-padded), ``dim`` normalised, and
    its length."""
    dim = dim % x.dim() if x.dim() else 0
    xt = x.float().movedim(dim, -1)
    n = xt.shape[-1]
    g = -(-n // MX_BLOCK)
    if g * MX_BLOCK != n:
        xt = torch.nn.functional.pad(xt, (0, g * MX_BLOCK - n))
    return xt.reshape(*xt.shape[:-1], g, MX_BLOCK), dim, n


def fake_quantize_mxfp8(x: torch.Tensor, dim: int = -1, *, name: str | None = None) -> torch.Tensor:
    """``dequantize_mxfp8(*quantize_mxfp8(x, dim), dim)`` in one pass (FP32, bitwise the same numbers): what a GEMM
    operand quantized 1x32 along ``dim`` contributes on the reference backend."""
    check_finite(x, name)
    blocks, dim, n = _blocks(x, dim)
    scale = e8m0_to_float(e8m0_exponents(blocks.abs().amax(dim=-1))).unsqueeze(-1)
    y = (blocks / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3).float().mul_(scale)
    y = y.reshape(*blocks.shape[:-2], -1)[..., :n]
    return y.movedim(-1, dim).contiguous()


def dequantize_mxfp8(q: torch.Tensor, scale: torch.Tensor, dim: int = -1, dtype: torch.dtype = torch.float32,
                     *, name: str | None = None) -> torch.Tensor:
    """Inverse of :func:`quantize_mxfp8`: ``q.float() * 2 ** (scale - 127)`` block by block along ``dim``;
    ValueError for a scale of the wrong shape or dtype, or holding 0xFF (NaN)."""
    label = f"{name}: " if name else ""
    if q.dtype != E4M3:
        raise ValueError(f"{label}MXFP8 elements are {E4M3}, got {q.dtype}")
    dim = dim % q.dim() if q.dim() else 0
    n = q.shape[dim]
    want = (*q.shape[:dim], math.ceil(n / MX_BLOCK), *q.shape[dim + 1:])
    if tuple(scale.shape) != want:
        raise ValueError(f"{label}MXFP8 scale shape {tuple(scale.shape)} does not match elements "
                         f"{tuple(q.shape)} with blocks of {MX_BLOCK} along dim {dim}: expected {want}")
    s = e8m0_to_float(scale, name=name).repeat_interleave(MX_BLOCK, dim=dim).narrow(dim, 0, n)
    return (q.float() * s).to(dtype)
