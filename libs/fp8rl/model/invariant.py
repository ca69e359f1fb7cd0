"""Batch-invariant numerics: every token's numbers independent of how many rows run with it.

The rollout engine decodes a token with a ``(B, K)`` GEMM and attention over ``t + 1`` cached keys; the
trainer recomputes the same token inside a ``(B·T, K)`` GEMM and a causally masked attention over ``T``
keys. Both accumulate in FP32, but the BLAS picks its kernel (and so its summation order) by shape:
on the machines this was written on, MKL's SGEMM gives a row different bits when ``M < 8`` than when
``M >= 8`` (measured: every row of an ``M = 1..3`` product differs from the same row inside ``M = 512``).
That ≈ 1e-7 relative noise is ≈ 4e-6 in logprob in FP32, and E4M3 rounding turns it into whole
quantization steps that 30 layers compound (issue 18: 1.13 token_mult_prob_error on a real model).

With :class:`BatchInvariance` on, both engines run the same arithmetic for a token whatever the batch:

* **Linears** (:func:`tiled_mm`): the rows are cut into tiles of exactly ``row_tile`` rows (the last
  zero-padded) and multiplied by one batched GEMM whose every matrix is ``(row_tile, K) @ (K, N)``, so
  the kernel, hence the reduction order over ``K``, is the same for a decode step of 3 rows and a
  training forward of 3000. A row's result does not depend on its place in the tile (checked by the
  tests, which fail if a BLAS ever breaks that).
* **Attention** (:func:`split_kv_attention`): keys are laid out per row from that row's first visible
  key (left padding of the rollout and right padding of the trainer both vanish), cut into chunks of
  ``kv_chunk`` keys (the last zero-padded), scores and ``P @ V`` computed per chunk with fixed-shape
  tiled GEMMs, and the per-chunk partial sums added in chunk order. Keys a query cannot see get
  probability exactly 0, so trailing chunks add exact zeros and decode (``t + 1`` keys) and the full
  forward (``T`` keys) produce bitwise the same output.
* Everything else (norms, RoPE, softmax over the vocabulary, FP8 quantization) is per row already.

Cost: the padding of small decode batches to ``row_tile`` rows and the per-chunk attention; measured
in ``bench/fp8_step.py`` and ``bench/RESULTS.md``. Backward passes are not made invariant (nothing
compares gradients across engines); they use plain GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fp8rl.fp8.linear import pad_rows, tiled_mm

__all__ = ["BatchInvariance", "KeyLayout", "TiledLinear", "tiled_linear", "split_kv_attention"]


@dataclass(frozen=True)
class BatchInvariance:
    """Shapes that fix the kernels of batch-invariant numerics.

    Attributes:
        row_tile: rows per GEMM matrix. At least 8: MKL's small-``M`` path (``M < 8``) sums in
            another order, so a tile must stay clear of it; 16 keeps decode padding waste modest.
        kv_chunk: keys per attention chunk (split-KV); partial sums are added chunk by chunk.
    """

    row_tile: int = 16
    kv_chunk: int = 32

    def __post_init__(self) -> None:
        if self.row_tile < 8:
            raise ValueError(f"BatchInvariance.row_tile must be >= 8 (the BLAS small-M path), got {self.row_tile}")
        if self.kv_chunk < 1:
            raise ValueError(f"BatchInvariance.kv_chunk must be >= 1, got {self.kv_chunk}")


class _TiledLinearFn(torch.autograd.Function):
    """Forward in fixed-shape row tiles; backward with plain GEMMs (gradients are not compared)."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, row_tile):
        ctx.save_for_backward(x2d, weight)
        ctx.has_bias = bias is not None
        out = tiled_mm(x2d, weight.t(), row_tile)
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, g):
        x2d, weight = ctx.saved_tensors
        grad_x = g @ weight if ctx.needs_input_grad[0] else None
        grad_w = g.t() @ x2d if ctx.needs_input_grad[1] else None
        grad_b = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, row_tile: int) -> torch.Tensor:
    """``F.linear`` with a batch-invariant forward (:func:`tiled_mm`)."""
    lead = x.shape[:-1]
    out = _TiledLinearFn.apply(x.reshape(-1, x.shape[-1]), weight, bias, row_tile)
    return out.reshape(*lead, weight.shape[0])


class TiledLinear(nn.Linear):
    """``nn.Linear`` (same parameters, same state-dict names) whose forward is :func:`tiled_linear`."""

    row_tile: int | None = BatchInvariance.row_tile

    @classmethod
    def from_linear(cls, linear: nn.Linear, row_tile: int) -> TiledLinear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias  # the same Parameters: ties and optimizer state survive
        new.row_tile = row_tile
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_tile is None:  # invariance turned off again
            return F.linear(x, self.weight, self.bias)
        return tiled_linear(x, self.weight, self.bias, self.row_tile)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", row_tile={self.row_tile}"


