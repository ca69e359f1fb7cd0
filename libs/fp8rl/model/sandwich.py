"""The sandwich-norm decoder layer (Gemma 2/3): a norm before *and after* both the attention and the MLP,
``x + post_attn_norm(attn(in_norm(x)))`` then ``+ post_ff_norm(mlp(pre_ff_norm(.)))``; HF's names
(``input_layernorm``, ``post_attention_layernorm``, ``pre_feedforward_layernorm``, ``post_feedforward_layernorm``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .invariant import KeyLayout
from .kv_cache import KVCache
from .shared_prefix import SharedPrefix

__all__ = ["SandwichLayer"]


class SandwichLayer(nn.Module):
    """A decoder layer (module docstring) of the given attention and MLP, its four norms made by ``norm()``.

    Attributes:
        rope_key: the RoPE table its attention rotates by (the family's ``rope_inv_freqs``).
    """

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, norm: Callable[[], nn.Module], rope_key: str) -> None:
        super().__init__()
        self.input_layernorm = norm()
        self.self_attn = self_attn
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = mlp
        self.post_feedforward_layernorm = norm()
        self.rope_key = rope_key

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        kv_cache: KVCache | None = None,
        layout: KeyLayout | None = None,
        prefix: SharedPrefix | None = None,
    ) -> torch.Tensor:
        """``x`` ``(B, T, C)`` -> ``(B, T, C)``; arguments as :meth:`~fp8rl.model.transformer.Attention.forward`."""
        h = self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache, layout, prefix)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
