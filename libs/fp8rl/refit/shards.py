"""Raw-byte weight shards: a ``dict[str, Tensor]`` ⇄ a list of byte strings plus typed entries.

Wire format (version 2). All tensors' bytes, C-contiguous and little-endian, are laid out in one
logical byte stream in entry order, each starting at a multiple of :data:`ALIGN` (64) bytes within
its shard (the gap, < 64 bytes, is zeros), so a tensor can be used in place as a view of the shard
buffer with its natural alignment. The stream is cut into shards of at most ``shard_bytes``. A
tensor that does not fit in the room left in the current shard starts a new one; only a tensor
larger than ``shard_bytes`` spans several (it fills whole shards and continues at offset 0 of the
next). Each tensor is described by a :class:`TensorEntry` (name, dtype string, shape, block size,
shard index and offset where it starts, byte length, checksum); the entries travel in the
manifest, never inside the shards, so a shard is nothing but bytes. FP8 tensors travel as their
uint8 view. No pickles anywhere. Checksums are XXH3-128 (:func:`checksum`, ≈ 8 GB/s on one core
here against 0.7 for blake2b): they guard against corruption and truncation, not against an
attacker — the channel's token and TLS do that.

Invariant: :func:`unpack_tensors` returns tensors only when every shard has the announced size,
the entries follow the layout exactly (each starts at the first aligned offset after the previous
one, no overlap, nothing left over), every dtype is one of :data:`DTYPES`, every byte length
equals ``numel × itemsize`` and every tensor's checksum matches; otherwise it raises
:class:`CorruptShardError` naming the tensor and the shard. The tensors it returns are views of
the shard buffers where a tensor lies in one writable shard (no copy); they are valid while the
buffers are, so a refit target copies them into its own parameters.

The other refit payload, a QKV scale set, has its own format in :mod:`.scales` (re-exported here).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from .scales import decode_scales, encode_scales

__all__ = [
    "ALIGN",
    "DTYPES",
    "DEFAULT_SHARD_BYTES",
    "CorruptShardError",
    "TensorEntry",
    "checksum",
    "pack_tensors",
    "plan_layout",
    "ShardWriter",
    "unpack_tensors",
    "verify_shard",
    "encode_scales",
    "decode_scales",
]

DEFAULT_SHARD_BYTES = 64 * 1024 * 1024
ALIGN = 64  # every tensor starts at a multiple of this within its shard (a cache line; >= every itemsize)

DTYPES: dict[str, torch.dtype] = {
    "float8_e4m3fn": torch.float8_e4m3fn,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "int64": torch.int64,
    "int32": torch.int32,  # the indices of a sparse delta (fp8rl.refit.delta)
    "uint8": torch.uint8,  # MXFP8's E8M0 scales (biased power-of-two exponents)
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}  # torch dtype -> its name in a manifest
_CHECKSUM_HEX = 32  # XXH3 with a 128-bit digest


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
    """XXH3-128 hex digest (32 characters) of a bytes-like object: the checksum of tensors and shards."""
    return xxhash.xxh3_128_hexdigest(data)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


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
        checksum: XXH3-128 hex of its bytes.
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
    dtype = DTYPE_NAMES.get(t.dtype)
    if dtype is None:
        raise ValueError(f"tensor {name!r} has dtype {t.dtype}; refit shards support {', '.join(DTYPES)}")
    # reshape(-1) first: a dtype view of a 0-dim tensor with another element size is not allowed.
    raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return dtype, raw.numpy()


_PENDING = "0" * _CHECKSUM_HEX  # the checksum of a planned entry, until its bytes are written


def plan_layout(
    specs: Sequence[tuple[str, str, tuple[int, ...], tuple[int, int] | None]], shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> tuple[list[TensorEntry], list[int]]:
    """Place tensors in shards before any byte exists (the layout of the module docstring).

    Args:
        specs: ``(name, dtype string, shape, block size)`` per tensor, in stream order.
        shard_bytes: most bytes per shard.

    Returns:
        ``(entries, shard sizes)``; each entry's checksum is a placeholder until :class:`ShardWriter`
        writes its bytes.
    """
    if sys.byteorder != "little":
        raise RuntimeError("refit shards are little-endian; this host is big-endian")
    if not _is_int(shard_bytes) or shard_bytes < 1:
        raise ValueError(f"shard_bytes must be an int >= 1, got {shard_bytes!r}")
    entries: list[TensorEntry] = []
    sizes: list[int] = [0]  # bytes used so far in each shard
    for name, dtype, shape, block in specs:
        if dtype not in DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {dtype}; refit shards support {', '.join(DTYPES)}")
        n = math.prod(shape) * DTYPES[dtype].itemsize
        offset = _align(sizes[-1])
        if sizes[-1] and offset + n > shard_bytes:  # does not fit in what is left: start a fresh shard
            sizes.append(0)
            offset = 0
        entries.append(TensorEntry(name=name, dtype=dtype, shape=tuple(shape), block_size=block,
                                   shard=len(sizes) - 1, offset=offset, nbytes=n, checksum=_PENDING))
        end = offset + n
        while end > shard_bytes:  # only a tensor larger than the room in a fresh shard spans more than one
            sizes[-1] = shard_bytes
            sizes.append(0)
            end -= shard_bytes
        sizes[-1] = end
    return entries, sizes


class ShardWriter:
    """Writes planned tensors into shard buffers allocated once at their final size.

    ``view(i)`` is entry i's typed, writable place in its shard (None when it spans shards), so a
    producer can write a tensor straight into the shard (the FP8 quantizer does); ``write(i, t)``
    copies a tensor in; ``finish()`` checksums every tensor and shard.
    """

    def __init__(self, entries: list[TensorEntry], sizes: list[int],
                 alloc: Callable[[int, int, Sequence[TensorEntry]], Any] | None = None) -> None:
        self.entries = entries
        self.shards = [bytearray(size) if alloc is None else alloc(i, size, entries) for i, size in enumerate(sizes)]
        for i, (b, size) in enumerate(zip(self.shards, sizes, strict=True)):
            if len(b) != size or memoryview(b).readonly:
                raise ValueError(f"alloc gave shard {i} a {'read-only ' if memoryview(b).readonly else ''}buffer of "
                                 f"{len(b)} bytes; it needs {size} writable bytes")
        self._np = [np.frombuffer(b, dtype=np.uint8) for b in self.shards]
        self._sums: dict[int, str] = {}
        end = (0, 0)  # (shard, offset) where the previous tensor stopped
        for e in entries:  # zero the alignment gaps: a recycled buffer holds an older version's bytes
            if e.shard == end[0] and e.offset > end[1]:
                self._np[e.shard][end[1]:e.offset] = 0
            stop, shard = e.offset + e.nbytes, e.shard
            while stop > len(self.shards[shard]):  # spans into later shards
                stop -= len(self.shards[shard])
                shard += 1
            end = (shard, stop)

    def _in_one(self, e: TensorEntry) -> bool:
        return e.offset + e.nbytes <= len(self.shards[e.shard])

    def view(self, i: int) -> torch.Tensor | None:
        e = self.entries[i]
        if not self._in_one(e):
            return None
        raw = torch.from_numpy(self._np[e.shard][e.offset:e.offset + e.nbytes])
        return raw.view(DTYPES[e.dtype]).reshape(e.shape)

    def write(self, i: int, t: torch.Tensor) -> None:
        e = self.entries[i]
        dtype, raw = _raw_bytes(e.name, t)
        if (dtype, tuple(t.shape)) != (e.dtype, e.shape):
            raise ValueError(f"tensor {e.name!r} is {dtype}{list(t.shape)}, planned as {e.dtype}{list(e.shape)}")
        pos, shard, lo = 0, e.shard, e.offset
        while pos < e.nbytes:
            take = min(len(self.shards[shard]) - lo, e.nbytes - pos)
            self._np[shard][lo:lo + take] = raw[pos:pos + take]
            pos += take
            shard, lo = shard + 1, 0
        if not self._in_one(e):
            self._sums[i] = checksum(raw)

    def finish(self) -> tuple[list[TensorEntry], list[Any]]:
        """``(entries with their checksums, shards)``."""
        out = []
        for i, e in enumerate(self.entries):
            c = self._sums.get(i) or checksum(self._np[e.shard][e.offset:e.offset + e.nbytes])
            out.append(dataclasses.replace(e, checksum=c))
        return out, self.shards


def pack_tensors(
    tensors: Mapping[str, torch.Tensor],
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    block_sizes: Mapping[str, tuple[int, int]] | None = None,
    alloc: Callable[[int, int, Sequence[TensorEntry]], Any] | None = None,
) -> tuple[list[TensorEntry], list[Any]]:
    """Serialise ``tensors`` into shards of at most ``shard_bytes`` bytes (the layout of the module docstring).

    The layout is planned first (:func:`plan_layout`); then each shard is allocated once at its final
    size and each tensor's bytes are copied into it once (:class:`ShardWriter`).

    Args:
        tensors: name → tensor, any device; dtypes from :data:`DTYPES`. Order is kept.
        shard_bytes: most bytes per shard (default 64 MiB).
        block_sizes: name → FP8 block size for block-scaled weights and their scales.
        alloc: ``alloc(index, size, entries)`` returns a writable buffer of ``size`` bytes for shard
            ``index`` (``entries``: the whole layout; any contents: every byte is written, gaps zeroed);
            default ``bytearray(size)``. The shared-memory transport allocates the shards inside its
            files this way, reusing an evicted version's files.

    Returns:
        ``(entries, shards)``; there is always at least one shard (empty when nothing is packed).
        Shards are writable buffers, so :func:`unpack_tensors` can view them in place.

    Raises:
        ValueError: an unsupported dtype (naming the tensor) or ``shard_bytes < 1``.
    """
    block_sizes = block_sizes or {}
    specs = []
    for name, t in tensors.items():
        dtype = DTYPE_NAMES.get(t.dtype)
        if dtype is None:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}; refit shards support {', '.join(DTYPES)}")
        block = block_sizes.get(name)
        specs.append((name, dtype, tuple(t.shape), None if block is None else tuple(block)))
    entries, sizes = plan_layout(specs, shard_bytes)
    writer = ShardWriter(entries, sizes, alloc)
    for i, t in enumerate(tensors.values()):
        writer.write(i, t)
    return writer.finish()


def verify_shard(index: int, data: Any, size: int, expected_checksum: str) -> None:
    """Check one fetched shard's length and XXH3-128 checksum against the manifest.

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


