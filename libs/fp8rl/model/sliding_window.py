"""Sliding-window attention: :class:`~fp8rl.model.transformer.Attention` whose queries see only the last ``window``
keys (themselves included), with the score scale a family chooses.

A query at slot ``s`` sees key slot ``j`` when it is visible already (causal, not padding) and ``s - j < window`` —
transformers' rule (``kv_idx > q_idx - sliding_window``). Slots are positions wherever it matters: every engine
lays a row's keys out contiguously (the rollout left-padded, the trainer right-padded, a shared prefix first), so
a slot distance between real tokens is their position distance.

The window narrows visibility and drops nothing: the KV cache keeps every key and a key outside the window gets
probability exactly 0 — in the additive mask (a large negative) and in split-KV attention (its ``visible``), the
same keys on both paths, so decode and the full forward stay bitwise alike under batch invariance.
"""

from __future__ import annotations

import dataclasses

import torch

from .config import ModelConfig
from .invariant import KeyLayout
from .transformer import Attention

__all__ = ["SlidingWindowAttention"]


class SlidingWindowAttention(Attention):
    """GQA attention over a window of keys (module docstring); ``window`` None: every visible key (a global layer).

    Args:
        config: the model's; ``layer_idx`` this layer's.
        window: keys a query sees, itself included (None: all).
        score_scale: of the scores ``q·k`` (None: ``head_dim ** -0.5``).
    """

    def __init__(self, config: ModelConfig, layer_idx: int, window: int | None,
                 score_scale: float | None = None) -> None:
        super().__init__(config, layer_idx)
        if window is not None and window < 1:
            raise ValueError(f"sliding window must be >= 1 key, got {window}")
        self.window = window
        if score_scale is not None:
            self.score_scale = score_scale

    def restrict(self, mask: torch.Tensor | None, layout: KeyLayout | None
                 ) -> tuple[torch.Tensor | None, KeyLayout | None]:
        W = self.window
        if W is None:
            return mask, layout
        if layout is not None:
            if layout.qpos is None:
                raise ValueError("a sliding window needs the layout's query positions (KeyLayout.build)")
            j = torch.arange(layout.index.shape[1], device=layout.qpos.device)
            near = (layout.qpos[:, :, None] - j[None, None, :]) < W  # (B, T, Sc)
            return mask, dataclasses.replace(layout, visible=layout.visible & near[:, None])
        T, S = mask.shape[-2:]  # query i sits at slot S - T + i
        q_slot = torch.arange(S - T, S, device=mask.device)
        far = (q_slot[:, None] - torch.arange(S, device=mask.device)[None, :]) >= W  # (T, S)
        return mask.masked_fill(far, torch.finfo(torch.float32).min), layout

    def extra_repr(self) -> str:
        return f"window={self.window}"
