"""A token embedding multiplied by a constant (Gemma: ``sqrt(hidden_size)``), the constant rounded to the weight's
dtype first as transformers does; the parameter keeps HF's name (``embed_tokens.weight``), the scale is no tensor of
the state dict."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ScaledEmbedding"]


class ScaledEmbedding(nn.Embedding):
    """``embedding(ids) * scale``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.scale = float(scale)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * torch.tensor(self.scale, dtype=self.weight.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale:.6g}"