def _writable(data: Any) -> bool:
    return not memoryview(data).readonly


def unpack_tensors(
    entries: Sequence[TensorEntry], shards: Sequence[Any], shard_sizes: Sequence[int] | None = None
) -> dict[str, torch.Tensor]:
    """Rebuild the tensors from ``shards``, validating everything (see the module invariant).

    Args:
        entries: the tensor entries, in manifest order.
        shards: the shard bytes (any bytes-like object: ``bytearray``, ``memoryview``, an ``mmap``), in order.
        shard_sizes: the announced size of each shard; the actual lengths when None.

    Returns:
        name → CPU tensor (FP8 tensors as ``float8_e4m3fn``): a view of its shard when the tensor lies
        in one writable shard, else a fresh copy (a tensor spanning shards, a read-only buffer).

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
    writable = [_writable(s) for s in shards]

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
        # Each tensor starts at the first aligned offset after the previous one (or at 0 of the next shard).
        if e.offset % ALIGN or not 0 <= start - end < ALIGN:
            raise CorruptShardError(
                f"tensor {e.name!r} at shard {e.shard} offset {e.offset} overlaps, is misaligned or leaves a gap "
                f"after the previous tensor", tensor=e.name, shard=e.shard,
            )
        if start + e.nbytes > total:
            raise CorruptShardError(
                f"tensor {e.name!r} ({e.nbytes} bytes from shard {e.shard} offset {e.offset}) runs past the "
                f"end of the shards ({total} bytes)", tensor=e.name, shard=e.shard,
            )
        in_one = e.offset + e.nbytes <= sizes[e.shard]
        if in_one:
            src = np.frombuffer(shards[e.shard], dtype=np.uint8, count=e.nbytes, offset=e.offset)
            got = checksum(src)
            last_shard = e.shard
            buf = torch.from_numpy(src) if writable[e.shard] else torch.from_numpy(src.copy())
        else:
            buf = torch.empty(e.nbytes, dtype=torch.uint8)
            dst = buf.numpy()
            h = xxhash.xxh3_128()
            pos, shard, lo = 0, e.shard, e.offset
            while pos < e.nbytes:
                take = min(sizes[shard] - lo, e.nbytes - pos)
                if take > 0:
                    piece = np.frombuffer(shards[shard], dtype=np.uint8, count=take, offset=lo)
                    h.update(piece)
                    dst[pos:pos + take] = piece
                    pos += take
                shard, lo = shard + 1, 0
            got, last_shard = h.hexdigest(), shard - 1
        if got != e.checksum:
            span = f"shard {e.shard}" if last_shard == e.shard else f"shards {e.shard}-{last_shard}"
            raise CorruptShardError(
                f"tensor {e.name!r} in {span} failed its checksum: expected {e.checksum}, got {got}",
                tensor=e.name, shard=e.shard,
            )
        out[e.name] = buf.view(DTYPES[e.dtype]).reshape(e.shape)
        end = start + e.nbytes
    if end != total:
        raise CorruptShardError(f"{total - end} trailing bytes after the last tensor belong to no tensor")
    return out
