"""QKV scale calibration: forward passes that record Q/K/V amax per attention layer.

Hooks sit on every layer's ``self_attn.qkv_point`` — after QK-norm and RoPE, before any FP8
quantization — i.e. exactly the tensors the FP8 KV cache stores. Each micro-batch forward is one
*pass*; per pass and layer the hook records the amax of Q, K and V over real (non-padding)
tokens only. :func:`fp8rl.fp8.scales_from_amax_history` turns the per-pass maxima into FP32
scales (high percentile × margin / 448). Deterministic given weights and sequences.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import torch

from fp8rl.fp8 import QKVScales, scales_from_amax_history, transformer_layers
from fp8rl.model import CausalLM
from fp8rl.model.vision import ImageBatch

__all__ = ["QKVCalibrator", "QKVRecording"]


class _PassDone(Exception):
    """Raised by the last layer's Q/K/V hook: the rest of the forward pass is not needed."""


def _amax_hook(hist: dict[str, list[list[float]]], valid: list[torch.Tensor], cut_after: int | None,
               continues: list[bool] | None = None):
    """``make_hook(i)``: a forward hook for layer ``i``'s ``qkv_point`` appending the pass's Q/K/V amax over the real
    tokens (``valid[0]``, ``(B, T)``) to ``hist``; with ``cut_after`` the layer of that index ends the pass. Where
    ``continues[0]`` (the suffixes' forward after a shared prefix's), the amax joins the last entry: prefix and
    suffixes are one pass over the full rows."""

    def make_hook(i: int):
        def hook(_mod, _inputs, outputs):
            m = valid[0]  # (B, T)
            for name, t in zip(("q", "k", "v"), outputs, strict=True):  # (B, H, T, D)
                per_tok = t.detach().abs().amax(dim=(1, 3)).float()  # (B, T)
                amax = float(per_tok.masked_fill(~m, 0.0).max())
                if continues is not None and continues[0]:
                    hist[name][i][-1] = max(hist[name][i][-1], amax)
                else:
                    hist[name][i].append(amax)
            if i == cut_after:  # nothing after the last layer's Q/K/V is read: cut the pass here
                raise _PassDone
        return hook

    return make_hook


