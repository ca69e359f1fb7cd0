"""Batch-invariant numerics: every token's numbers independent of how many rows run with it.

The rollout engine decodes a token with a ``(B, K)`` GEMM and attention over ``t + 1`` cached keys; the
trainer recomputes the same token inside a ``(B·T, K)`` GEMM and a causally masked attention over ``T``
keys. Both accumulate in FP32, but the BLAS picks its kernel (and so its summation order) by shape:
on the machines this was written on, MKL's SGEMM gives a row different bits when ``M < 8`` than when
``M >= 8`` (measured: every row of an ``M = 1..3`` product differs from the same row inside ``M = 512``).
That ≈ 1e-7 relative noise is ≈ 4e-6 in logprob in FP32, and E4M3 rounding turns it into whole
quantization steps that 30 layers compound (issue 18: 1.13 token_mult_prob_error on a real model).

With :class:`BatchInvariance` on, both engines run the same arithmetic for a token whatever the batch:

* **Linears** (:func:`tiled_mm`): the rows are zero-padded to whole tiles of ``row_tile`` rows and
  multiplied by one plain GEMM, so the BLAS never sees a small or ragged ``M`` and sums every row over
  ``K`` in the same order for a decode step of 3 rows and a training forward of 3000. A row's result
  depends neither on the number of rows nor on its place among them (checked by the tests over the
  model's shapes, 1–4 threads and AVX2 / AVX-512 kernels; they fail if a BLAS ever breaks it).
* **Attention** (:func:`split_kv_attention`): keys are laid out per row from that row's first visible
  key (left padding of the rollout and right padding of the trainer both vanish) over a whole number of
  chunks of ``kv_chunk`` keys; scores are one GEMM per kv head (query rows in whole tiles, keys in whole
  chunks, reduction over the head dim), the softmax's denominator sums each chunk pairwise and the chunks in order
  (every add's order fixed here, not by a reduction kernel's vector width; fused on the CPU by
  ``fp8rl.fp8.native``, bitwise), ``P @ V`` one batched GEMM of chunks (reduction over exactly ``kv_chunk`` keys
  each), and the per-chunk partial sums are added in chunk order. Keys a query cannot see get
  probability exactly 0, so trailing chunks add exact zeros and decode (``t + 1`` keys) and the full
  forward (``T`` keys) produce bitwise the same output.
* Everything else (norms, RoPE, softmax over the vocabulary, FP8 quantization) is per row already.

The rollout's KV cache is row-aligned (:meth:`fp8rl.model.KVCache.align_rows`): it stores each row from its
first key, so decode reads the canonical layout as a slice; only a cache-less forward of left-padded rows gathers.

Cost: the padding of decode batches to whole tiles and of keys to whole chunks, and the per-chunk partial
sums of attention; measured by
``bench/batch_invariance.py`` (``bench/RESULTS.md``). Backward passes are not made invariant (nothing
compares gradients across engines); they use plain GEMMs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fp8rl.fp8 import native
from fp8rl.fp8.linear import pad_rows, tiled_mm

__all__ = ["BatchInvariance", "KeyLayout", "TiledLinear", "tiled_linear", "split_kv_attention"]


@dataclass(frozen=True)
class BatchInvariance:
    """Shapes that fix the kernels of batch-invariant numerics.

    Attributes:
        row_tile: every GEMM's row count is a multiple of it. At least 8: MKL's small-``M`` path
            (``M < 8``) sums in another order, and so do the ragged edge rows a thread is given (``M = 9``
            on 2 threads); whole tiles of 8 rows were row-invariant on every shape, 1-16 threads and AVX2 /
            AVX-512 kernels measured (``tests/unit/engines/test_batch_invariance.py``), and waste least padding.
        kv_chunk: keys per attention chunk (split-KV); partial sums are added chunk by chunk.
    """

    row_tile: int = 8
    kv_chunk: int = 32

    def __post_init__(self) -> None:
        if self.row_tile < 8:
            raise ValueError(f"BatchInvariance.row_tile must be >= 8 (the BLAS small-M path), got {self.row_tile}")
        if self.kv_chunk < 1:
            raise ValueError(f"BatchInvariance.kv_chunk must be >= 1, got {self.kv_chunk}")


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, row_tile: int) -> torch.Tensor:
    """``F.linear`` with a batch-invariant forward (:func:`tiled_mm`); autograd differentiates it as written
    (the backward's GEMMs are plain: nothing compares gradients across engines)."""
    lead = x.shape[:-1]
    out = tiled_mm(x.reshape(-1, x.shape[-1]), weight.t(), row_tile)
    if bias is not None:
        out = out + bias
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
        offset: ``(B,)`` each row's first unmasked slot.
        qpos: ``(B, T)`` each query's canonical index (its slot less the row's offset): what a narrower rule of
            visibility (a sliding window) measures key distances from.
    """

    index: torch.Tensor
    present: torch.Tensor
    visible: torch.Tensor
    inv: BatchInvariance
    offset: torch.Tensor
    shift: int | None = None
    qpos: torch.Tensor | None = None

    def row_aligned(self) -> KeyLayout:
        """This layout over keys already stored in canonical order (a row-aligned KV cache): a slice, no gather."""
        return dataclasses.replace(self, shift=0)

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
        return cls(index, present, visible[:, None], inv, offset, lo if lo == hi else None, qpos)


def split_kv_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: KeyLayout,
    round_probs=None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal GQA attention, batch-invariant (module docstring); FP32 throughout.

    Args:
        q: ``(B, H, T, D)`` queries (after RoPE, and E4M3 rounding if FP8 attention).
        k, v: ``(B, Hkv, S, D)`` keys and ``(B, Hkv, S, Dv)`` values by time slot (dequantized if the cache is
            FP8).
        layout: :meth:`KeyLayout.build` of this call.
        round_probs: applied to the normalised probabilities before ``P @ V`` (FP8 attention), or None; its
            gradient is the identity (straight through).
        scale: of the scores ``q·k``; None: ``D ** -0.5``.

    Returns:
        ``(B, H, T, Dv)`` FP32. Queries with no visible key get finite garbage (uniform weights).

    With autograd recording, the forward is these same operations (bitwise) and the backward is softmax
    attention's own (:class:`_SplitKVAttentionFn`): a handful of GEMMs and elementwise passes instead of the
    autograd graph of every chunking op (3x the forward's time on SmolLM2's shapes). Backward passes are not
    batch-invariant anyway (module docstring).
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _SplitKVAttentionFn.apply(q, k, v, layout, round_probs, scale)
    return _split_kv_forward(q, k, v, layout, round_probs, scale)[0]


def _canonical_kv(k: torch.Tensor, v: torch.Tensor, layout: KeyLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V ``(B, Hkv, Sc, D)`` in the canonical order: row b's key j is slot offset[b] + j. Keys a query cannot see
    keep whatever they hold (padding tokens' K/V, empty cache slots, repeats of the last slot): finite, so their
    probability of exactly 0 adds exact zeros whatever the value."""
    B, Hkv, _, D = k.shape
    Dv = v.shape[-1]
    sc = layout.index.shape[1]
    if layout.shift is not None:  # one offset for every row (the trainer's right padding: 0): a slice
        o = layout.shift
        kc, vc = (t[:, :, o:o + sc].float() for t in (k, v))
        short = sc - kc.shape[2]  # past the last key: zeros (a cache view that reaches far enough is not copied)
        if short:
            kc, vc = (F.pad(t, (0, 0, 0, short)) for t in (kc, vc))
        return kc, vc
    index = layout.index[:, None, :, None]
    return k.float().gather(2, index.expand(B, Hkv, sc, D)), v.float().gather(2, index.expand(B, Hkv, sc, Dv))


