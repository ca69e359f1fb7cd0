"""RMSNorm with a ``(1 + weight)`` gain (Gemma): the weight is stored as the gain's offset from 1 (zeros at init)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["OffsetRMSNorm"]


class OffsetRMSNorm(nn.Module):
    """``x / sqrt(mean(x**2) + eps) * (1 + weight)``, all in FP32, cast back at the end — Gemma's order (Llama's
    :class:`~fp8rl.model.layers.RMSNorm` casts before the weight multiply)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