class QKVRecording:
    """Q/K/V amax of every forward of a model while it is open (:meth:`QKVCalibrator.recording`): each forward is
    one pass over the tokens its ``attention_mask`` keeps, the statistic :meth:`QKVCalibrator.calibrate` takes
    over its own passes. :meth:`scales` turns them into a version's scales."""

    def __init__(self, calibrator: QKVCalibrator) -> None:
        self.calibrator = calibrator
        layers = transformer_layers(calibrator.model)
        self.hist: dict[str, list[list[float]]] = {k: [[] for _ in layers] for k in ("q", "k", "v")}
        self._valid: list[torch.Tensor] = []
        self._continues = [False]
        make_hook = _amax_hook(self.hist, self._valid, cut_after=None, continues=self._continues)  # the whole forward
        self._handles = [calibrator.model.register_forward_pre_hook(self._pass_mask, with_kwargs=True)]
        self._handles += [layer.self_attn.qkv_point.register_forward_hook(make_hook(i))
                          for i, layer in enumerate(layers)]

    def _pass_mask(self, _mod, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
        prefix = kwargs.get("prefix")  # a shared prefix's suffixes continue the pass its forward opened
        self._continues[0] = prefix is not None and not prefix.recording
        self._valid[:] = [mask[:, -ids.shape[1]:].bool() if mask is not None  # the mask's keys end with the new tokens
                          else torch.ones(ids.shape, dtype=torch.bool, device=ids.device)]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def passes(self) -> int:
        return len(self.hist["q"][0]) if self.hist["q"] else 0

    def scales(self, version: int) -> QKVScales:
        """The scales of what was recorded, labelled ``version``."""
        if self.passes == 0:
            raise ValueError("no forward pass was recorded: nothing to calibrate on")
        c = self.calibrator
        return scales_from_amax_history(version, self.hist, percentile=c.percentile, margin=c.margin)


class QKVCalibrator:
    """Computes :class:`QKVScales` for a model's current weights.

    Args:
        model: the model whose weights are being calibrated (used forward-only, never modified).
        micro_batch_size: sequences per forward pass.
        percentile: percentile of per-pass maxima (99.9 → robust to one outlier batch).
        margin: head-room multiplier on the amax.
        pad_token_id: filler for right padding (masked out of the amax).
        max_sequences: calibrate on at most this many sequences (evenly spaced over the batch,
            so the choice is deterministic); None uses all. Subsampling trades a little scale
            accuracy (the amax of a subset is ≤ the full amax; the 1.05 margin absorbs the usual
            gap) for a calibration cost that no longer grows with the rollout batch.
    """

    def __init__(self, model: CausalLM, *, micro_batch_size: int = 32, percentile: float = 99.9,
                 margin: float = 1.05, pad_token_id: int = 0, max_sequences: int | None = None) -> None:
        self.model = model
        self.max_sequences = max_sequences
        self.micro_batch_size = micro_batch_size
        self.percentile = percentile
        self.margin = margin
        self.pad_token_id = pad_token_id
        self.last_seconds = 0.0

    def select(self, sequences: Sequence) -> list:
        """The deterministic, evenly spaced subset of ``sequences`` (or of anything one per sequence) that
        calibration uses."""
        n = len(sequences)
        if self.max_sequences is None or n <= self.max_sequences:
            return list(sequences)
        return [sequences[(i * n) // self.max_sequences] for i in range(self.max_sequences)]

    @contextlib.contextmanager
    def recording(self) -> Iterator[QKVRecording]:
        """Record the Q/K/V amax of the model's forwards inside the block (:class:`QKVRecording`) — e.g. the
        trainer's logprob pass over a whole step, whose statistic then costs no forward of its own."""
        rec = QKVRecording(self)
        try:
            yield rec
        finally:
            rec.close()

    @torch.no_grad()
    def calibrate(self, version: int, sequences: Sequence[Sequence[int]],
                  images: Sequence[ImageBatch | None] | None = None) -> QKVScales:
        """Scales for weight ``version`` from forward passes over ``sequences`` (prompts + responses); ``images``:
        a vision-language model's, per sequence its prompt's images or None (the multimodal sequence as the engines
        run it)."""
        if not sequences:
            raise ValueError("calibration needs at least one sequence")
        if images is not None and len(images) != len(sequences):
            raise ValueError(f"calibration has {len(images)} image entries for {len(sequences)} sequences")
        t0 = time.perf_counter()
        if images is not None:
            images = self.select(images)
        sequences = self.select(sequences)
        layers = transformer_layers(self.model)
        hist: dict[str, list[list[float]]] = {k: [[] for _ in layers] for k in ("q", "k", "v")}
        valid: list[torch.Tensor] = []  # (B, T) of the pass in flight
        make_hook = _amax_hook(hist, valid, cut_after=len(layers) - 1)
        handles = [layer.self_attn.qkv_point.register_forward_hook(make_hook(i)) for i, layer in enumerate(layers)]
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(sequences), self.micro_batch_size):
                chunk = sequences[start:start + self.micro_batch_size]
                T = max(len(s) for s in chunk)
                ids = torch.full((len(chunk), T), self.pad_token_id, dtype=torch.long)
                mask = torch.zeros(len(chunk), T, dtype=torch.bool)
                for b, s in enumerate(chunk):
                    if len(s) == 0:
                        raise ValueError(f"calibration sequence {start + b} is empty")
                    ids[b, :len(s)] = torch.tensor(list(s), dtype=torch.long)
                    mask[b, :len(s)] = True
                valid[:] = [mask]
                pictures = ImageBatch.concat(images[start:start + self.micro_batch_size]) if images else None
                try:
                    self.model(ids, attention_mask=mask.long(), **({"images": pictures} if pictures else {}))
                except _PassDone:
                    pass
        finally:
            for h in handles:
                h.remove()
            self.model.train(was_training)
        scales = scales_from_amax_history(version, hist, percentile=self.percentile, margin=self.margin)
        self.last_seconds = time.perf_counter() - t0
        return scales