@dataclass(frozen=True)
class KeyLayout:
    """Where each row's keys sit, in the canonical order split-KV attention uses.

    Canonical key ``j`` of row ``b`` is time slot ``offset[b] + j``, where ``offset[b]`` is the row's
    first unmasked slot; ``Sc`` (a multiple of the chunk) covers the longest row.

    Attributes:
        index: ``(B, Sc)`` slot of each canonical key (clamped into range where past the end).
        shift: the one offset every row shares (then keys are a slice, no gather), or None.
        present: ``(B, Sc)`` the slot exists and is not padding.
        visible: ``(B, 1, T, Sc)`` query ``i`` may attend canonical key ``j``: ``present`` and
            ``j <= (L + i) - offset[b]`` (causal, counted from the row's first key).
        inv: the tile and chunk sizes.
    """

    index: torch.Tensor
    present: torch.Tensor
    visible: torch.Tensor
    inv: BatchInvariance
    shift: int | None = None

    @classmethod
    def build(cls, key_mask: torch.Tensor, past: int, num_new: int, inv: BatchInvariance) -> KeyLayout:
        """The layout for ``num_new`` queries at slots ``[past, past + num_new)`` over ``key_mask`` ``(B, S)``."""
        B, S = key_mask.shape
        device = key_mask.device
        keep = key_mask.bool()
        # first unmasked slot of each row (0 for a row with none: it sees nothing anyway)
        offset = torch.where(keep.any(-1), keep.int().argmax(-1), torch.zeros(B, dtype=torch.long, device=device))
        span = int((S - offset).max())
        sc = -(-span // inv.kv_chunk) * inv.kv_chunk
        j = torch.arange(sc, device=device)
        slot = offset[:, None] + j[None, :]  # (B, Sc)
        inside = slot < S
        index = slot.clamp(max=S - 1)
        present = inside & keep.gather(1, index)
        qpos = torch.arange(past, past + num_new, device=device)[None, :] - offset[:, None]  # (B, T)
        visible = (j[None, None, :] <= qpos[:, :, None]) & present[:, None, :]  # (B, T, Sc)
        lo, hi = int(offset.min()), int(offset.max())
        return cls(index, present, visible[:, None], inv, lo if lo == hi else None)


def split_kv_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: KeyLayout,
    round_probs=None,
) -> torch.Tensor:
    """Causal GQA attention, batch-invariant (module docstring); FP32 throughout.

    Args:
        q: ``(B, H, T, D)`` queries (after RoPE, and E4M3 rounding if FP8 attention).
        k, v: ``(B, Hkv, S, D)`` keys and values by time slot (dequantized if the cache is FP8).
        layout: :meth:`KeyLayout.build` of this call.
        round_probs: applied to the normalised probabilities before ``P @ V`` (FP8 attention), or None.

    Returns:
        ``(B, H, T, D)`` FP32. Queries with no visible key get finite garbage (uniform weights).
    """
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    rep, R, C = H // Hkv, layout.inv.row_tile, layout.inv.kv_chunk
    G, M = B * Hkv, rep * T
    sc = layout.index.shape[1]
    n_c = sc // C
    # Canonical K/V (G, Sc, D): row b's key j is slot offset[b] + j. Keys a query cannot see keep whatever they
    # hold (padding tokens' K/V, empty cache slots, repeats of the last slot): finite, so their probability of
    # exactly 0 adds exact zeros whatever the value.
    if layout.shift is not None:  # one offset for every row (the trainer's right padding: 0): a slice
        o = layout.shift
        kc, vc = (F.pad(t[:, :, o:o + sc].float(), (0, 0, 0, max(0, sc - (t.shape[2] - o)))) for t in (k, v))
    else:
        gather = layout.index[:, None, :, None].expand(B, Hkv, sc, D)
        kc, vc = k.float().gather(2, gather), v.float().gather(2, gather)
    kc, vc = kc.reshape(G, n_c, C, D), vc.reshape(G, n_c, C, D)
    # query rows of one kv head, (rep, T) order, in tiles of R: (G, nT, R, D)
    qt = pad_rows(q.float().reshape(G, M, D), R).view(G, -1, R, D)
    n_t = qt.shape[1]
    # scores: one (R, D) @ (D, C) GEMM per (tile, chunk) -> (G, nT, nC, R, C)
    s = torch.matmul(qt[:, :, None], kc.transpose(-1, -2)[:, None])
    s = s.permute(0, 1, 3, 2, 4).reshape(G, n_t * R, sc)[:, :M].view(B, Hkv, rep, T, sc) * (D**-0.5)
    s = s.masked_fill(~layout.visible[:, :, None], torch.finfo(torch.float32).min)  # (B, Hkv, rep, T, Sc)
    e = torch.exp(s - s.amax(-1, keepdim=True))  # invisible keys: exactly 0
    parts = e.view(B, Hkv, rep, T, n_c, C).sum(-1)  # per-chunk sums of C terms
    denom = parts[..., 0]
    for c in range(1, n_c):  # chunk order, whatever the number of chunks
        denom = denom + parts[..., c]
    p = e / denom[..., None]
    if round_probs is not None:
        p = round_probs(p)
    pt = pad_rows(p.reshape(G, M, sc), R).view(G, n_t, R, n_c, C).permute(0, 1, 3, 2, 4)  # (G, nT, nC, R, C)
    o = torch.matmul(pt, vc[:, None])  # (G, nT, nC, R, D): one (R, C) @ (C, D) GEMM each
    out = o[:, :, 0]
    for c in range(1, n_c):
        out = out + o[:, :, c]
    return out.reshape(G, n_t * R, D)[:, :M].reshape(B, H, T, D)
