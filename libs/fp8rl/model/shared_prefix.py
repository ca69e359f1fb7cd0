"""A prefix every row of a batch shares, run once: the trainer's forward over a GRPO group (one prompt, ``n``
sampled continuations) or over trajectories that open with the same system prompt and tools block.

:class:`SharedPrefix` is filled by a forward over the prefix alone (batch 1): every attention layer keeps the K/V
it attends with (after RoPE, QK-norm and, with an FP8 KV cache, the E4M3 round trip; in the autograd graph). The
forward over the rows' suffixes then reads them: each layer attends its new tokens to ``prefix K/V`` (broadcast
to the batch) followed by its own, at positions counted on from the prefix. The backward sums the rows'
gradients into the prefix's K/V and on through the prefix forward, so the loss and its gradient are those of the
full rows (up to FP32 summation order); the rows' prefix tokens are computed once instead of ``B`` times.

Under batch invariance (:mod:`fp8rl.model.invariant`) the suffix positions' logits are bitwise those of the full
forward: every linear gives a row the same bits whatever else is in its batch, the prefix's K/V are those the full
forward computes for each row, and split-KV attention runs over the same keys in the same chunks — the property a
KV cache's incremental decode relies on already. Without it they agree to rounding.

No KV cache is involved (nothing is stored in place, so activation checkpointing of the suffix forward still
works); multi-head latent attention does not take a prefix.
"""

from __future__ import annotations

import torch

__all__ = ["SharedPrefix", "shared_prefix_length"]


class SharedPrefix:
    """Per-layer K/V of a prefix run once. Recording until :meth:`seal` (the prefix's forward), read after it."""

    def __init__(self) -> None:
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}
        self.length: int | None = None  # set by seal

    @property
    def recording(self) -> bool:
        return self.length is None

    def seal(self, length: int) -> None:
        """The prefix's forward is done: ``length`` tokens, one K/V per layer recorded."""
        if not self._k:
            raise RuntimeError("SharedPrefix.seal: no layer recorded its K/V (run the prefix's forward with it first)")
        lengths = {k.shape[2] for k in self._k.values()}
        if lengths != {length} or any(k.shape[0] != 1 for k in self._k.values()):
            raise RuntimeError(f"SharedPrefix.seal({length}): recorded K/V of lengths {sorted(lengths)}, batch "
                               f"{sorted({k.shape[0] for k in self._k.values()})} (the prefix runs as one row)")
        self.length = length

    def attend(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values layer ``layer_idx`` attends with, given its own ``(B, Hkv, T, D)`` ones: recording,
        they are kept and returned as they are; after :meth:`seal`, the prefix's come first
        (``(B, Hkv, length + T, D)``)."""
        if self.recording:
            if layer_idx in self._k:
                raise RuntimeError(f"SharedPrefix: layer {layer_idx} recorded twice (one prefix forward per prefix)")
            self._k[layer_idx], self._v[layer_idx] = k, v
            return k, v
        pk, pv = self._k[layer_idx], self._v[layer_idx]
        B = k.shape[0]
        return (torch.cat([pk.expand(B, -1, -1, -1).to(k.dtype), k], dim=2),
                torch.cat([pv.expand(B, -1, -1, -1).to(v.dtype), v], dim=2))


def shared_prefix_length(input_ids: torch.Tensor, attention_mask: torch.Tensor, first_needed: int) -> int:
    """How many leading tokens every row of right-padded ``input_ids`` ``(B, T)`` shares (real tokens in every
    row), at most ``first_needed - 1``: the logprob of token ``t`` comes from position ``t - 1``, so the first
    token whose logprob is needed must follow the prefix by one. 0 for fewer than two rows."""
    B, T = input_ids.shape
    if B < 2 or first_needed < 2:
        return 0
    same = (input_ids == input_ids[:1]).all(0) & attention_mask.bool().all(0)  # (T,)
    differs = (~same).nonzero()
    common = int(differs[0]) if differs.numel() else T
    return max(0, min(common, first_needed - 1))