def _hidden(visible: torch.Tensor) -> torch.Tensor:
    """The keys a row cannot see, in rows that see some key (a row that sees none keeps its uniform weights)."""
    return visible.logical_not() & visible.any(-1, keepdim=True)


def _softmax_shift(s: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """The scaled scores ``s * scale`` less each row's largest visible one (and at least ``finfo.min``), 0 where a row
    cannot see the key — the argument of the exp. A row that sees no key gets 0 everywhere (its exp: uniform weights,
    finite garbage, as documented). An exp of 0 for invisible keys and not of ``min - amax`` (whose exp is exactly 0
    too) because the CPU's exp takes 10x as long on such arguments (its underflow path)."""
    s = (s * scale).masked_fill(~visible, torch.finfo(torch.float32).min)
    d = s - s.amax(-1, keepdim=True)
    return d.masked_fill_(_hidden(visible), 0.0)


def _softmax_normalise(e: torch.Tensor, visible: torch.Tensor, chunk: int) -> torch.Tensor:
    """``exp(_softmax_shift(...))`` into the probabilities: hidden keys' terms set to exactly 0, each chunk of
    ``chunk`` keys summed pairwise (halve the count, add the upper half onto the lower; an odd count's last term moves
    down), the chunks' sums added in chunk order (whatever the number of chunks: trailing chunks of zeros add exact
    zeros), and every term divided by the sum. The order of every add is fixed here, not by a reduction kernel's
    vector width."""
    e = e.masked_fill(_hidden(visible), 0.0)
    a = e.unflatten(-1, (e.shape[-1] // chunk, chunk))
    n = chunk
    while n > 1:
        h = n // 2
        head = a[..., :h] + a[..., h:2 * h]
        a = torch.cat([head, a[..., 2 * h:]], -1) if n % 2 else head
        n = h + n % 2
    parts = a[..., 0].unbind(-1)
    denom = parts[0]
    for part in parts[1:]:
        denom = denom + part
    return e / denom[..., None]


def _split_kv_forward(q, k, v, layout, round_probs, scale):
    """``(out, p, p_used, kc, vc)``: the output, the normalised probabilities ``(B, Hkv, rep, T, Sc)``, what
    ``P @ V`` multiplied (``round_probs(p)``, or ``p``), and the canonical K/V."""
    B, H, T, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]  # values may be narrower or wider than keys (MLA)
    rep, R, C = H // Hkv, layout.inv.row_tile, layout.inv.kv_chunk
    G, M = B * Hkv, rep * T
    sc = layout.index.shape[1]
    n_c = sc // C
    kc, vc = _canonical_kv(k, v, layout)
    kg, vg = kc.reshape(G, sc, D), vc.reshape(G, n_c, C, Dv)
    # scores: the query rows of one kv head ((rep, T) order) in whole tiles of R rows against the keys in whole
    # chunks of C: one GEMM per kv head, reduction over D, a row's and a key's numbers the same whatever else
    # is in the product (tiled_mm's property, in both dimensions)
    qp = pad_rows(q.float().reshape(G, M, D), R)  # (G, Mp, D)
    s = torch.bmm(qp, kg.transpose(1, 2))  # (G, Mp, Sc)
    scale = D**-0.5 if scale is None else scale
    visible = layout.visible[:, 0].contiguous()  # (B, T, Sc)
    # the softmax (:func:`_softmax_shift` and :func:`_softmax_normalise`, or softmax_cpu.c's fused form of the same
    # numbers where it is built), around torch's exp
    d = native.softmax_prep(s, visible, Hkv, rep, scale)
    if d is None:
        d = _softmax_shift(s[:, :M].view(B, Hkv, rep, T, sc), visible[:, None, None], scale).view(G, M, sc)
    e = torch.exp(d) if d.requires_grad else d.exp_()  # (autograd through the forward: the tests' reference)
    if not native.softmax_finish(e, visible, Hkv, rep, C):
        e = _softmax_normalise(e.view(B, Hkv, rep, T, sc), visible[:, None, None], C)
    p = e.view(B, Hkv, rep, T, sc)
    used = round_probs(p) if round_probs is not None else p
    # P @ V chunk by chunk (reduction over exactly C keys each, one batched GEMM), partial sums in chunk order
    pc = pad_rows(used.reshape(G, M, sc), R).view(G, -1, n_c, C).transpose(1, 2)  # (G, nC, Mp, C)
    o = torch.matmul(pc, vg).unbind(1)  # nC of (G, Mp, Dv)
    out = o[0]
    for part in o[1:]:
        out = out + part
    return out[:, :M].reshape(B, H, T, Dv), p, used, kc, vc


class _SplitKVAttentionFn(torch.autograd.Function):
    """:func:`split_kv_attention` with softmax attention's backward (``P`` the probabilities, ``P'`` what multiplied
    ``V``: ``round_probs(P)``, the identity's gradient)::

        dV = P'ᵀ dO     dP = dO Vᵀ     dS = P ∘ (dP − rowsum(dP ∘ P))     dQ = scale · dS K     dK = scale · dSᵀ Q

    over the canonical keys, then back to the time slots (the slice's or the gather's inverse). Keys a query cannot
    see have P = 0, so they get no gradient from it."""

    @staticmethod
    def forward(ctx, q, k, v, layout, round_probs, scale):
        with torch.no_grad():
            out, p, used, kc, vc = _split_kv_forward(q, k, v, layout, round_probs, scale)
        ctx.save_for_backward(q, kc, vc, p, used if used is not p else None)
        ctx.layout, ctx.scale = layout, scale
        ctx.shapes = (k.shape, v.shape, q.dtype, k.dtype, v.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, kc, vc, p, used = ctx.saved_tensors
        used = p if used is None else used
        layout = ctx.layout
        k_shape, v_shape, q_dtype, k_dtype, v_dtype = ctx.shapes
        B, H, T, D = q.shape
        Hkv, sc, Dv = kc.shape[1], kc.shape[2], vc.shape[-1]
        rep = H // Hkv
        G, M = B * Hkv, rep * T
        scale = D**-0.5 if ctx.scale is None else ctx.scale
        go = grad_out.float().reshape(G, M, Dv)  # (B, H, T, Dv) -> kv head's (rep, T) rows
        pm, um = p.reshape(G, M, sc), used.reshape(G, M, sc)
        kg, vg = kc.reshape(G, sc, D), vc.reshape(G, sc, Dv)
        dvc = torch.bmm(um.transpose(1, 2), go)  # (G, Sc, Dv)
        dp = torch.bmm(go, vg.transpose(1, 2))  # (G, M, Sc)
        ds = dp if native.softmax_backward(dp, pm) else pm * (dp - (dp * pm).sum(-1, keepdim=True))
        dq = torch.bmm(ds, kg).mul_(scale).view(B, H, T, D)
        dkc = torch.bmm(ds.transpose(1, 2), q.float().reshape(G, M, D)).mul_(scale)  # (G, Sc, D)
        dk, dv = (_from_canonical(t.view(B, Hkv, sc, -1), shape, layout)
                  for t, shape in ((dkc, k_shape), (dvc, v_shape)))
        return dq.to(q_dtype), dk.to(k_dtype), dv.to(v_dtype), None, None, None


def _from_canonical(g: torch.Tensor, shape: torch.Size, layout: KeyLayout) -> torch.Tensor:
    """The gradient of :func:`_canonical_kv`: canonical ``(B, Hkv, Sc, D)`` back to the time slots of ``shape``."""
    out = g.new_zeros(shape)
    if layout.shift is not None:
        o = layout.shift
        n = min(g.shape[2], shape[2] - o)
        out[:, :, o:o + n] = g[:, :, :n]
        return out
    index = layout.index[:, None, :, None].expand(*g.shape)
    return out.scatter_add_(2, index, g)
