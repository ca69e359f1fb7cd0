"""GeGLU MLP: ``down(gelu_tanh(gate(x)) * up(x))`` (Gemma's ``gelu_pytorch_tanh``), HF's names (``gate_proj``,
``up_proj``, ``down_proj``: plain linears, so FP8 conversion and batch invariance treat them like SwiGLU's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GeGLUMLP"]


class GeGLUMLP(nn.Module):
    """``(..., C)`` -> ``(..., C)`` through an inner width of ``intermediate_size``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))
