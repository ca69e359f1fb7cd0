"""The Qwen3-VL vision encoder: Qwen2.5-VL's (:mod:`fp8rl.model.vision`) with learned positions and DeepStack.

What differs from :class:`~fp8rl.model.vision.VisionEncoder`:

* the patch embedding carries a bias;
* a learned ``side × side`` table of position embeddings (``pos_embed``) is resampled to each image's patch grid —
  bilinear, corners aligned: patch row ``r`` of ``h`` reads table row ``r (side − 1) / (h − 1)`` between its two
  neighbours, columns alike — and added to the patch embeddings;
* no windows: every block attends within a frame; LayerNorm (ε 1e-6) instead of RMSNorm; a biased
  ``linear_fc1 → GELU (tanh) → linear_fc2`` MLP;
* the merger normalises each patch before merging its cell; **DeepStack**: after each block of
  ``deepstack_visual_indexes`` a merger of its own (normalising the merged cell) makes one more embedding per cell,
  which the language model adds to the image tokens' hidden states after its layer ``k`` (the ``k``-th of them).

Its output is one row per merged cell: the embedding that replaces the image token, then the DeepStack embeddings,
concatenated (``(cells, (1 + k) · out_hidden_size)``), so the engines pass and cache it as one tensor and the model
splits it (:meth:`fp8rl.model.CausalLM.forward`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .vision import (
    ImageBatch,
    PatchEmbed,
    VisionAttention,
    VisionBlock,
    check_images,
    patch_rows_cols,
    rotary_inv_freq,
    rotary_tables,
)

__all__ = ["DeepstackVisionEncoder"]

_EPS = 1e-6


class _Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden, bias=True)
        self.linear_fc2 = nn.Linear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class _Merger(nn.Module):
    """A cell's patches → one embedding; the norm before the merge (the main merger) or after it (DeepStack's)."""

    def __init__(self, dim: int, cell: int, out: int, *, after: bool) -> None:
        super().__init__()
        self.cell_width, self.after = dim * cell, after
        self.norm = nn.LayerNorm(self.cell_width if after else dim, eps=_EPS)
        self.linear_fc1 = nn.Linear(self.cell_width, self.cell_width)
        self.linear_fc2 = nn.Linear(self.cell_width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.cell_width)) if self.after else self.norm(x).view(-1, self.cell_width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def _taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two table rows a position reads (corners aligned) and their bilinear weights, ``(N, 2)`` each."""
    src = index.float() * (side - 1) / torch.clamp(size - 1, min=1).float()
    base = torch.floor(src)
    offsets = torch.arange(2)
    taps = (base.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - base[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


class DeepstackVisionEncoder(nn.Module):
    """Qwen3-VL's vision tower (module docstring) under transformers' names (``model.visual.*`` of the checkpoint,
    ``visual.*`` here).

    Args:
        vision_config: the checkpoint's ``vision_config`` (``depth``, ``hidden_size``, ``num_heads``,
            ``intermediate_size``, ``out_hidden_size``, ``patch_size``, ``temporal_patch_size``, ``in_channels``,
            ``spatial_merge_size``, ``num_position_embeddings``, ``deepstack_visual_indexes``, ``hidden_act``
            gelu_pytorch_tanh).
    """

    def __init__(self, vision_config: dict[str, Any]) -> None:
        super().__init__()
        c = vision_config
        dim, heads = int(c["hidden_size"]), int(c["num_heads"])
        self.patch = int(c.get("patch_size", 16))
        self.merge = int(c.get("spatial_merge_size", 2))
        self.deepstack = [int(i) for i in c.get("deepstack_visual_indexes", ())]
        self.patch_embed = PatchEmbed(int(c.get("in_channels", 3)), int(c.get("temporal_patch_size", 2)),
                                      self.patch, dim, bias=True)
        self.pos_embed = nn.Embedding(int(c["num_position_embeddings"]), dim)
        self.side = int(int(c["num_position_embeddings"]) ** 0.5)
        self.blocks = nn.ModuleList(
            VisionBlock(nn.LayerNorm(dim, eps=_EPS), nn.LayerNorm(dim, eps=_EPS), VisionAttention(dim, heads),
                        _Mlp(dim, int(c["intermediate_size"]))) for _ in range(int(c["depth"])))
        cell, out = self.merge**2, int(c["out_hidden_size"])
        self.merger = _Merger(dim, cell, out, after=False)
        self.deepstack_merger_list = nn.ModuleList(_Merger(dim, cell, out, after=True) for _ in self.deepstack)
        self._inv_freq = rotary_inv_freq(c, dim // heads)

    def _positions(self, rows: torch.Tensor, cols: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Each patch's learned position embedding, resampled to its image's grid (module docstring)."""
        heights = torch.cat([torch.full((t * h * w,), h) for t, h, w in grids])
        widths = torch.cat([torch.full((t * h * w,), w) for t, h, w in grids])
        r_taps, r_w = _taps(rows, heights, self.side)
        c_taps, c_w = _taps(cols, widths, self.side)
        index = (r_taps[:, :, None] * self.side + c_taps[:, None, :]).reshape(-1, 4).to(self.pos_embed.weight.device)
        weight = (r_w[:, :, None] * c_w[:, None, :]).reshape(-1, 4).to(self.pos_embed.weight.device)
        return (self.pos_embed(index) * weight[:, :, None]).sum(1)

    def forward(self, images: ImageBatch) -> torch.Tensor:
        """``(cells, (1 + k) · out_hidden_size)``: per merged cell, its embedding, then its ``k`` DeepStack ones.

        Raises:
            ValueError: grids that do not fit ``pixel_values`` or the merge size.
        """
        grids = check_images(images, self.merge)
        x = self.patch_embed(images.pixel_values)  # (N, C)
        rows, cols = patch_rows_cols(grids, self.merge)
        x = x + self._positions(rows, cols, grids).to(x.dtype)
        device = x.device
        cos, sin = rotary_tables(rows.to(device), cols.to(device), self._inv_freq.to(device))
        frames = [h * w for t, h, w in grids for _ in range(t)]
        deep = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in self.deepstack:
                deep.append(self.deepstack_merger_list[self.deepstack.index(i)](x))
        return torch.cat([self.merger(x), *deep], dim=-1)

    def extra_repr(self) -> str:
        return f"patch={self.patch}, merge={self.merge}, deepstack={self.deepstack}"
