"""E4M3 quantizers: blockwise (weights), per-token-group (activations, gradients), per-tensor (Q/K/V).

One convention everywhere in fp8rl::

    x ≈ q.float() * scale          scale = amax / 448  (FP32)
    q = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)

A block/group whose amax is 0 gets scale 1.0 (its values are all zero anyway). With
``pow2_scale=True`` the scale is rounded *up* to ``2 ** ceil(log2(amax / 448))`` so that nothing
overflows and the multiply by the scale is exact.

Precision budget: E4M3 keeps 3 mantissa bits, so a normal value round-trips with relative error at
most 2**-4 (half an ulp); values below the smallest normal (2**-6 · scale) lose relative accuracy
but their absolute error stays ≤ 2**-10 · scale (half the subnormal step 2**-9). Tests assert
exactly these bounds.

Dimensions that are not multiples of the block/group size are zero-padded internally, never
rejected; outputs always have the input's shape (scales have ``ceil(dim / block)`` entries).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import native

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128

__all__ = [
    "E4M3",
    "E4M3_MAX",
    "BLOCK",
    "compute_scale",
    "quantize_blockwise",
    "dequantize_blockwise",
    "quantize_per_token_group",
    "dequantize_per_token_group",
    "fake_quantize_per_token_group",
    "quantize_columnwise",
    "dequantize_columnwise",
    "fake_quantize_columnwise",
    "quantize_per_tensor",
    "dequantize_per_tensor",
    "round_to_e4m3",
    "check_finite",
]


def all_finite(t: torch.Tensor) -> bool:
    """True when ``t`` holds no NaN and no Inf, in one read and no allocation.

    ``torch.aminmax`` propagates NaN (documented), and an Inf is the min or the max, so both ends
    finite ⇔ every element finite. It reads the tensor in its own dtype (≈ 17× faster here than an
    FP32 sum of a BF16 tensor, and exact where a sum may overflow).
    """
    if t.numel() == 0 or not t.is_floating_point():
        return True
    lo, hi = torch.aminmax(t.detach().float() if t.dtype == E4M3 else t.detach())
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def check_finite(t: torch.Tensor, name: str | None = None) -> None:
    """Raise ``ValueError`` naming ``name`` if ``t`` holds NaN or Inf (quantizing them is silent garbage)."""
    if all_finite(t):
        return
    if not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        label = f"tensor {name!r}" if name else "tensor"
        raise ValueError(
            f"cannot quantize {label} to FP8: it holds {bad} non-finite value(s) (NaN/Inf) "
            f"out of {t.numel()}, shape {tuple(t.shape)}"
        )


def compute_scale(amax: torch.Tensor, *, pow2_scale: bool = False) -> torch.Tensor:
    """FP32 dequantization scale(s) from amax: ``amax / 448``; 1.0 where amax is 0 or not finite.

    The scale is floored at the smallest normal FP32 (1.2e-38) so a subnormal amax never yields 0.
    """
    amax = amax.float()
    # A subnormal amax (tiny gradients) would give a scale that underflows to 0 and turn
    # x / scale into 0/0 = NaN; the smallest normal FP32 is the floor (values that small lose
    # their precision anyway, nothing overflows).
    scale = (amax / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    if pow2_scale:
        # exp2(ceil(log2(.))) of a positive normal float is exact; zeros are replaced below.
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    bad = (amax == 0) | ~torch.isfinite(amax)
    return torch.where(bad, torch.ones_like(scale), scale)


_E4M3_VALUES: dict[torch.device, torch.Tensor] = {}


def _e4m3_to_f32(q: torch.Tensor) -> torch.Tensor:
    """``q.float()`` for an E4M3 tensor on the CPU, through a 256-entry table of ``code.float()`` (the same
    conversion per code, so bitwise equal; the elementwise E4M3 -> FP32 cast is ~2x slower there)."""
    if q.device.type != "cpu":
        return q.float()
    table = _E4M3_VALUES.get(q.device)
    if table is None:
        table = _E4M3_VALUES[q.device] = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    return table.index_select(0, q.reshape(-1).view(torch.uint8).int()).view(q.shape)


def _cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)


def _pad_to(x: torch.Tensor, dims: dict[int, int]) -> torch.Tensor:
    """Zero-pad ``x`` so that each dim in ``dims`` becomes a multiple of its block size."""
    pad: list[int] = []
    for d in range(x.dim() - 1, -1, -1):  # F.pad lists the last dim first
        extra = (-x.shape[d]) % dims[d] if d in dims else 0
        pad += [0, extra]
    if not any(pad):
        return x
    return F.pad(x, pad)


# ---------------------------------------------------------------------------------------------
# blockwise (weights): 128 x 128 tiles of a 2-D tensor
# ---------------------------------------------------------------------------------------------


def quantize_blockwise(
    w: torch.Tensor,
    block_size: tuple[int, int] = (BLOCK, BLOCK),
    *,
    pow2_scale: bool = False,
    name: str | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight to E4M3 with one FP32 scale per ``block_size`` tile.

    Args:
        w: ``(M, N)`` tensor, any float dtype. Non-finite values raise ``ValueError`` naming ``name``.
        block_size: tile shape ``(bm, bn)``; 128×128 in every fp8rl recipe.
        pow2_scale: round scales up to powers of two.
        name: tensor name used in error messages.
        out: ``(q, scale)`` tensors to write into (contiguous, of the result's dtypes and shapes), e.g.
            views of a refit shard; the same numbers either way.

    Returns:
        ``(q, scale)``: ``q`` is ``float8_e4m3fn`` with ``w``'s shape; ``scale`` is FP32 of shape
        ``(ceil(M / bm), ceil(N / bn))`` and ``w ≈ dequantize_blockwise(q, scale)``.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_blockwise expects a 2-D weight, got shape {tuple(w.shape)} ({name or 'tensor'})")
    bm, bn = block_size
    m, n = w.shape
    grid = (math.ceil(m / bm), math.ceil(n / bn))
    if out is not None and (out[0].dtype, tuple(out[0].shape), out[1].dtype, tuple(out[1].shape)) != (
            E4M3, (m, n), torch.float32, grid) or out is not None and not all(t.is_contiguous() for t in out):
        raise ValueError(f"quantize_blockwise out= needs contiguous E4M3 {(m, n)} and FP32 {grid} tensors "
                         f"({name or 'tensor'})")
    if not pow2_scale and (fused := native.quant_blocks(w, bm, bn, out)) is not None:  # one pass per tile row
        q, scale, finite = fused
        if not finite:  # NaN/Inf reach the block amax; name the tensor with the full check
            check_finite(w, name)
        return q, scale
    if m % bm == 0 and n % bn == 0 and w.is_contiguous() and w.numel() > 0:
        q, scale, finite = _blockwise_chunked(w, bm, bn, pow2_scale, out)
        if not finite:  # NaN/Inf reach the block amax; name the tensor with the full check
            check_finite(w, name)
        return q, scale
    check_finite(w, name)
    wp = _pad_to(w.float(), {0: bm, 1: bn})
    mb, nb = wp.shape[0] // bm, wp.shape[1] // bn
    tiles = wp.view(mb, bm, nb, bn)  # (Mb, bm, Nb, bn)
    amax = tiles.abs().amax(dim=(1, 3))  # (Mb, Nb)
    scale = compute_scale(amax, pow2_scale=pow2_scale)
    q = _cast(tiles, scale[:, None, :, None]).view(mb * bm, nb * bn)
    q = q[:m, :n].contiguous() if (m, n) != q.shape else q
    if out is not None:
        out[0].copy_(q)
        out[1].copy_(scale)
        return out
    return q, scale


def _blockwise_chunked(w: torch.Tensor, bm: int, bn: int, pow2_scale: bool,
                       out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Same numbers as the padded path, one row of tiles at a time through a reused FP32 buffer.

    Working on ``bm`` rows at a time keeps every pass (amax, divide, clamp, cast) in cache and
    avoids allocating full-size temporaries; on CPU this is ~4x faster than the one-shot version.
    Also returns whether every element was finite (read off the block amaxes, no extra pass).
    """
    m, n = w.shape
    nb = n // bn
    if out is None:
        q = torch.empty(m, n, dtype=E4M3, device=w.device)
        scale = torch.empty(m // bm, nb, dtype=torch.float32, device=w.device)
    else:
        q, scale = out
    buf = torch.empty(bm, nb, bn, dtype=torch.float32, device=w.device)
    upcast = w.dtype != torch.float32  # BF16 input: one upcast into the buffer beats mixed-dtype ops
    finite = torch.ones((), dtype=torch.bool, device=w.device)
    for i in range(m // bm):
        tiles = w[i * bm:(i + 1) * bm].view(bm, nb, bn)  # (bm, Nb, bn)
        if upcast:
            tiles = buf.copy_(tiles)
        # reduce the contiguous dim first: torch's strided amax over dims (0, 2) is ~50x slower
        amax = torch.maximum(tiles.amax(dim=-1), tiles.amin(dim=-1).neg()).amax(dim=0)  # (Nb,)
        finite &= torch.isfinite(amax).all()  # amax/maximum propagate NaN, so this sees every element
        s = compute_scale(amax, pow2_scale=pow2_scale)
        scale[i] = s
        torch.div(tiles, s[None, :, None], out=buf)
        q[i * bm:(i + 1) * bm].view(bm, nb, bn).copy_(buf.clamp_(-E4M3_MAX, E4M3_MAX))
    return q, scale, bool(finite)


def dequantize_blockwise(
    q: torch.Tensor,
    scale: torch.Tensor,
    block_size: tuple[int, int] = (BLOCK, BLOCK),
    dtype: torch.dtype = torch.float32,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: ``q.float() * scale`` broadcast over each tile; into ``out`` (contiguous,
    ``q``'s shape, ``dtype``) when given."""
    bm, bn = block_size
    m, n = q.shape
    if scale.shape != (math.ceil(m / bm), math.ceil(n / bn)):
        raise ValueError(
            f"blockwise scale shape {tuple(scale.shape)} does not match weight {tuple(q.shape)} "
            f"with blocks {block_size}: expected {(math.ceil(m / bm), math.ceil(n / bn))}"
        )
    if out is not None and (out.dtype != dtype or out.shape != q.shape or not out.is_contiguous()):
        raise ValueError(f"dequantize_blockwise out= needs a contiguous {dtype} {tuple(q.shape)} tensor, got "
                         f"{out.dtype} {tuple(out.shape)}")
    direct = out if dtype == torch.float32 else None
    if (fused := native.dequant_blocks(q, scale, bm, bn, out=direct)) is not None:  # the same numbers, one pass
        return fused if out is None or fused is out else out.copy_(fused)
    if out is not None:
        return out.copy_(dequantize_blockwise(q, scale, block_size, dtype))
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device).copy_(q)  # always a fresh contiguous FP32 copy
    if m % bm == 0 and n % bn == 0:  # every tile whole: one broadcast multiply in place, no expanded scale tensor
        out.view(m // bm, bm, n // bn, bn).mul_(scale.float()[:, None, :, None])
    else:
        out.mul_(scale.float().repeat_interleave(bm, 0)[:m].repeat_interleave(bn, 1)[:, :n])
    return out.to(dtype)


# ---------------------------------------------------------------------------------------------
# per-token-group (activations, gradients): 1 x 128 groups along the last dim
# ---------------------------------------------------------------------------------------------


def quantize_per_token_group(
    x: torch.Tensor,
    group_size: int = BLOCK,
    *,
    pow2_scale: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize along the last dim in groups of ``group_size`` with one FP32 scale per group.

    Returns ``(q, scale)`` with ``q.shape == x.shape`` and
    ``scale.shape == (*x.shape[:-1], ceil(K / group_size))``. Activations are not checked for
    NaN (a hot path); a non-finite group gets scale 1.0 and propagates its NaN.
    """
    if not pow2_scale and (fused := native.quant_rows(x, group_size)) is not None:
        return fused  # the same numbers in one pass (fp8rl.fp8.native)
    k = x.shape[-1]
    # Chunking pays off only past one chunk; small inputs (decode steps) take the few-op path.
    if k % group_size == 0 and x.is_contiguous() and x.numel() > _CHUNK_ELEMS:
        return _per_token_group_chunked(x, group_size, pow2_scale)
    xp = _pad_to(x.float(), {x.dim() - 1: group_size})
    g = xp.shape[-1] // group_size
    groups = xp.view(*x.shape[:-1], g, group_size)  # (..., G, group)
    amax = groups.abs().amax(dim=-1)  # (..., G)
    scale = compute_scale(amax, pow2_scale=pow2_scale)
    q = _cast(groups, scale.unsqueeze(-1)).view(*x.shape[:-1], g * group_size)
    return (q[..., :k].contiguous() if g * group_size != k else q), scale


def _group_spans(k: int, group_size: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` along a dim of ``k``: its whole groups as one span, and the ragged last group (if any) alone —
    each span's groups are a view (no padded copy), and a group's amax is what zero padding would leave it (the
    column-wise quantization of wgrad's operands, along the tokens)."""
    whole = k - k % group_size
    return [(lo, hi) for lo, hi in ((0, whole), (whole, k)) if hi > lo]


_CHUNK_ELEMS = 1 << 19  # 2 MiB of FP32 per chunk: stays in L2/L3 between passes


def _per_token_group_chunked(x: torch.Tensor, group_size: int, pow2_scale: bool):
    """Same numbers as the padded path, a few rows at a time through a reused FP32 buffer."""
    k = x.shape[-1]
    g = k // group_size
    rows = x.reshape(-1, g, group_size)  # (R, G, group)
    r = rows.shape[0]
    q = torch.empty(r, g, group_size, dtype=E4M3, device=x.device)
    scale = torch.empty(r, g, dtype=torch.float32, device=x.device)
    step = max(1, _CHUNK_ELEMS // k)
    buf = torch.empty(min(step, r), g, group_size, dtype=torch.float32, device=x.device)
    upcast = x.dtype != torch.float32
    for i in range(0, r, step):
        chunk = rows[i:i + step]
        n = chunk.shape[0]
        b = buf[:n]
        if upcast:
            chunk = b.copy_(chunk)
        amax = torch.maximum(chunk.amax(dim=-1), chunk.amin(dim=-1).neg())  # (n, G)
        s = compute_scale(amax, pow2_scale=pow2_scale)
        scale[i:i + n] = s
        torch.div(chunk, s.unsqueeze(-1), out=b)
        q[i:i + n].copy_(b.clamp_(-E4M3_MAX, E4M3_MAX))
    return q.view(x.shape), scale.view(*x.shape[:-1], g)


def fake_quantize_per_token_group(x: torch.Tensor, group_size: int = BLOCK, *,
                                  pow2_scale: bool = False) -> torch.Tensor:
    """``dequantize_per_token_group(*quantize_per_token_group(x))`` in FP32, bitwise, in one chunked pass.

    The reference FP8 GEMM multiplies dequantized operands; this gives them without materialising the E4M3
    tensor and reading it back in a second pass: each chunk of rows is scaled, clamped, rounded to E4M3 and
    multiplied back by its scale while it is in cache. The same operations in the same order as the two-step
    path (``tests/unit/fp8/test_quant.py`` checks bitwise equality), so a caller may use either.
    """
    if not pow2_scale and (fused := native.fake_rows(x, group_size)) is not None:
        return fused  # the same numbers in one pass (fp8rl.fp8.native)
    k = x.shape[-1]
    if not x.is_contiguous():
        return dequantize_per_token_group(*quantize_per_token_group(x, group_size, pow2_scale=pow2_scale), group_size)
    g = -(-k // group_size)
    rows = x.reshape(-1, k)  # (R, K)
    r = rows.shape[0]
    step = max(1, _CHUNK_ELEMS // (g * group_size))
    ragged = k % group_size != 0
    if ragged:  # K = 576 (4 x 128 + 64): each chunk through a zero-padded buffer, whose padding stays 0 (0 / s = 0)
        out = torch.empty(r, k, dtype=torch.float32, device=x.device)
        buf = torch.zeros(min(step, r), g, group_size, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(r, g, group_size, dtype=torch.float32, device=x.device)
    upcast = x.dtype != torch.float32
    for i in range(0, r, step):
        chunk = rows[i:i + step]
        n = chunk.shape[0]
        if ragged:
            o = buf[:n]
            o.view(n, -1)[:, :k].copy_(chunk)  # upcast too: the buffer is FP32
            chunk = o
        else:
            o = out[i:i + n]
            chunk = o.copy_(chunk.view(n, g, group_size)) if upcast else chunk.view(n, g, group_size)
        amax = torch.maximum(chunk.amax(dim=-1), chunk.amin(dim=-1).neg())  # (n, G)
        s = compute_scale(amax, pow2_scale=pow2_scale).unsqueeze(-1)
        torch.div(chunk, s, out=o)
        o.copy_(_e4m3_to_f32(o.clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)))  # the E4M3 rounding, back in FP32
        o.mul_(s)
        if ragged:
            out[i:i + n] = o.view(n, -1)[:, :k]
    return out.view(x.shape)


def quantize_columnwise(x: torch.Tensor, group_size: int = BLOCK, *,
                        pow2_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a ``(T, K)`` tensor in groups of ``group_size`` *along T* (dim 0), kept in ``(T, K)`` layout.

    The values are exactly ``quantize_per_token_group(x.t())`` transposed back: the same groups, scales and
    E4M3 codes (``tests/unit/fp8/test_quant.py``), without materialising the transpose — the wgrad GEMM
    ``dW = dyᵀ x`` wants both operands token-major anyway. Returns ``(q (T, K), scale (ceil(T/group), K))``.
    """
    if not pow2_scale and (fused := native.quant_cols(x, group_size)) is not None:
        return fused  # the same numbers in one pass (fp8rl.fp8.native)
    t, k = x.shape
    xf = x.float()
    q = torch.empty(t, k, dtype=E4M3, device=x.device)
    scales = []
    for lo, hi in _group_spans(t, group_size):  # whole groups of tokens, then a ragged last one: no padded copy
        groups = xf[lo:hi].view(-1, min(group_size, hi - lo), k)  # (G, group, K)
        amax = torch.maximum(groups.amax(dim=1), groups.amin(dim=1).neg())  # (G, K)
        scales.append(compute_scale(amax, pow2_scale=pow2_scale))
        q[lo:hi] = _cast(groups, scales[-1].unsqueeze(1)).view(-1, k)
    if not scales:  # no tokens (an expert no row was routed to): no groups
        return q, torch.empty(0, k, dtype=torch.float32, device=x.device)
    return q, scales[0] if len(scales) == 1 else torch.cat(scales, dim=0)


def dequantize_columnwise(q: torch.Tensor, scale: torch.Tensor, group_size: int = BLOCK) -> torch.Tensor:
    """FP32 ``(T, K)`` from :func:`quantize_columnwise`'s output."""
    if (fused := native.dequant_cols(q, scale, group_size)) is not None:
        return fused  # the same numbers in one pass (fp8rl.fp8.native)
    t, k = q.shape
    g = scale.shape[0]
    if g * group_size == t:
        return (_e4m3_to_f32(q).view(g, group_size, k) * scale.float().unsqueeze(1)).view(t, k)
    v = _e4m3_to_f32(q)
    out = torch.empty(t, k, dtype=torch.float32, device=q.device)
    first = 0  # each span's groups times their scales, broadcast (no repeated scale tensor)
    for lo, hi in _group_spans(t, group_size):
        width = min(group_size, hi - lo)
        n = (hi - lo) // width
        torch.mul(v[lo:hi].view(n, width, k), scale[first:first + n].float().unsqueeze(1),
                  out=out[lo:hi].view(n, width, k))
        first += n
    return out


def fake_quantize_columnwise(x: torch.Tensor, group_size: int = BLOCK, *,
                             pow2_scale: bool = False) -> torch.Tensor:
    """``dequantize_columnwise(*quantize_columnwise(x))``: FP32, bitwise."""
    if not pow2_scale and (fused := native.fake_cols(x, group_size)) is not None:
        return fused  # the same numbers in one pass (fp8rl.fp8.native)
    return dequantize_columnwise(*quantize_columnwise(x, group_size, pow2_scale=pow2_scale), group_size)


def dequantize_per_token_group(
    q: torch.Tensor, scale: torch.Tensor, group_size: int = BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_per_token_group`."""
    k = q.shape[-1]
    g = math.ceil(k / group_size)
    if scale.shape != (*q.shape[:-1], g):
        raise ValueError(
            f"per-token-group scale shape {tuple(scale.shape)} does not match {tuple(q.shape)} "
            f"with group {group_size}: expected {(*q.shape[:-1], g)}"
        )
    if k % group_size == 0:  # broadcast over a (..., G, group) view: no expanded scale tensor
        out = q.float().view(*q.shape[:-1], g, group_size) * scale.float().unsqueeze(-1)
        return out.view(q.shape).to(dtype)
    s = scale.float().repeat_interleave(group_size, dim=-1)[..., :k]
    return (q.float() * s).to(dtype)


# ---------------------------------------------------------------------------------------------
# per-tensor (Q, K, V and the FP8 KV cache)
# ---------------------------------------------------------------------------------------------


def quantize_per_tensor(
    x: torch.Tensor, scale: torch.Tensor | float | None = None, *, pow2_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize with one FP32 scale for the whole tensor.

    Args:
        x: any shape.
        scale: the dequantization scale to use (a calibrated Q/K/V scale); computed from
            ``amax(|x|)`` when ``None``. Values beyond ``448 * scale`` saturate at ±448·scale.

    Returns:
        ``(q, scale)`` with ``scale`` a 0-dim FP32 tensor.
    """
    if scale is None:
        scale = compute_scale(x.detach().abs().amax().float(), pow2_scale=pow2_scale)
    else:
        scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(())
        if not bool(torch.isfinite(scale)) or float(scale) <= 0:
            raise ValueError(f"per-tensor FP8 scale must be finite and > 0, got {float(scale)}")
    if (fused := native.quant_tensor(x, scale)) is not None:  # the same codes in one pass
        return fused, scale
    return _cast(x.float(), scale), scale


def dequantize_per_tensor(q: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = torch.float32):
    """Inverse of :func:`quantize_per_tensor`."""
    if isinstance(scale, torch.Tensor) and (fused := native.dequant_tensor(q, scale)) is not None:
        return fused.to(dtype)  # the same numbers in one pass
    return (q.float() * torch.as_tensor(scale, dtype=torch.float32, device=q.device)).to(dtype)


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x.to(float8_e4m3fn).to(x.dtype)``: the E4M3 value of each element, no scale (attention probabilities)."""
    if (fused := native.round_e4m3(x)) is not None:
        return fused  # the same numbers in one pass
    return x.to(E4M3).to(x.dtype)
