"""FP8 delta refit: version v shipped as the elements that changed since a base version.

Measured on the default job (``bench/fp8_delta.py``): one optimizer step changes *every* 128×128
block of every FP8 linear (Adam moves each weight by ≈ lr, so some element of each 16 384-element
block crosses an E4M3 rounding boundary), but only a share of the elements — 0.20% of the E4M3 bytes
at the seed's lr 3e-7. So a delta here is element-sparse, over the payload exactly as it travels
(E4M3 bytes, FP32 block scales, BF16 tensors, the whole wire form of the full version):

* a tensor whose checksum equals the base's is **unchanged** and not shipped;
* a changed tensor is shipped as ``<name>@idx`` (int32, or int64 past 2³¹ elements: the flat
  indices of the elements whose bytes differ) and ``<name>@val`` (those elements, in the tensor's
  dtype) when that is smaller than the tensor, else **whole** under its own name.

A delta manifest is an ordinary :class:`~fp8rl.refit.Manifest` with ``base`` set, stored at
``weights:{v}:delta`` next to the full manifest (the full version is always published too).

Invariant: :func:`apply_delta` returns the tensors of version v only when every tensor's bytes match
the **full** manifest's checksum of v; anything else (another base, a missing or extra tensor, a
wrong index) raises :class:`~fp8rl.refit.CorruptShardError`, and the subscriber pulls the full version.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .manifest import Manifest
from .shards import DEFAULT_SHARD_BYTES, CorruptShardError, checksum, pack_tensors

__all__ = ["IDX", "VAL", "build_delta", "apply_delta", "delta_stats", "owned"]

IDX, VAL = "@idx", "@val"  # suffixes of a sparse tensor's two parts; HF names never hold '@'
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _flat_ints(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as same-width integers, flat (bitwise comparison and scatter)."""
    return t.reshape(-1).view(_INT_VIEW[t.element_size()])


def build_delta(
    base: Manifest, base_tensors: Mapping[str, torch.Tensor], new: Manifest, new_tensors: Mapping[str, torch.Tensor],
    *, shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> tuple[Manifest, list[Any]] | None:
    """The delta manifest and shards that turn ``base`` into ``new``; None when the layouts differ
    (another tensor set, dtype or shape: only a full refit can express that).

    ``base_tensors`` / ``new_tensors`` are the wire-form tensors of the two versions (as
    :func:`~fp8rl.refit.shards.unpack_tensors` rebuilds them).
    """
    if base.version >= new.version:
        raise ValueError(f"a delta goes from an older version to a newer one, got {base.version} -> {new.version}")
    old = {e.name: e for e in base.tensors}
    if set(old) != {e.name for e in new.tensors}:
        return None
    parts: dict[str, torch.Tensor] = {}
    for e in new.tensors:
        b = old[e.name]
        if (b.dtype, b.shape) != (e.dtype, e.shape):
            return None
        if b.checksum == e.checksum:
            continue
        t = new_tensors[e.name]
        flat_new, flat_old = _flat_ints(t), _flat_ints(base_tensors[e.name])
        idx = (flat_new != flat_old).nonzero().squeeze(1)
        idx = idx.to(torch.int32) if t.numel() < 2**31 else idx
        if idx.numel() * (idx.element_size() + t.element_size()) < e.nbytes:
            parts[e.name + IDX] = idx
            parts[e.name + VAL] = t.reshape(-1)[idx.long()]
        else:
            parts[e.name] = t
    entries, shards = pack_tensors(parts, shard_bytes=shard_bytes)
    manifest = Manifest(
        version=new.version, job=new.job, recipe=new.recipe, tensors=tuple(entries),
        shard_sizes=tuple(len(s) for s in shards), shard_checksums=tuple(checksum(s) for s in shards),
        endpoint=new.endpoint, created=new.created, total_bytes=sum(len(s) for s in shards), base=base.version,
    )
    return manifest, shards


def apply_delta(
    full: Manifest, delta: Manifest, base: Manifest, base_tensors: Mapping[str, torch.Tensor],
    parts: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Version ``full.version``'s tensors from the base's and the delta's ``parts``, each verified
    against ``full``'s checksum. Unchanged tensors are the base's own objects; changed ones are new.

    Raises:
        CorruptShardError: the delta does not fit (named), or a rebuilt tensor fails its checksum.
    """
    if delta.base != base.version or delta.version != full.version:
        raise CorruptShardError(f"delta {delta.base} -> {delta.version} does not turn the held version {base.version} "
                                f"into {full.version}")
    old = {e.name: e for e in base.tensors}
    used: set[str] = set()
    out: dict[str, torch.Tensor] = {}
    for e in full.tensors:
        b = old.get(e.name)
        if b is None or (b.dtype, b.shape) != (e.dtype, e.shape):
            raise CorruptShardError(f"tensor {e.name!r} of version {full.version} has no like tensor in base "
                                    f"{base.version}", tensor=e.name)
        if e.name in parts:
            t = parts[e.name].clone()
            used.add(e.name)
        elif e.name + IDX in parts and e.name + VAL in parts:
            idx, val = parts[e.name + IDX], parts[e.name + VAL]
            t = base_tensors[e.name].clone()
            flat = _flat_ints(t)
            if idx.dim() != 1 or val.dim() != 1 or idx.numel() != val.numel() or val.dtype != t.dtype or (
                    idx.numel() and not 0 <= int(idx.min()) <= int(idx.max()) < flat.numel()):
                raise CorruptShardError(f"sparse delta of {e.name!r} does not fit a {e.dtype}{list(e.shape)} "
                                        f"tensor", tensor=e.name)
            flat[idx.long()] = _flat_ints(val)
            used.update((e.name + IDX, e.name + VAL))
        elif b.checksum == e.checksum:
            out[e.name] = base_tensors[e.name]
            continue
        else:
            raise CorruptShardError(f"tensor {e.name!r} changed from version {base.version} to {full.version} but "
                                    f"the delta does not carry it", tensor=e.name)
        got = checksum(t.reshape(-1).view(torch.uint8).numpy())
        if got != e.checksum:
            raise CorruptShardError(f"tensor {e.name!r} rebuilt from the delta of version {full.version} failed its "
                                    f"checksum: expected {e.checksum}, got {got}", tensor=e.name)
        out[e.name] = t
    extra = sorted(set(parts) - used)
    if extra:
        raise CorruptShardError(f"delta of version {full.version} carries tensors the version does not hold: "
                                f"{extra[:3]}", tensor=extra[0])
    return out


def delta_stats(full: Manifest, delta: Manifest) -> dict[str, float]:
    """What the delta ships against the full version: bytes and tensors whole / sparse / unchanged."""
    names = {e.name for e in delta.tensors}
    whole = sum(1 for e in full.tensors if e.name in names)
    sparse = sum(1 for e in full.tensors if e.name + IDX in names)
    return {"delta_bytes": delta.total_bytes, "full_bytes": full.total_bytes,
            "ratio": delta.total_bytes / max(1, full.total_bytes), "tensors_whole": whole, "tensors_sparse": sparse,
            "tensors_unchanged": len(full.tensors) - whole - sparse}


def owned(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of ``tensors`` that outlive the transport buffers they may view (a delta base)."""
    return {k: t.clone() for k, t in tensors.items()}
