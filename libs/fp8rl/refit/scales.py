"""The one wire format of a QKV scale set (:class:`fp8rl.fp8.QKVScales`): Redis, refit and gRPC carry these bytes.

A scale set is the FP32 per-tensor Q/K/V scales of every attention layer, calibrated on one weight
version. It travels as one byte string, the same everywhere: the value of the Redis key
``scales:<v>`` (:meth:`RefitStore.put_scales`) and ``CalibrateResponse.scales`` (calibrator.proto).

Layout (version 1 of the format, all little-endian, ``20 + 12 * L`` bytes)::

    offset  size    field
    0       8       magic  b"fp8rlqkv"
    8       8       int64  weight version the scales were calibrated on
    16      4       uint32 L, the number of attention layers
    20      12 * L  float32 (L, 3) row-major: layer i's (q, k, v) scales at 20 + 12 * i

Invariant: :func:`decode_scales` returns a :class:`QKVScales` only when the magic is right, the
length is exactly ``20 + 12 * L``, the header's version is the one asked for, (when given) ``L`` is
the expected layer count, and every scale is finite and > 0; otherwise it raises ``ValueError``
saying which. Nothing is ever unpickled.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from fp8rl.fp8 import QKVScales

__all__ = ["SCALES_MAGIC", "SCALES_HEADER", "encode_scales", "decode_scales", "scales_nbytes"]

SCALES_MAGIC = b"fp8rlqkv"
SCALES_HEADER = struct.Struct("<8sqI")  # magic, version (int64), num_layers (uint32); then (L, 3) FP32 LE
_ROW = struct.calcsize("<3f")  # one layer's (q, k, v)


def scales_nbytes(num_layers: int) -> int:
    """Encoded size of a set of ``num_layers`` layers."""
    return SCALES_HEADER.size + _ROW * num_layers


def encode_scales(scales: QKVScales) -> bytes:
    """The wire form of ``scales`` (see the module layout)."""
    if not isinstance(scales, QKVScales):
        raise TypeError(f"encode_scales expects QKVScales, got {type(scales).__name__}")
    body = scales.to_tensor().numpy().astype("<f4").tobytes()
    try:
        header = SCALES_HEADER.pack(SCALES_MAGIC, scales.version, scales.num_layers)
    except struct.error as exc:
        raise ValueError(f"QKV scales of version {scales.version!r} cannot be encoded: {exc}") from None
    return header + body


def decode_scales(data: bytes | bytearray | memoryview, version: int, *, num_layers: int | None = None) -> QKVScales:
    """Inverse of :func:`encode_scales`, for bytes from Redis or the network.

    Args:
        data: the encoded set.
        version: the weight version the caller needs scales of; a set calibrated on another is refused.
        num_layers: the layer count the caller's model has, or None to accept any.

    Raises:
        ValueError: ``data`` is not bytes, truncated, not a scale set, of the wrong length, version or
            layer count, or holds a scale that is not finite and > 0 (the message says which).
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ValueError(f"QKV scales of version {version} must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < SCALES_HEADER.size:
        raise ValueError(f"QKV scales of version {version} are truncated ({len(data)} bytes, the header alone "
                         f"is {SCALES_HEADER.size})")
    magic, held, layers = SCALES_HEADER.unpack_from(data)
    if magic != SCALES_MAGIC:
        raise ValueError(f"QKV scales of version {version} are malformed: not a scale set (magic {magic!r})")
    if len(data) != scales_nbytes(layers):
        raise ValueError(f"QKV scales of version {version} are malformed ({len(data)} bytes, {layers} layers "
                         f"need {scales_nbytes(layers)})")
    if held != version:
        raise ValueError(f"QKV scales stored for version {version} were calibrated on version {held}")
    if num_layers is not None and layers != num_layers:
        raise ValueError(f"QKV scales of version {version} cover {layers} layers, the model has {num_layers}")
    arr = np.frombuffer(data, dtype="<f4", offset=SCALES_HEADER.size).reshape(layers, 3)
    try:
        return QKVScales.from_tensor(version, torch.from_numpy(arr.astype(np.float32)))
    except ValueError as exc:  # a NaN, Inf, zero or negative scale
        raise ValueError(f"QKV scales of version {version} are invalid: {exc}") from None
