"""Per-tensor current scaling ("tensorwise", issue 32): one FP32 scale per GEMM operand, E4M3 elements.

The format (``FP8.md``)::

    x ≈ q.float() * scale          scale = amax(|x|) / 448, the amax of the tensor as it is now (no history)

with :func:`fp8rl.fp8.quant.compute_scale`'s conventions (1.0 for an all-zero tensor, power-of-two rounding up with
``pow2_scale``). A 2-D operand's scale has shape ``(1, 1)``, so it broadcasts over the operand and a weight's scale
travels as a one-block grid beside it. One scale serves both orientations of an operand: quantizing the transpose
gives the same codes.

``rows=True`` scales each row (token) on its own instead, ``(T, 1)``: a tensor-wide amax over a batch depends on
which other tokens share the batch, so no engine could reproduce another's numbers for a token. Batch-invariant
numerics (:mod:`fp8rl.model.invariant`) use it for the forward activations of both engines — the one place where a
token's logprob would otherwise depend on its batch; weights and gradients stay per tensor.
"""

from __future__ import annotations

import torch

from .quant import E4M3, E4M3_MAX, check_finite, compute_scale

__all__ = ["quantize_tensorwise", "dequantize_tensorwise", "fake_quantize_tensorwise"]


def _scale(x: torch.Tensor, pow2_scale: bool, rows: bool) -> torch.Tensor:
    a = x.detach().abs()
    amax = a.amax(dim=-1, keepdim=True) if rows else a.amax().reshape([1] * max(x.dim(), 1))
    return compute_scale(amax, pow2_scale=pow2_scale)


def quantize_tensorwise(x: torch.Tensor, *, pow2_scale: bool = False, rows: bool = False,
                        name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``q`` E4M3 of ``x``'s shape, ``scale`` FP32 of ``x``'s rank with every dim 1 (``rows``: the
    last dim 1). ValueError naming ``name`` for a NaN or Inf in ``x``."""
    check_finite(x, name)
    scale = _scale(x, pow2_scale, rows)
    return (x.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def dequantize_tensorwise(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, *,
                          name: str | None = None) -> torch.Tensor:
    """Inverse of :func:`quantize_tensorwise`: ``q.float() * scale``; ValueError for a scale that is not FP32 with
    one entry per tensor (or per row)."""
    label = f"{name}: " if name else ""
    if q.dtype != E4M3:
        raise ValueError(f"{label}tensorwise FP8 elements are {E4M3}, got {q.dtype}")
    if scale.dtype != torch.float32 or tuple(scale.shape) not in ((1,) * q.dim(), (*q.shape[:-1], 1)):
        raise ValueError(f"{label}tensorwise scale must be FP32 of shape {(1,) * q.dim()}, got {scale.dtype} "
                         f"{tuple(scale.shape)}")
    return (q.float() * scale).to(dtype)


def fake_quantize_tensorwise(x: torch.Tensor, *, pow2_scale: bool = False, rows: bool = False,
                             name: str | None = None) -> torch.Tensor:
    """``dequantize_tensorwise(*quantize_tensorwise(x, ...))`` in one pass (FP32, the same numbers)."""
    check_finite(x, name)
    scale = _scale(x, pow2_scale, rows)
    return (x.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3).float().mul_(scale)
