"""GeGLU MLP: ``down(gelu_tanh(gate(x)) * up(x))`` (Gemma's ``gelu_pytorch_tanh``): the SwiGLU expert's layer and
names (:class:`~fp8rl.model.moe.ExpertMLP`: plain ``gate_proj`` / ``up_proj`` / ``down_proj`` linears, so FP8
conversion and batch invariance treat them alike) with GELU (tanh approximation) in place of SiLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .moe import ExpertMLP

__all__ = ["GeGLUMLP"]


class GeGLUMLP(ExpertMLP):
    """``(..., C)`` -> ``(..., C)`` through an inner width of ``intermediate_size``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))
