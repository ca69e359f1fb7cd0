"""Multimodal RoPE (M-RoPE, Qwen2-VL onward): three position axes — time, height, width — each owning some of the
rotary frequencies.

A token has a position on each axis. Text tokens have the same position on all three, counting up by one, so on a
text-only sequence M-RoPE is the plain RoPE. An image's tokens (one per merged patch cell) sit at time
``start`` and at ``start + row`` / ``start + column`` of its merged grid; the text after it resumes at
``start + max(rows, columns)``. A sequence's positions can therefore end below its length: the gap (``delta``, per
row, ≤ 0) is what the decode adds to the cache position of each new token.

Which frequency belongs to which axis (``mrope_section = (s_t, s_h, s_w)``, summing to ``head_dim / 2``):
* blocked (Qwen2-VL, Qwen2.5-VL): the first ``s_t`` frequencies are time's, the next ``s_h`` height's, the rest
  width's;
* interleaved (Qwen3-VL): frequency ``j`` is height's when ``j % 3 == 1`` and ``j < 3 s_h``, width's when
  ``j % 3 == 2`` and ``j < 3 s_w``, time's otherwise.
The angle of frequency ``j`` is ``position[axis(j)] * inv_freq[j]``, one FP32 product as for the plain RoPE, and
the table is ``cat(angles, angles)`` (the rotate-half convention).
"""

from __future__ import annotations

import torch

__all__ = ["mrope_axes", "mrope_cos_sin", "mrope_positions"]


def mrope_axes(section: tuple[int, int, int] | list[int], interleaved: bool) -> torch.Tensor:
    """The axis (0 time, 1 height, 2 width) of each of the ``sum(section)`` frequencies (module docstring)."""
    s_t, s_h, s_w = (int(s) for s in section)
    n = s_t + s_h + s_w
    # explicit CPU: the model may be built under torch.device("meta"), and these must be real
    if not interleaved:
        return torch.tensor([0] * s_t + [1] * s_h + [2] * s_w, dtype=torch.long, device="cpu")
    axes = torch.zeros(n, dtype=torch.long, device="cpu")
    j = torch.arange(n, device="cpu")
    axes[(j % 3 == 1) & (j < 3 * s_h)] = 1
    axes[(j % 3 == 2) & (j < 3 * s_w)] = 2
    return axes


def mrope_cos_sin(inv_freq: torch.Tensor, axes: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``(B, T, D)`` for positions ``(3, B, T)``; angles in FP32, tables in ``dtype``."""
    pos = position_ids.float().permute(1, 2, 0)  # (B, T, 3)
    freqs = pos[..., axes.to(pos.device)] * inv_freq[None, None, :]  # (B, T, D/2): each frequency's own axis
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def mrope_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, image_grid_thw: torch.Tensor | None,
                    image_token_id: int, spatial_merge_size: int, rows: tuple[int, ...] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions (3, B, T), delta (B,))`` of a batch whose images are runs of ``image_token_id`` (module
    docstring), images in row order then left to right, each run as long as its grid's merged cells
    ``t * (h / m) * (w / m)``. ``rows``: how many images each row has — its image tokens after them are text (a
    sampled image token); None: every run is an image. Padding (``attention_mask`` 0) gets position 0 and is
    skipped.

    Raises:
        ValueError: a run of image tokens that is not one image's length, or more images than grids.
    """
    B, T = input_ids.shape
    grids = [] if image_grid_thw is None else [tuple(int(v) for v in g) for g in image_grid_thw.tolist()]
    if rows is not None and (len(rows) != B or sum(rows) != len(grids)):
        raise ValueError(f"rows {rows} must give each of the {B} rows its images ({len(grids)} in all)")
    m = spatial_merge_size
    pos = torch.zeros(3, B, T, dtype=torch.long)
    delta = torch.zeros(B, dtype=torch.long)
    ids = input_ids.tolist()
    keep = attention_mask.bool().tolist() if attention_mask is not None else [[True] * T for _ in range(B)]
    nxt = 0
    for b in range(B):
        cols = [t for t in range(T) if keep[b][t]]
        row: list[tuple[int, int, int]] = []
        cur, i = 0, 0
        left = rows[b] if rows is not None else len(grids)  # the images this row may still place
        while i < len(cols):
            if ids[b][cols[i]] != image_token_id or left == 0:
                row.append((cur, cur, cur))
                cur, i = cur + 1, i + 1
                continue
            if nxt >= len(grids):
                raise ValueError(f"row {b}: more image-token runs than image grids ({len(grids)})")
            t, h, w = grids[nxt]
            nxt, left = nxt + 1, left - 1
            hh, ww = h // m, w // m
            n = t * hh * ww
            run = 0
            while i + run < len(cols) and ids[b][cols[i + run]] == image_token_id and run < n:
                run += 1
            if run != n:
                raise ValueError(f"row {b}: an image of grid {(t, h, w)} needs {n} image tokens, found {run}")
            row += [(cur + a, cur + r, cur + c) for a in range(t) for r in range(hh) for c in range(ww)]
            cur += max(hh, ww)
            i += n
        if rows is not None and left:
            raise ValueError(f"row {b}: {rows[b]} image(s), {rows[b] - left} image-token run(s)")
        if row:
            pos[:, b, cols] = torch.tensor(row, dtype=torch.long).T
            delta[b] = max(max(p) for p in row) + 1 - len(cols)
    if nxt != len(grids):
        raise ValueError(f"{len(grids)} image grids for {nxt} image-token runs")
    return pos.to(input_ids.device), delta.to(input_ids.device)
