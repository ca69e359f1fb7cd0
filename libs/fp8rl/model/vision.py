"""The Qwen2.5-VL vision encoder: image patches in, one embedding per merged patch cell out (what replaces the image
tokens' embeddings in the language model).

An image is cut by the processor into ``t × h × w`` patches (``t`` frames of ``temporal_patch_size``, each
``patch_size²`` pixels, 3 channels; a still image is two equal frames, ``t = 1``), listed cell by cell of the
``spatial_merge_size²``-patch merge grid (cells row-major, the patches of a cell row-major), each flattened to
``3 · temporal_patch_size · patch_size²`` values. Here:

1. **patch embedding**: one linear map of each patch (a Conv3d whose kernel is its stride, hence a GEMM; kept as
   ``patch_embed.proj`` for its name and shape);
2. **2-D rotary positions**: a patch's row and column each rotate half of a head's frequencies (``theta`` 10000);
3. **windows**: the patches are reordered window by window — squares of ``window_size / patch_size /
   spatial_merge_size`` merge cells, row-major, cut at the image's edge — and each block attends within a window,
   except the blocks of ``fullatt_block_indexes``, which attend within the whole frame (of a still image: the
   image);
4. **blocks**: pre-norm ``x + attn(norm1(x))``, ``+ mlp(norm2(.))``, RMSNorm ε 1e-6, biased ``qkv`` / ``proj``, a
   biased SwiGLU MLP; attention scores, softmax and ``P @ V`` in FP32;
5. **merger**: each cell's ``spatial_merge_size²`` patches normalised, concatenated and mapped by
   ``Linear → GELU → Linear`` to the language model's width; then the cells go back to image order.

Everything runs in the parameters' dtype (never FP8: the recipes quantize the language model's ``self_attn`` and
``mlp`` projections only). Attention runs image by image and window by window (their bounds are host integers from
the grids), so no sequence-squared mask is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .layers import RMSNorm, _rotate_half

__all__ = ["ImageBatch", "PatchEmbed", "VisionAttention", "VisionBlock", "VisionEncoder", "check_images",
           "patch_rows_cols", "rotary_inv_freq", "rotary_tables"]

_EPS = 1e-6  # every norm of the encoder (transformers hard-codes it)


@dataclass(frozen=True)
class ImageBatch:
    """The images of a prompt or a batch, in the order their token runs appear (row by row, left to right).

    Attributes:
        pixel_values: ``(N, 3 · temporal_patch_size · patch_size²)`` patches of every image, image after image.
        grid_thw: ``(n_images, 3)`` int64: each image's patch grid ``(t, h, w)``; ``sum(t · h · w) = N``.
        features: the encoder's outputs ``(cells, C)`` when already computed (the engines encode a prompt's images
            once and share them across its samples and passes), else None.
        rows: of a batch, how many images each row has: a row's image tokens past its images' cells (a response
            that samples the image token) are text. None: the images fill the image-token runs in order.
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    features: torch.Tensor | None = None
    rows: tuple[int, ...] | None = None

    @staticmethod
    def concat(parts: Sequence[ImageBatch | None]) -> ImageBatch | None:
        """The images of several rows (each part one row's, or None) as one batch, row order, with each row's count
        (None when no row has any). Features are kept only when every part has them."""
        held = [p for p in parts if p is not None]
        if not held:
            return None
        feats = [p.features for p in held]
        return ImageBatch(torch.cat([p.pixel_values for p in held]), torch.cat([p.grid_thw for p in held]),
                          torch.cat(feats) if all(f is not None for f in feats) else None,
                          tuple(0 if p is None else int(p.grid_thw.shape[0]) for p in parts))

    def cells(self, merge: int) -> list[int]:
        """Each image's merged cells (its image tokens): ``t · h · w / merge²``."""
        return [int(t) * int(h) * int(w) // merge**2 for t, h, w in self.grid_thw.tolist()]


class VisionAttention(nn.Module):
    """Biased ``qkv`` / ``proj`` self-attention within spans of the rows (windows or frames), rotary q/k in FP32,
    scores, softmax and ``P @ V`` in FP32."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spans: list[int]) -> torch.Tensor:
        N, C = x.shape
        q, k, v = self.qkv(x).view(N, 3, self.heads, C // self.heads).unbind(1)  # (N, H, D) each
        q = (q.float() * cos[:, None] + _rotate_half(q.float()) * sin[:, None]).to(x.dtype)
        k = (k.float() * cos[:, None] + _rotate_half(k.float()) * sin[:, None]).to(x.dtype)
        scale = (C // self.heads) ** -0.5
        outs = []
        for qs, ks, vs in zip(q.split(spans), k.split(spans), v.split(spans), strict=True):
            qh, kh, vh = qs.transpose(0, 1).float(), ks.transpose(0, 1).float(), vs.transpose(0, 1).float()
            p = torch.softmax(qh @ kh.transpose(1, 2) * scale, dim=-1)  # (H, n, n)
            outs.append((p @ vh).transpose(0, 1).to(x.dtype))  # (n, H, D)
        return self.proj(torch.cat(outs).reshape(N, C))


class _Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=True)
        self.up_proj = nn.Linear(dim, hidden, bias=True)
        self.down_proj = nn.Linear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """Pre-norm ``x + attn(norm1(x))``, then ``+ mlp(norm2(.))``, of the norms and MLP an encoder gives (transformers'
    names: ``norm1``, ``norm2``, ``attn``, ``mlp``)."""

    def __init__(self, norm1: nn.Module, norm2: nn.Module, attn: VisionAttention, mlp: nn.Module) -> None:
        super().__init__()
        self.norm1, self.norm2, self.attn, self.mlp = norm1, norm2, attn, mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spans: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, spans)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """One linear map of each flattened patch: a Conv3d whose kernel is its stride (kept as ``proj`` for its name
    and shape), computed as the GEMM it is."""

    def __init__(self, channels: int, frames: int, patch: int, dim: int, *, bias: bool = False) -> None:
        super().__init__()
        self.proj = nn.Conv3d(channels, dim, kernel_size=(frames, patch, patch), stride=(frames, patch, patch),
                              bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(x.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class _Merger(nn.Module):
    def __init__(self, dim: int, cell: int, out: int) -> None:
        super().__init__()
        self.cell_width = dim * cell
        self.ln_q = RMSNorm(dim, _EPS)
        self.mlp = nn.Sequential(nn.Linear(self.cell_width, self.cell_width), nn.GELU(),
                                 nn.Linear(self.cell_width, out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.cell_width))


def patch_rows_cols(grids: list[tuple[int, int, int]], merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's row and column in its image, in the processor's patch order (merge cells row-major, the patches
    of a cell row-major; frames one after another)."""
    rows, cols = [], []
    for t, h, w in grids:
        hb = torch.arange(h // merge).view(-1, 1, 1, 1)
        wb = torch.arange(w // merge).view(1, -1, 1, 1)
        hi = torch.arange(merge).view(1, 1, -1, 1)
        wi = torch.arange(merge).view(1, 1, 1, -1)
        shape = (h // merge, w // merge, merge, merge)
        rows.append((hb * merge + hi).expand(shape).reshape(-1).repeat(t))
        cols.append((wb * merge + wi).expand(shape).reshape(-1).repeat(t))
    return torch.cat(rows), torch.cat(cols)


def rotary_inv_freq(vision_config: dict[str, Any], head_dim: int) -> torch.Tensor:
    """FP32 inverse frequencies ``(head_dim / 4,)`` of the 2-D rotary positions: each of row and column rotates half
    a head's frequencies (base ``rope_theta``, 10000 by default; explicit CPU: the model may be built on meta)."""
    c = vision_config
    theta = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    half = head_dim // 2
    return 1.0 / (float(theta) ** (torch.arange(0, half, 2, dtype=torch.int64, device="cpu").float() / half))


def rotary_tables(rows: torch.Tensor, cols: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin ``(N, head_dim)`` of the 2-D rotary positions: a patch's row rotates the first half of each half of
    a head's frequencies, its column the second (``cat(row angles, column angles)``, twice)."""
    freqs = torch.cat((rows.float()[:, None] * inv_freq, cols.float()[:, None] * inv_freq), dim=-1)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def check_images(images: ImageBatch, merge: int) -> list[tuple[int, int, int]]:
    """The grids of ``images`` as host integers, checked against their patches (``ValueError`` naming them)."""
    grids = [tuple(int(v) for v in g) for g in images.grid_thw.tolist()]
    if any(h % merge or w % merge or min(t, h, w) <= 0 for t, h, w in grids):
        raise ValueError(f"image grids {grids}: every side must be a positive multiple of {merge}")
    n = sum(t * h * w for t, h, w in grids)
    if images.pixel_values.dim() != 2 or images.pixel_values.shape[0] != n:
        raise ValueError(f"pixel_values {tuple(images.pixel_values.shape)} do not hold the {n} patches of "
                         f"grids {grids}")
    return grids


class VisionEncoder(nn.Module):
    """Qwen2.5-VL's vision tower (module docstring) under transformers' names (``visual.*`` of the checkpoint).

    Args:
        vision_config: the checkpoint's ``vision_config`` (``depth``, ``hidden_size``, ``num_heads``,
            ``intermediate_size``, ``out_hidden_size``, ``patch_size``, ``temporal_patch_size``, ``in_channels``,
            ``spatial_merge_size``, ``window_size``, ``fullatt_block_indexes``, ``hidden_act`` silu).
    """

    def __init__(self, vision_config: dict[str, Any]) -> None:
        super().__init__()
        c = vision_config
        dim, heads = int(c["hidden_size"]), int(c["num_heads"])
        self.patch = int(c.get("patch_size", 14))
        self.merge = int(c.get("spatial_merge_size", 2))
        self.window = int(c.get("window_size", 112)) // self.merge // self.patch  # in merge cells
        self.full_attention = {int(i) for i in c.get("fullatt_block_indexes", ())}
        self.patch_embed = PatchEmbed(int(c.get("in_channels", 3)), int(c.get("temporal_patch_size", 2)),
                                       self.patch, dim)
        self.blocks = nn.ModuleList(VisionBlock(RMSNorm(dim, _EPS), RMSNorm(dim, _EPS), VisionAttention(dim, heads),
                                                _Mlp(dim, int(c["intermediate_size"]))) for _ in range(int(c["depth"])))
        self.merger = _Merger(dim, self.merge**2, int(c["out_hidden_size"]))
        self._inv_freq = rotary_inv_freq(c, dim // heads)

    # -- layout (host integers from the grids) -----------------------------------------------------------------

    def _windows(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[int]]:
        """``(order, spans)``: the merge cells in window order (a permutation of image order) and each window's
        length in patches."""
        ws, unit = self.window, self.merge**2
        order: list[int] = []
        spans: list[int] = []
        base = 0
        for t, h, w in grids:
            hh, ww = h // self.merge, w // self.merge
            for f in range(t):
                for r0 in range(0, hh, ws):
                    for c0 in range(0, ww, ws):
                        cells = [base + f * hh * ww + r * ww + c
                                 for r in range(r0, min(r0 + ws, hh)) for c in range(c0, min(c0 + ws, ww))]
                        order += cells
                        spans.append(len(cells) * unit)
            base += t * hh * ww
        return torch.tensor(order, dtype=torch.long), spans

    def forward(self, images: ImageBatch) -> torch.Tensor:
        """``(cells, out_hidden_size)``: one embedding per merged cell, image after image, cells row-major.

        Raises:
            ValueError: grids whose sides are not multiples of ``spatial_merge_size``, or that do not account for
                every patch row of ``pixel_values``.
        """
        grids = check_images(images, self.merge)
        n = sum(t * h * w for t, h, w in grids)
        x = self.patch_embed(images.pixel_values)  # (N, C)
        device, unit = x.device, self.merge**2
        rows, cols = patch_rows_cols(grids, self.merge)
        order, windows = self._windows(grids)
        order = order.to(device)
        x = x.view(-1, unit, x.shape[-1])[order].reshape(n, -1)  # window order
        cos, sin = rotary_tables(rows.to(device), cols.to(device), self._inv_freq.to(device))
        cos = cos.view(-1, unit, cos.shape[-1])[order].reshape(n, -1)
        sin = sin.view(-1, unit, sin.shape[-1])[order].reshape(n, -1)
        frames = [h * w for t, h, w in grids for _ in range(t)]  # "full" attention is within a frame
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in self.full_attention else windows)
        return self.merger(x)[torch.argsort(order)]  # back to image order

    def extra_repr(self) -> str:
        return f"patch={self.patch}, merge={self.merge}, window={self.window} cells, full={sorted(self.full_attention)}"

