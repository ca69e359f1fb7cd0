"""Per-tensor FP8 for attention: Q/K/V scales, the FP8 KV cache, FP8 attention, and calibration math.

Every attention layer of a model running with ``kv_cache_dtype: fp8`` holds one
:class:`QKVQuantizer`. Its three FP32 scales (``q_scale``, ``k_scale``, ``v_scale``) are buffers
that a refit overwrites *in place* (``copy_``), so the tensors a running engine points at never
change identity. The scales belong to one weight version (``version``); an engine must never serve
version v with scales of another version or with the 1.0 placeholders (the NeMo RL #3225 failure),
which :meth:`QKVQuantizer.require_version` enforces.

Calibration (after every training step): the calibrator records, per layer and per forward pass,
the amax of Q, K and V *after* QK-norm and RoPE (what the cache stores). The per-layer amax is a
high percentile of the per-pass maxima (robust to one outlier batch; with few passes it is the
max), and ``scale = amax * margin / 448`` with ``margin = 1.05``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .quant import E4M3_MAX, dequantize_per_tensor, quantize_per_tensor, round_to_e4m3

__all__ = ["QKVQuantizer", "QKVScales", "calibrated_scale", "scales_from_amax_history", "straight_through"]


class _StraightThrough(torch.autograd.Function):
    """``fn(x)`` forward, identity backward: the forward numbers are exactly ``fn``'s (no ``x + (y - x)``
    re-association), and gradients pass the rounding unchanged (a straight-through estimator)."""

    @staticmethod
    def forward(ctx, x, fn):
        return fn(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def straight_through(x: torch.Tensor, fn) -> torch.Tensor:
    """``fn(x)`` with straight-through gradients when ``x`` needs them (the trainer's FP8 attention)."""
    return _StraightThrough.apply(x, fn) if x.requires_grad else fn(x)

DEFAULT_MARGIN = 1.05
DEFAULT_PERCENTILE = 99.9


@dataclass
class QKVScales:
    """FP32 per-tensor Q/K/V scales of every attention layer, computed on one weight version.

    Attributes:
        version: the weight version these scales were calibrated on.
        q, k, v: one scale per layer (``len == num_layers``), each > 0 and finite.
    """

    version: int
    q: list[float] = field(default_factory=list)
    k: list[float] = field(default_factory=list)
    v: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Scales are FP32 on the wire and in the engines: store exactly the FP32 values.
        self.q, self.k, self.v = (torch.tensor(list(x), dtype=torch.float32).tolist() for x in (self.q, self.k, self.v))
        if not (len(self.q) == len(self.k) == len(self.v)):
            raise ValueError(f"QKV scale lists differ in length: q={len(self.q)} k={len(self.k)} v={len(self.v)}")
        for name, vals in (("q", self.q), ("k", self.k), ("v", self.v)):
            for i, s in enumerate(vals):
                if not (s > 0 and s < float("inf")):
                    raise ValueError(f"{name}_scale of layer {i} must be finite and > 0, got {s}")

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def to_tensor(self) -> torch.Tensor:
        """``(num_layers, 3)`` FP32 tensor, columns q, k, v (the wire layout)."""
        return torch.tensor([self.q, self.k, self.v], dtype=torch.float32).T.contiguous()

    @classmethod
    def from_tensor(cls, version: int, t: torch.Tensor) -> QKVScales:
        if t.dim() != 2 or t.shape[1] != 3:
            raise ValueError(f"QKV scale tensor must be (num_layers, 3), got {tuple(t.shape)}")
        t = t.float()
        return cls(version, t[:, 0].tolist(), t[:, 1].tolist(), t[:, 2].tolist())


def calibrated_scale(amax: float, margin: float = DEFAULT_MARGIN) -> float:
    """``amax * margin / 448``; an all-zero tensor gets scale 1.0."""
    if not amax > 0:
        return 1.0
    return float(amax) * margin / E4M3_MAX


def scales_from_amax_history(
    version: int,
    history: dict[str, list[list[float]]],
    *,
    percentile: float = DEFAULT_PERCENTILE,
    margin: float = DEFAULT_MARGIN,
) -> QKVScales:
    """Turn per-pass amax records into :class:`QKVScales`.

    Args:
        version: weight version the passes ran on.
        history: ``{"q": per_layer, "k": ..., "v": ...}`` where ``per_layer[i]`` is the list of
            per-pass amax values of layer ``i``.
        percentile: percentile of the per-pass maxima (linear interpolation; with few passes
            99.9 is effectively the max).
        margin: head-room multiplier.
    """
    out: dict[str, list[float]] = {}
    for name in ("q", "k", "v"):
        per_layer = history[name]
        vals = []
        for i, passes in enumerate(per_layer):
            if not passes:
                raise ValueError(f"no calibration passes recorded for {name} of layer {i}")
            t = torch.tensor(passes, dtype=torch.float64)
            amax = float(torch.quantile(t, percentile / 100.0))
            vals.append(calibrated_scale(amax, margin))
        out[name] = vals
    return QKVScales(version, out["q"], out["k"], out["v"])


class QKVQuantizer(nn.Module):
    """Per-tensor E4M3 quantization of one attention layer's Q, K and V.

    The attention layer calls, after QK-norm and RoPE:

    * :meth:`quantize_kv` to get the E4M3 K/V it stores in an FP8 KV cache,
    * :meth:`dequantize_kv` to read the cache back for the attention math,
    * :meth:`fake_quantize_q` (FP8 attention: Q is E4M3 too),
    * :meth:`round_probs` on the softmax probabilities before ``P @ V`` when ``fp8_attention``
      (probabilities use scale 1.0: they lie in [0, 1], which E4M3 covers down to 2**-9),
    * :meth:`fake_quantize_kv` in a forward without a cache (the trainer's, under batch-invariant
      numerics): the numbers a cache would store and return.

    Gradients flow through every rounding straight-through (:func:`straight_through`): the trainer's
    backward treats the E4M3 rounding of Q, K, V and P as the identity.

    Args:
        fp8_attention: also round Q and the probabilities to E4M3 (FP8 attention).
    """

    def __init__(self, fp8_attention: bool = True) -> None:
        super().__init__()
        self.fp8_attention = fp8_attention
        self.register_buffer("q_scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32))
        self.version: int | None = None  # None = placeholder 1.0 scales, never served

    def _apply(self, fn, recurse=True):
        # Scales are FP32 by contract: a model-wide .to(bfloat16) must not round them.
        super()._apply(fn, recurse)
        for name in ("q_scale", "k_scale", "v_scale"):
            buf = getattr(self, name)
            if buf.dtype != torch.float32:
                setattr(self, name, buf.float())
        return self

    @torch.no_grad()
    def set_scales(self, q: float, k: float, v: float, version: int) -> None:
        """Overwrite the scales in place (tensor identity is kept across refits)."""
        for buf, val, name in ((self.q_scale, q, "q"), (self.k_scale, k, "k"), (self.v_scale, v, "v")):
            if not (val > 0 and val < float("inf")):
                raise ValueError(f"{name}_scale must be finite and > 0, got {val}")
            buf.fill_(float(val))
        self.version = version

    def require_version(self, version: int) -> None:
        if self.version != version:
            held = "placeholder 1.0 scales" if self.version is None else f"scales of version {self.version}"
            raise RuntimeError(f"FP8 KV cache needs QKV scales of weight version {version}, but holds {held}")

    def quantize_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_per_tensor(k, self.k_scale)[0], quantize_per_tensor(v, self.v_scale)[0]

    def dequantize_kv(
        self, k_q: torch.Tensor, v_q: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return dequantize_per_tensor(k_q, self.k_scale, dtype), dequantize_per_tensor(v_q, self.v_scale, dtype)

    def fake_quantize_kv(self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """``dequantize_kv(quantize_kv(k, v))`` elementwise (bitwise what a cache round trip gives)."""
        return (straight_through(k, lambda t: dequantize_per_tensor(quantize_per_tensor(t, self.k_scale)[0],
                                                                     self.k_scale, dtype)),
                straight_through(v, lambda t: dequantize_per_tensor(quantize_per_tensor(t, self.v_scale)[0],
                                                                     self.v_scale, dtype)))

    def fake_quantize_q(self, q: torch.Tensor) -> torch.Tensor:
        if not self.fp8_attention:
            return q
        return straight_through(
            q, lambda t: dequantize_per_tensor(quantize_per_tensor(t, self.q_scale)[0], self.q_scale, t.dtype))

    def round_probs(self, p: torch.Tensor) -> torch.Tensor:
        if not self.fp8_attention:
            return p
        return straight_through(p, round_to_e4m3)

    def extra_repr(self) -> str:
        return (
            f"fp8_attention={self.fp8_attention}, version={self.version}, q_scale={float(self.q_scale):.4g}, "
            f"k_scale={float(self.k_scale):.4g}, v_scale={float(self.v_scale):.4g}"
        )
