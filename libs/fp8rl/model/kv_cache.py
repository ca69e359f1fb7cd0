"""A static, preallocated KV cache for :class:`fp8rl.model.CausalLM`.

Layout: per layer one K and one V tensor of shape ``(B, Hkv, max_len + 1, D)``. Slots are *time*
indices shared by every row of the batch: one forward of ``T`` tokens writes slots
``[length, length + T)`` of every layer and then advances ``length`` by ``T`` once. Rows of
different prompt lengths are left-padded and their pad slots are hidden by the key-padding
``attention_mask`` of the forward, never by a per-row length.

Row-aligned storage (batch-invariant numerics): after :meth:`KVCache.align_rows` with each row's first
key slot ``offset[b]``, row ``b``'s slot ``s`` is stored at position ``s - offset[b]`` (its left padding is
never stored), so every row's keys start at position 0 — the canonical order split-KV attention reads —
and a decode step attends over a slice of the cache instead of gathering every key into that order.
Slots, ``length`` and the views :meth:`update` returns still count time slots; a returned view covers
positions ``[0, length + T - min(offset))``.

A layer whose attention carries a ``kv_quant`` (:class:`fp8rl.fp8.kv.QKVQuantizer`) stores its
K/V as ``torch.float8_e4m3fn`` (scaled per tensor, ``x ≈ q.float() * k_scale``); other layers
store the compute dtype. :meth:`KVCache.for_model` picks this per layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fp8rl.fp8.quant import E4M3

__all__ = ["KVCache"]


class KVCache:
    """Preallocated per-layer K/V storage with one shared ``length``.

    Args:
        num_layers: decoder layers of the model.
        batch_size: rows ``B``; every forward using this cache must have this batch size.
        num_kv_heads: ``Hkv``.
        max_len: slots per row; writing past it raises ``RuntimeError``.
        head_dim: ``D``.
        dtype: storage dtype, one for all layers or a sequence with one per layer.
        v_dim: the V slot's width when it differs from ``head_dim`` (multi-head latent attention stores its latent
            in K and its rotary key in V: :mod:`fp8rl.model.mla`), else None.
        device: where the tensors live.

    Invariant: ``0 <= length <= max_len``; slots ``[0, length)`` of every layer hold valid K/V.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype | Sequence[torch.dtype] = torch.float32,
        device: torch.device | str = "cpu",
        v_dim: int | None = None,
    ) -> None:
        if min(num_layers, batch_size, num_kv_heads, max_len, head_dim, v_dim or head_dim) <= 0:
            raise ValueError(
                f"KVCache sizes must be positive: layers={num_layers} batch={batch_size} "
                f"kv_heads={num_kv_heads} max_len={max_len} head_dim={head_dim}"
            )
        dtypes = [dtype] * num_layers if isinstance(dtype, torch.dtype) else list(dtype)
        if len(dtypes) != num_layers:
            raise ValueError(f"KVCache got {len(dtypes)} dtypes for {num_layers} layers")
        # one more position than slots: row-aligned writes of left padding land there, and nothing reads it
        shape = (batch_size, num_kv_heads, max_len + 1, head_dim)  # (B, Hkv, max_len + 1, D)
        self.k = [torch.zeros(shape, dtype=dt, device=device) for dt in dtypes]
        v_shape = shape[:3] + (v_dim or head_dim,)
        self.v = [torch.zeros(v_shape, dtype=dt, device=device) for dt in dtypes]
        self.batch_size = batch_size
        self.max_len = max_len
        self.length = 0
        self.offsets: torch.Tensor | None = None  # row-aligned storage (align_rows), else slot order
        self._offset_min = 0  # of offsets
        self._pos: tuple[int, int, torch.Tensor] | None = None  # (length, t, positions) of the current forward
        # Reference-path read cache of E4M3 layers: the dequantized K/V of slots [0, _deq_len[i]),
        # filled incrementally so a decode step dequantizes only its new slots. Dequantization is
        # elementwise, so these are exactly the numbers a full re-dequantize would give.
        self._deq: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._deq_len: dict[int, int] = {}
        # Row-aligned storage: per layer the (B, T) positions written since its last dequantized read, so the read
        # dequantizes those entries only (a decode step's one per row, not every position since the shortest row's).
        self._unread: dict[int, torch.Tensor] = {}

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        batch_size: int,
        max_len: int,
        *,
        device: torch.device | str | None = None,
    ) -> KVCache:
        """A cache sized for ``model`` (a :class:`~fp8rl.model.CausalLM`).

        Layers with a ``kv_quant`` get E4M3 storage, the others the dtype of the embedding
        (the compute dtype). ``device`` defaults to the embedding's device.
        """
        cfg = model.config
        emb = model.model.embed_tokens.weight
        dtypes = [E4M3 if layer.self_attn.kv_quant is not None else emb.dtype for layer in model.model.layers]
        if cfg.is_mla:  # one latent (K slot) and one rotary key (V slot) per token: what MLA compresses
            heads, head_dim, v_dim = 1, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        else:
            heads, head_dim, v_dim = cfg.num_key_value_heads, cfg.head_dim, None
        return cls(
            num_layers=cfg.num_hidden_layers,
            batch_size=batch_size,
            num_kv_heads=heads,
            max_len=max_len,
            head_dim=head_dim,
            dtype=dtypes,
            device=emb.device if device is None else device,
            v_dim=v_dim,
        )

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def dtype(self, layer_idx: int) -> torch.dtype:
        """Storage dtype of one layer."""
        return self.k[layer_idx].dtype

    def check_room(self, batch_size: int, num_new: int) -> None:
        """Raise before a forward that would not fit (so no layer is half-written)."""
        if batch_size != self.batch_size:
            raise ValueError(f"KVCache was built for batch size {self.batch_size}, the forward has {batch_size}")
        if self.length + num_new > self.max_len:
            raise RuntimeError(
                f"KVCache overflow: {self.length} slots used + {num_new} new tokens "
                f"> max_len={self.max_len}; build the cache with a larger max_len or reset() it"
            )

    def update(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, reach: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``/``v`` ``(B, Hkv, T, D)`` at slots ``[length, length + T)`` of one layer.

        Does not advance ``length`` (the model calls :meth:`advance` once per forward).

        Returns:
            Views of slots ``[0, length + T)``: ``(B, Hkv, length + T, D)`` each, storage dtype; row-aligned,
            of positions ``[0, aligned_span(T, reach))``.
        """
        t = k.shape[2]
        self.check_room(k.shape[0], t)
        kc, vc = self.k[layer_idx], self.v[layer_idx]
        if k.dtype != kc.dtype:
            raise TypeError(f"KVCache layer {layer_idx} stores {kc.dtype}, got K/V of dtype {k.dtype}")
        end = self.length + t
        if self.offsets is None:
            kc[:, :, self.length : end] = k
            vc[:, :, self.length : end] = v
            self._unread.pop(layer_idx, None)
            return kc[:, :, :end], vc[:, :, :end]
        pos = self._positions(t)
        for store, new in ((kc, k), (vc, v)):
            index = pos[:, None, :, None].expand_as(new)  # K and V may differ in width (MLA's latent and k_pe)
            if store.dtype == E4M3:  # scatter has no FP8 kernel: move the bytes
                store, new = store.view(torch.uint8), new.view(torch.uint8)
            store.scatter_(2, index, new)
        if kc.dtype == E4M3:
            before = self._unread.get(layer_idx)
            self._unread[layer_idx] = pos if before is None else torch.cat([before, pos], 1)
        span = self.aligned_span(t, reach)
        return kc[:, :, :span], vc[:, :, :span]

    def store(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, *, fp8: bool, reach: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`update` from an attention layer that stores E4M3 exactly when ``fp8`` (it carries a ``kv_quant``):
        ``k``/``v`` cast to the layer's storage dtype.

        Raises:
            RuntimeError: the cache was built for the other kind (rebuild it with :meth:`for_model`).
        """
        stored = self.dtype(layer_idx)
        if fp8 != (stored == E4M3):
            raise RuntimeError(
                f"layer {layer_idx}: KV cache stores {stored} but the layer {'has' if fp8 else 'has no'} FP8 "
                f"kv_quant; rebuild the cache with KVCache.for_model after enable_fp8_kv()/disable_fp8_kv()")
        return self.update(layer_idx, k.to(stored), v.to(stored), reach)

    def _positions(self, t: int) -> torch.Tensor:
        """``(B, t)`` the row-aligned positions of slots ``[length, length + t)`` (left padding: the unread spare
        position ``max_len``); computed once per forward, every layer writes the same ones."""
        if self._pos is None or self._pos[:2] != (self.length, t):
            slots = torch.arange(self.length, self.length + t, device=self.offsets.device)
            pos = slots[None, :] - self.offsets[:, None]
            self._pos = (self.length, t, torch.where(pos >= 0, pos, self.max_len))
        return self._pos[2]

    def aligned_span(self, num_new: int, reach: int = 0) -> int:
        """Positions a row-aligned view covers after ``num_new`` more slots: the longest row's, or ``reach``
        where the storage has room (positions no row has written yet hold finite zeros; attention that
        pads its keys to whole chunks then reads a view instead of copying the cache into a padded one)."""
        return max(self.length + num_new - self._offset_min, min(reach, self.max_len))

    def align_rows(self, offsets: torch.Tensor) -> None:
        """Store row ``b``'s slot ``s`` at position ``s - offsets[b]`` from now on (module docstring).

        Set before the first write; later calls must give the same offsets (a row's first key does not move).
        """
        offsets = offsets.to(device=self.k[0].device, dtype=torch.long)
        if tuple(offsets.shape) != (self.batch_size,) or bool((offsets < 0).any()):
            raise ValueError(f"KVCache.align_rows takes {self.batch_size} non-negative offsets, got {offsets.tolist()}")
        if self.offsets is not None and torch.equal(self.offsets, offsets):
            return
        if self.length > 0:
            raise RuntimeError(
                f"KVCache rows were {'aligned differently' if self.offsets is not None else 'stored in slot order'} "
                f"for {self.length} slots; align_rows before the first write (a row's first key never moves)"
            )
        self.offsets = offsets
        self._offset_min = int(offsets.min())
        self._pos = None

    def read_dequantized(
        self, layer_idx: int, end: int, dequantize, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K/V of slots ``[0, end)`` of an E4M3 layer, ``(B, Hkv, end, D)`` in ``dtype``.

        ``dequantize(k_q, v_q, dtype)`` is the layer's :meth:`QKVQuantizer.dequantize_kv`; the
        scales must not change during the cache's life (the engine holds them fixed per request).
        """
        kc, vc = self.k[layer_idx], self.v[layer_idx]
        if layer_idx not in self._deq:
            # zeros: a row-aligned view reaches positions other rows have not written yet (finite, never seen)
            self._deq[layer_idx] = (torch.zeros(kc.shape, dtype=dtype, device=kc.device),
                                    torch.zeros(vc.shape, dtype=dtype, device=vc.device))
            self._deq_len[layer_idx] = 0
        kd, vd = self._deq[layer_idx]
        pos = self._unread.pop(layer_idx, None)
        # row-aligned after the first read: exactly the entries written since (the first read dequantizes every
        # position so far: a reused session's K/V is copied into the empty cache without an update)
        if pos is not None and self._deq_len.get(layer_idx, 0) > 0:
            idx = pos[:, None, :, None]
            ik, iv = idx.expand(-1, kc.shape[1], -1, kc.shape[3]), idx.expand(-1, vc.shape[1], -1, vc.shape[3])
            k_new, v_new = dequantize(kc.view(torch.uint8).gather(2, ik).view(kc.dtype),  # no FP8 gather kernel
                                      vc.view(torch.uint8).gather(2, iv).view(vc.dtype), dtype)
            kd.scatter_(2, ik, k_new)
            vd.scatter_(2, iv, v_new)
            self._deq_len[layer_idx] = max(end, self._deq_len[layer_idx])
            return kd[:, :, :end], vd[:, :, :end]
        # slot order: the slots written since (they follow the ones read); row-aligned, the first read: all so far
        start = self._deq_len[layer_idx]
        if end > start:
            k_new, v_new = dequantize(kc[:, :, start:end], vc[:, :, start:end], dtype)
            kd[:, :, start:end] = k_new
            vd[:, :, start:end] = v_new
            self._deq_len[layer_idx] = max(end, self._deq_len[layer_idx])
        return kd[:, :, :end], vd[:, :, :end]

    def advance(self, num_new: int) -> None:
        """Mark ``num_new`` more slots as filled (after every layer wrote them)."""
        if self.length + num_new > self.max_len:
            raise RuntimeError(f"KVCache advance past max_len={self.max_len} (length {self.length} + {num_new})")
        self.length += num_new

    def reset(self) -> None:
        """Forget every slot (the storage is reused; old values are overwritten before use)."""
        self.length = 0
        self.offsets = None
        self._pos = None
        self._deq_len.clear()
        self._unread.clear()

    def __repr__(self) -> str:
        b, h, _, d = self.k[0].shape
        return (
            f"KVCache(layers={self.num_layers}, batch={b}, kv_heads={h}, max_len={self.max_len}, head_dim={d}, "
            f"dtype={self.k[0].dtype}, length={self.length})"
        )
