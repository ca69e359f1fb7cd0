"""KV sessions of the embedded rollout engine: a multi-turn trajectory's K/V kept between its turns (issue 48).

A multi-turn trajectory asks the engine for a turn with its *whole* token list as the prompt. With a session key
(:meth:`TorchRolloutEngine.generate` ``sessions=``) the engine keeps, after the turn, the K/V of every token it fed
for that row — the prompt and the generated tokens but the last (never fed) — and the next turn prefills only the
suffix the history does not cover.

Invariants:

* **One version per entry.** An entry is served only at the weight version *and* the QKV scales version it was
  computed with; every refit (``load_weights`` / ``follow``) and ``load_scales`` drops them all (the ``finish``
  policy: a trajectory's cached K/V all come from one version). With an FP8 KV cache an entry holds the E4M3
  values quantized with that version's per-tensor scales, copied as they are: one version's scales *per
  trajectory*, never per token.
* **A hit is a prefix.** The cached tokens must be a prefix of the new prompt; anything else (an edited history,
  a shorter prompt, another version) is a miss: the row is recomputed from scratch and its entry replaced.
* **Bitwise under batch invariance.** With :mod:`fp8rl.model.invariant` on, a token's K/V do not depend on the
  batch, the padding, or decode vs prefill, so the K/V copied from an entry are the bits a full re-prefill of the
  history would write, and every logprob, sampled token and MoE route of a call with sessions equals the call
  without (same seed). Without batch invariance they need not: the reused K/V carry the rounding of the shapes
  they were computed in (decode GEMMs of a few rows) where a re-prefill computes them in one large GEMM — about
  1e-7 relative in FP32, more after E4M3 rounding — so logprobs differ in the last bits and a sampled token can
  flip; the distribution sampled is the same model's.

Memory: entries are bounded in bytes (K/V of every layer plus the routes) and evicted least recently used; an
entry larger than the whole bound is not kept. Both count as evictions; an evicted key is a miss next turn.

Ragged batches (the engine's ``_generate_rows``): rows stay left-padded with their last prompt token at slot
``P - 1``; one prefill feeds slots ``[L, P)`` of every row, ``P - L`` the longest suffix no entry covers. Row ``b``
copies positions ``[0, reuse[b])`` (those before slot ``L``) from its entry and has the rest of its cached prefix
re-fed — the same bits again under batch invariance, wasted work otherwise. So a batch costs the prefill of its
longest uncovered suffix: a new trajectory with a long prompt among continuing ones re-feeds them all (the rows'
batches and their order are never changed to avoid it: sampling draws from one generator per call, so a row's
random numbers depend on them).

Layout (:class:`~fp8rl.model.KVCache`): a row-aligned cache (batch invariance) holds row ``b``'s token ``j`` at
position ``j``; a slot-ordered one at slot ``first[b] + j`` (``first``: the row's first, left-padded, slot).
:func:`seed_cache` writes reused K/V there before the prefill; :meth:`KVSession.from_cache` reads them back.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fp8rl.model import KVCache

log = logging.getLogger(__name__)

__all__ = ["KVSession", "SessionStore", "seed_cache"]


@dataclass(frozen=True)
class KVSession:
    """The K/V one row fed, kept under its session key.

    Attributes:
        tokens: the fed tokens in order; position ``j``'s K/V are ``k[i][:, j]`` / ``v[i][:, j]``.
        weight_version: the weights that computed them.
        scales_version: the QKV scales that quantized them (FP8 KV cache), else None.
        k: per layer ``(Hkv, n, D)`` in the cache's storage dtype (E4M3 for an FP8 layer).
        v: per layer ``(Hkv, n, Dv)``.
        routes: ``(n, L, K)`` experts each fed token used (``record_routes``), else None.
    """

    tokens: tuple[int, ...]
    weight_version: int
    scales_version: int | None
    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]
    routes: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        held = [*self.k, *self.v] + ([self.routes] if self.routes is not None else [])
        return sum(t.numel() * t.element_size() for t in held)

    @classmethod
    def from_cache(cls, cache: KVCache, row: int, first: int, tokens: Sequence[int], weight_version: int,
                   scales_version: int | None, routes: torch.Tensor | None) -> KVSession:
        """Copy row ``row``'s K/V of its first ``len(tokens)`` tokens out of ``cache`` (``first``: the row's first
        slot, used when the cache is slot-ordered)."""
        n = len(tokens)
        lo = 0 if cache.offsets is not None else first  # row-aligned: the row starts at position 0
        k = tuple(kc[row, :, lo:lo + n].clone() for kc in cache.k)  # (Hkv, n, D) each
        v = tuple(vc[row, :, lo:lo + n].clone() for vc in cache.v)
        return cls(tuple(tokens), weight_version, scales_version, k, v, routes)


def seed_cache(cache: KVCache, firsts: Sequence[int], found: Sequence[KVSession | None], reuse: Sequence[int],
               length: int, row_aligned: bool) -> None:
    """Fill an empty ``cache`` with the reused K/V and mark its first ``length`` slots as filled.

    Args:
        firsts: each row's first (left-padded) slot.
        found: each row's session, or None.
        reuse: positions ``[0, reuse[b])`` of row ``b`` come from its session (``first + reuse <= length``: the
            prefill that follows writes every slot from ``length`` on).
        length: the slot the prefill starts at.
        row_aligned: the model runs batch-invariant (its forward row-aligns the cache at ``firsts``).
    """
    if cache.length:
        raise RuntimeError(f"seed_cache needs an empty cache, this one holds {cache.length} slots")
    if row_aligned:
        cache.align_rows(torch.tensor(list(firsts), dtype=torch.long))
    for b, (first, s, r) in enumerate(zip(firsts, found, reuse, strict=True)):
        if r == 0:
            continue
        if first + r > length:
            raise ValueError(f"row {b}: {r} reused positions from slot {first} pass the prefill's first slot {length}")
        lo = 0 if row_aligned else first
        for kc, vc, ks, vs in zip(cache.k, cache.v, s.k, s.v, strict=True):
            kc[b, :, lo:lo + r] = ks[:, :r]  # E4M3 copied as stored: the bytes a re-prefill would write
            vc[b, :, lo:lo + r] = vs[:, :r]
    cache.advance(length)


class SessionStore:
    """Session key -> :class:`KVSession`, least recently used first, bounded in bytes.

    Counters (:meth:`stats`): ``hits`` / ``misses`` per looked-up row (a row without a key counts neither; a hit is
    a usable entry, whose positions the prefill window may still re-feed: see the engine's ragged layout),
    ``evictions`` (entries pushed out by the byte bound, or too large to keep), ``prefill_tokens`` (prompt tokens
    fed by the engine's prefills, every row of every call, left padding not counted) and ``reused_tokens``
    (prompt tokens whose K/V came from an entry instead).
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"session_cache_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, KVSession] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = self.evictions = self.prefill_tokens = self.reused_tokens = 0

    def lookup(self, key: str, prompt: Sequence[int], weight_version: int, scales_version: int | None
               ) -> KVSession | None:
        """The entry of ``key`` when it is usable for ``prompt`` (same versions, its tokens a prefix), counted as a
        hit or a miss; a stale entry (another version, another history) is dropped."""
        s = self._entries.get(key)
        n = len(s.tokens) if s is not None else 0
        if (s is not None and (s.weight_version, s.scales_version) == (weight_version, scales_version)
                and n <= len(prompt) and tuple(prompt[:n]) == s.tokens):
            self._entries.move_to_end(key)
            self.hits += 1
            return s
        if s is not None:
            self.drop(key)
        self.misses += 1
        return None

    def put(self, key: str, session: KVSession) -> None:
        """Keep ``session`` under ``key`` (replacing what was there), then evict down to the byte bound."""
        self.drop(key)
        size = session.nbytes
        if size > self.max_bytes:
            self.evictions += 1
            log.debug("KV session %r (%d bytes) exceeds session_cache_bytes=%d: not kept", key, size, self.max_bytes)
            return
        self._entries[key] = session
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes
            self.evictions += 1

    def drop(self, key: str) -> bool:
        """Forget ``key``'s entry; whether there was one."""
        s = self._entries.pop(key, None)
        if s is not None:
            self._bytes -= s.nbytes
        return s is not None

    def clear(self) -> None:
        """Forget every entry (a new version: their K/V are no longer what the engine would compute)."""
        self._entries.clear()
        self._bytes = 0

    def stats(self) -> dict[str, int]:
        return dict(hits=self.hits, misses=self.misses, evictions=self.evictions, prefill_tokens=self.prefill_tokens,
                    reused_tokens=self.reused_tokens, entries=len(self._entries), bytes=self._bytes)
