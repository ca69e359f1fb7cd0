"""Raw-byte weight shards: a ``dict[str, Tensor]`` ⇄ a list of byte strings plus typed entries.

Wire format (version 1). All tensors' bytes, C-contiguous and little-endian, are laid end to end
in one logical byte stream in entry order; the stream is cut into shards of at most
``shard_bytes``. A tensor that does not fit in the room left in the current shard starts a new
one; only a tensor larger than ``shard_bytes`` spans several (it fills whole shards and continues
at offset 0 of the next). Each tensor is described by a :class:`TensorEntry` (name, dtype string,
shape, block size, shard index and offset where it starts, byte length, blake2b-128 checksum);
the entries travel in the manifest, never inside the shards, so a shard is nothing but bytes.
FP8 tensors travel as their uint8 view. No pickles anywhere.

Invariant: :func:`unpack_tensors` returns tensors only when every shard has the announced size,
the entries tile the stream exactly (no gap, no overlap, nothing left over), every dtype is one
of :data:`DTYPES`, every byte length equals ``numel × itemsize`` and every tensor's checksum
matches; otherwise it raises :class:`CorruptShardError` naming the tensor and the shard.

The other refit payload, a QKV scale set, has its own format in :mod:`.scales` (re-exported here).
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .scales import decode_scales, encode_scales

__all__ = [
    "DTYPES",
    "DEFAULT_SHARD_BYTES",
    "CorruptShardError",
    "TensorEntry",
    "checksum",
    "pack_tensors",
    "unpack_tensors",
    "verify_shard",
    "encode_scales",
    "decode_scales",
]

DEFAULT_SHARD_BYTES = 64 * 1024 * 1024

DTYPES: dict[str, torch.dtype] = {
    "float8_e4m3fn": torch.float8_e4m3fn,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "int64": torch.int64,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_CHECKSUM_HEX = 32  # blake2b with a 16-byte (128-bit) digest


class CorruptShardError(ValueError):
    """A shard or one tensor in it failed validation (size, dtype, layout or checksum).

    Attributes:
        tensor: name of the offending tensor, or None when the problem is a whole shard.
        shard: index of the offending shard (the first one when a tensor spans several), or None.
    """

    def __init__(self, message: str, *, tensor: str | None = None, shard: int | None = None) -> None:
        super().__init__(message)
        self.tensor, self.shard = tensor, shard


def checksum(data: Any) -> str:
    """blake2b-128 hex digest of a bytes-like object (the checksum of tensors and shards)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in the shards and how to rebuild it.

    Attributes:
        name: state-dict name (Hugging Face naming).
        dtype: one of :data:`DTYPES`' keys, e.g. ``"bfloat16"``, ``"float8_e4m3fn"``.
        shape: tensor shape (``()`` for a scalar).
        block_size: ``(128, 128)`` for a block-scaled FP8 weight and its ``weight_scale``
            companion; None for everything else.
        shard: index of the shard where its bytes start.
        offset: byte offset of its start in that shard.
        nbytes: byte length (``numel × itemsize``).
        checksum: blake2b-128 hex of its bytes.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    block_size: tuple[int, int] | None
    shard: int
    offset: int
    nbytes: int
    checksum: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"tensor entry name must be a non-empty string, got {self.name!r}")
        where = f"tensor {self.name!r} (shard {self.shard})"
        if not isinstance(self.dtype, str):
            raise ValueError(f"{where}: dtype must be a string, got {self.dtype!r}")
        if not isinstance(self.shape, tuple) or not all(_is_int(d) and d >= 0 for d in self.shape):
            raise ValueError(f"{where}: shape must be a tuple of ints >= 0, got {self.shape!r}")
        if self.block_size is not None and not (
            isinstance(self.block_size, tuple) and len(self.block_size) == 2
            and all(_is_int(b) and b > 0 for b in self.block_size)
        ):
            raise ValueError(f"{where}: block_size must be None or two ints > 0, got {self.block_size!r}")
        for key in ("shard", "offset", "nbytes"):
            if not _is_int(getattr(self, key)) or getattr(self, key) < 0:
                raise ValueError(f"{where}: {key} must be an int >= 0, got {getattr(self, key)!r}")
        if not isinstance(self.checksum, str) or len(self.checksum) != _CHECKSUM_HEX:
            raise ValueError(f"{where}: checksum must be {_CHECKSUM_HEX} hex characters, got {self.checksum!r}")
        if self.dtype not in DTYPES:
            raise CorruptShardError(
                f"{where} has unknown dtype {self.dtype!r}; supported: {', '.join(DTYPES)}",
                tensor=self.name, shard=self.shard,
            )
        expected = math.prod(self.shape) * DTYPES[self.dtype].itemsize
        if self.nbytes != expected:
            raise CorruptShardError(
                f"{where} declares {self.nbytes} bytes, but {self.dtype}{list(self.shape)} needs {expected}",
                tensor=self.name, shard=self.shard,
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (tuples become lists)."""
        return {
            "name": self.name, "dtype": self.dtype, "shape": list(self.shape),
            "block_size": None if self.block_size is None else list(self.block_size),
            "shard": self.shard, "offset": self.offset, "nbytes": self.nbytes, "checksum": self.checksum,
        }

    @classmethod
    def from_dict(cls, d: object) -> TensorEntry:
        """Strict inverse of :meth:`to_dict`: unknown or missing fields and bad types → ``ValueError``."""
        if not isinstance(d, dict):
            raise ValueError(f"tensor entry must be an object, got {type(d).__name__}")
        fields = {"name", "dtype", "shape", "block_size", "shard", "offset", "nbytes", "checksum"}
        if set(d) != fields:
            extra, missing = sorted(set(d) - fields), sorted(fields - set(d))
            raise ValueError(f"tensor entry {d.get('name')!r}: unknown fields {extra}, missing fields {missing}")
        shape, block = d["shape"], d["block_size"]
        if not isinstance(shape, list):
            raise ValueError(f"tensor entry {d['name']!r}: shape must be a list, got {shape!r}")
        if block is not None and not isinstance(block, list):
            raise ValueError(f"tensor entry {d['name']!r}: block_size must be a list or null, got {block!r}")
        return cls(
            name=d["name"], dtype=d["dtype"], shape=tuple(shape), block_size=None if block is None else tuple(block),
            shard=d["shard"], offset=d["offset"], nbytes=d["nbytes"], checksum=d["checksum"],
        )


def _raw_bytes(name: str, t: torch.Tensor) -> tuple[str, np.ndarray]:
    """(dtype string, uint8 numpy view of the tensor's little-endian bytes)."""
    dtype = _DTYPE_NAMES.get(t.dtype)
    if dtype is None:
        raise ValueError(f"tensor {name!r} has dtype {t.dtype}; refit shards support {', '.join(DTYPES)}")
    # reshape(-1) first: a dtype view of a 0-dim tensor with another element size is not allowed.
    raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return dtype, raw.numpy()


def pack_tensors(
    tensors: Mapping[str, torch.Tensor],
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    block_sizes: Mapping[str, tuple[int, int]] | None = None,
) -> tuple[list[TensorEntry], list[bytes]]:
    """Serialise ``tensors`` into shards of at most ``shard_bytes`` bytes.

    Args:
        tensors: name → tensor, any device; dtypes from :data:`DTYPES`. Order is kept.
        shard_bytes: most bytes per shard (default 64 MiB).
        block_sizes: name → FP8 block size for block-scaled weights and their scales.

    Returns:
        ``(entries, shards)``; there is always at least one shard (empty when nothing is packed).

    Raises:
        ValueError: an unsupported dtype (naming the tensor) or ``shard_bytes < 1``.
    """
    if sys.byteorder != "little":
        raise RuntimeError("refit shards are little-endian; this host is big-endian")
    if not _is_int(shard_bytes) or shard_bytes < 1:
        raise ValueError(f"shard_bytes must be an int >= 1, got {shard_bytes!r}")
    block_sizes = block_sizes or {}
    entries: list[TensorEntry] = []
    shards: list[bytes] = []
    cur = bytearray()
    for name, t in tensors.items():
        dtype, raw = _raw_bytes(name, t)
        n = raw.size
        if cur and len(cur) + n > shard_bytes:  # does not fit in what is left: start a fresh shard
            shards.append(bytes(cur))
            cur = bytearray()
        block = block_sizes.get(name)
        entries.append(TensorEntry(
            name=name, dtype=dtype, shape=tuple(t.shape), block_size=None if block is None else tuple(block),
            shard=len(shards), offset=len(cur), nbytes=n, checksum=checksum(raw),
        ))
        pos = 0
        while pos < n:  # only a tensor larger than shard_bytes loops more than once
            if len(cur) == shard_bytes:
                shards.append(bytes(cur))
                cur = bytearray()
            take = min(shard_bytes - len(cur), n - pos)
            cur += raw[pos:pos + take].data
            pos += take
    if cur or not shards:
        shards.append(bytes(cur))
    return entries, shards


def verify_shard(index: int, data: Any, size: int, expected_checksum: str) -> None:
    """Check one fetched shard's length and blake2b-128 checksum against the manifest.

    Raises:
        CorruptShardError: naming the shard (``tensor`` is None).
    """
    if len(data) != size:
        raise CorruptShardError(f"shard {index} is {len(data)} bytes, the manifest says {size}", shard=index)
    got = checksum(data)
    if got != expected_checksum:
        raise CorruptShardError(
            f"shard {index} failed its checksum: expected {expected_checksum}, got {got}", shard=index
        )


def unpack_tensors(
    entries: Sequence[TensorEntry], shards: Sequence[Any], shard_sizes: Sequence[int] | None = None
) -> dict[str, torch.Tensor]:
    """Rebuild the tensors from ``shards``, validating everything (see the module invariant).

    Args:
        entries: the tensor entries, in manifest order.
        shards: the shard bytes (``bytes``, ``bytearray`` or ``memoryview``), in order.
        shard_sizes: the announced size of each shard; the actual lengths when None.

    Returns:
        name → freshly allocated CPU tensor (FP8 tensors as ``float8_e4m3fn``).

    Raises:
        CorruptShardError: naming the tensor and shard on any mismatch.
    """
    sizes = [len(s) for s in shards] if shard_sizes is None else list(shard_sizes)
    if len(shards) != len(sizes):
        raise CorruptShardError(f"got {len(shards)} shards, the manifest lists {len(sizes)}")
    for i, (data, size) in enumerate(zip(shards, sizes, strict=True)):
        if len(data) != size:
            names = [e.name for e in entries if e.shard == i][:3]
            raise CorruptShardError(
                f"shard {i} is {len(data)} bytes, the manifest says {size} (holds {names})",
                tensor=names[0] if names else None, shard=i,
            )
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    total = starts[-1]

    out: dict[str, torch.Tensor] = {}
    end = 0  # where the previous entry stopped in the logical stream
    for e in entries:
        if e.name in out:
            raise CorruptShardError(f"tensor {e.name!r} appears twice in the manifest", tensor=e.name, shard=e.shard)
        if e.shard >= len(sizes) or e.offset > sizes[e.shard]:
            raise CorruptShardError(
                f"tensor {e.name!r} starts at shard {e.shard} offset {e.offset}, outside the {len(sizes)} shard(s)",
                tensor=e.name, shard=e.shard,
            )
        start = starts[e.shard] + e.offset
        # Shards carry no padding, so each tensor starts exactly where the previous one stopped.
        if start != end:
            raise CorruptShardError(
                f"tensor {e.name!r} at shard {e.shard} offset {e.offset} overlaps or leaves a gap after "
                f"the previous tensor", tensor=e.name, shard=e.shard,
            )
        if start + e.nbytes > total:
            raise CorruptShardError(
                f"tensor {e.name!r} ({e.nbytes} bytes from shard {e.shard} offset {e.offset}) runs past the "
                f"end of the shards ({total} bytes)", tensor=e.name, shard=e.shard,
            )
        buf = torch.empty(e.nbytes, dtype=torch.uint8)
        dst = buf.numpy()
        h = hashlib.blake2b(digest_size=16)
        pos, shard, lo = 0, e.shard, e.offset
        while pos < e.nbytes:
            take = min(sizes[shard] - lo, e.nbytes - pos)
            if take > 0:
                src = np.frombuffer(shards[shard], dtype=np.uint8, count=take, offset=lo)
                h.update(src)
                dst[pos:pos + take] = src
                pos += take
            shard, lo = shard + 1, 0
        last_shard = shard - 1 if e.nbytes else e.shard
        if h.hexdigest() != e.checksum:
            span = f"shard {e.shard}" if last_shard == e.shard else f"shards {e.shard}-{last_shard}"
            raise CorruptShardError(
                f"tensor {e.name!r} in {span} failed its checksum: expected {e.checksum}, got {h.hexdigest()}",
                tensor=e.name, shard=e.shard,
            )
        out[e.name] = buf.view(DTYPES[e.dtype]).reshape(e.shape)
        end = start + e.nbytes
    if end != total:
        raise CorruptShardError(f"{total - end} trailing bytes after the last tensor belong to no tensor")
    return out

