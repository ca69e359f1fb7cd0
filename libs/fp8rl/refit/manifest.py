"""The refit manifest of one policy version, and the two verbs around it: build shards, assemble them.

A :class:`Manifest` is the authoritative description of version v's payload: every tensor's
name, dtype, shape, block size, byte length and checksum, which shard holds it, each shard's size
and checksum, the endpoint of the WeightStore that serves the shards, and the recipe. It is stored
in Redis as strict JSON (``weights:{v}:manifest``); the shard bytes travel separately.

In an FP8 recipe the trainer ships the linears named by ``fp8_prefixes`` as E4M3 bytes plus FP32
128×128 block scales (``x ≈ q.float() * weight_scale``, made by :func:`fp8rl.fp8.quantize_state_dict`,
≈ 0.5 of the BF16 bytes); everything else passes through in its own dtype (BF16 stays BF16, FP32
stays FP32). Why quantize on the sender rather than ship BF16 and let each replica quantize, as
NeMo RL does: it halves the bytes moved per refit, and the quantizer is the same function on both
sides, so trainer and rollout still agree bit for bit on the E4M3 weights.

Invariants: :func:`build_shards` refuses a state dict holding NaN/Inf before anything is
produced (so nothing is ever published from a diverged step); :func:`assemble` returns tensors only
when every shard and every tensor matched its checksum.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fp8rl.fp8 import linear_format
from fp8rl.fp8.payload import is_adapter
from fp8rl.fp8.quant import E4M3, all_finite

from .keys import validate_job_id, validate_version
from .shards import (
    DEFAULT_SHARD_BYTES,
    DTYPE_NAMES,
    CorruptShardError,
    ShardWriter,
    TensorEntry,
    checksum,
    plan_layout,
    unpack_tensors,
    verify_shard,
)

__all__ = ["MANIFEST_FORMAT", "Manifest", "build_shards", "assemble", "frozen_checksum"]

# 2: 64-byte aligned shard layout, XXH3-128 checksums, shm / collective / base fields; 3: adapters_on (LoRA)
MANIFEST_FORMAT = 3
_HEX32 = re.compile(r"[0-9a-f]{32}")
_FIELDS = {
    "format", "version", "job", "recipe", "tensors", "shard_sizes", "shard_checksums", "endpoint", "created",
    "total_bytes", "shm", "collective", "base", "adapters_on",
}


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_endpoint(endpoint: object) -> None:
    if not isinstance(endpoint, str):
        raise ValueError(f"manifest endpoint must be a string 'host:port', got {endpoint!r}")
    if endpoint == "":  # an in-process source needs no endpoint
        return
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"manifest endpoint must look like 'host:port' (port 1-65535), got {endpoint!r}")


@dataclass(frozen=True)
class Manifest:
    """Everything a replica needs to fetch, verify and load one weight version.

    Attributes:
        version: the weight version (>= 0).
        job: the job id.
        recipe: the job's recipe name (``bf16``, ``fp8_gen_only``, ``fp8_e2e``, ...).
        tensors: one :class:`TensorEntry` per tensor, in stream order (lists are stored as tuples).
        shard_sizes: byte length of each shard.
        shard_checksums: XXH3-128 hex of each shard.
        endpoint: ``host:port`` of the WeightStore serving the shards over gRPC ("" for an in-process source).
        created: publish time, seconds since the epoch.
        total_bytes: ``sum(shard_sizes)``.
        shm: where the same shards lie in shared memory on the trainer's host, ``{"dir": path,
            "host": boot id}``, or None (:mod:`fp8rl.refit.transport.shm`).
        collective: ``host:port`` of the store of the trainer's broadcast group, or "" when the
            trainer broadcasts nothing (:mod:`fp8rl.refit.transport.collective`).
        base: None for a full version; for a delta manifest (``weights:{v}:delta``), the version
            its entries patch (:mod:`fp8rl.refit.delta`).
        adapters_on: None for a version that holds every tensor; for a LoRA job's version after its base, the
            version holds the adapters alone and this names the frozen base they apply to: ``{"version": b,
            "checksum": frozen_checksum(manifest of b)}`` (a replica holding another base, or none, pulls ``b``
            first).
    """

    version: int
    job: str
    recipe: str
    tensors: tuple[TensorEntry, ...]
    shard_sizes: tuple[int, ...]
    shard_checksums: tuple[str, ...]
    endpoint: str
    created: float
    total_bytes: int
    shm: dict[str, str] | None = None
    collective: str = ""
    base: int | None = None
    adapters_on: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for key in ("tensors", "shard_sizes", "shard_checksums"):
            val = getattr(self, key)
            if not isinstance(val, list | tuple):
                raise ValueError(f"manifest {key} must be a list, got {type(val).__name__}")
            object.__setattr__(self, key, tuple(val))
        validate_version(self.version)
        validate_job_id(self.job)
        if not isinstance(self.recipe, str) or not self.recipe:
            raise ValueError(f"manifest recipe must be a non-empty string, got {self.recipe!r}")
        _check_endpoint(self.endpoint)
        if self.collective:
            _check_endpoint(self.collective)
        if self.shm is not None and not (
            isinstance(self.shm, dict) and set(self.shm) == {"dir", "host"}
            and all(isinstance(v, str) and v for v in self.shm.values()) and self.shm["dir"].startswith("/")
        ):
            raise ValueError(f"manifest shm must be null or {{'dir': absolute path, 'host': id}}, got {self.shm!r}")
        if self.base is not None:
            validate_version(self.base)
            if self.base >= self.version:
                raise ValueError(f"a delta manifest of version {self.version} must patch an older version, "
                                 f"got base {self.base}")
        if self.adapters_on is not None:
            a = self.adapters_on
            if not (isinstance(a, dict) and set(a) == {"version", "checksum"} and _is_int(a["version"])
                    and isinstance(a["checksum"], str) and _HEX32.fullmatch(a["checksum"])):
                raise ValueError(f"manifest adapters_on must be null or {{'version': int, 'checksum': 32 hex}}, got "
                                 f"{a!r:.200}")
            validate_version(a["version"])
            if a["version"] >= self.version:
                raise ValueError(f"version {self.version}'s adapters must apply to an older base, got "
                                 f"{a['version']}")
        if not (_is_int(self.created) or isinstance(self.created, float)) or not math.isfinite(self.created):
            raise ValueError(f"manifest created must be a finite number of seconds, got {self.created!r}")
        if not self.shard_sizes:
            raise ValueError("manifest lists no shards")
        if not all(_is_int(s) and s >= 0 for s in self.shard_sizes):
            raise ValueError(f"manifest shard_sizes must be ints >= 0, got {list(self.shard_sizes)}")
        if len(self.shard_checksums) != len(self.shard_sizes):
            raise ValueError(
                f"manifest has {len(self.shard_sizes)} shard sizes but {len(self.shard_checksums)} shard checksums"
            )
        for i, c in enumerate(self.shard_checksums):
            if not isinstance(c, str) or not _HEX32.fullmatch(c):
                raise ValueError(f"manifest checksum of shard {i} must be 32 lowercase hex characters, got {c!r}")
        if not _is_int(self.total_bytes) or self.total_bytes != sum(self.shard_sizes):
            raise ValueError(f"manifest total_bytes {self.total_bytes!r} != sum of shard sizes {sum(self.shard_sizes)}")
        seen: set[str] = set()
        for e in self.tensors:
            if not isinstance(e, TensorEntry):
                raise ValueError(f"manifest tensors must be TensorEntry objects, got {type(e).__name__}")
            if e.name in seen:
                raise ValueError(f"manifest lists tensor {e.name!r} twice")
            if e.shard >= len(self.shard_sizes):
                raise ValueError(f"tensor {e.name!r} is in shard {e.shard}, but there are {len(self.shard_sizes)}")
            seen.add(e.name)

    @property
    def num_shards(self) -> int:
        return len(self.shard_sizes)

    def entry(self, name: str) -> TensorEntry:
        """The entry of tensor ``name`` (``KeyError`` naming it when absent)."""
        for e in self.tensors:
            if e.name == name:
                return e
        raise KeyError(f"tensor {name!r} is not in the manifest of version {self.version}")

    def to_json_bytes(self) -> bytes:
        """Compact, key-sorted UTF-8 JSON (what Redis stores)."""
        d = {
            "format": MANIFEST_FORMAT, "version": self.version, "job": self.job, "recipe": self.recipe,
            "tensors": [e.to_dict() for e in self.tensors], "shard_sizes": list(self.shard_sizes),
            "shard_checksums": list(self.shard_checksums), "endpoint": self.endpoint, "created": self.created,
            "total_bytes": self.total_bytes, "shm": self.shm, "collective": self.collective, "base": self.base,
            "adapters_on": self.adapters_on,
        }
        return json.dumps(d, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_json_bytes(cls, data: bytes | str) -> Manifest:
        """Strict parse: malformed JSON, unknown or missing fields, bad types or values → ``ValueError``."""
        try:
            d = json.loads(data)
        except (ValueError, TypeError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ValueError(f"manifest is not valid JSON: {exc}") from exc
        if not isinstance(d, dict):
            raise ValueError(f"manifest must be a JSON object, got {type(d).__name__}")
        if set(d) != _FIELDS:
            raise ValueError(
                f"manifest has unknown fields {sorted(set(d) - _FIELDS)} and missing fields {sorted(_FIELDS - set(d))}"
            )
        if d["format"] != MANIFEST_FORMAT or not _is_int(d["format"]):
            raise ValueError(f"manifest format {d['format']!r} is not supported (expected {MANIFEST_FORMAT})")
        if not isinstance(d["tensors"], list):
            raise ValueError(f"manifest tensors must be a list, got {type(d['tensors']).__name__}")
        return cls(
            version=d["version"], job=d["job"], recipe=d["recipe"],
            tensors=tuple(TensorEntry.from_dict(e) for e in d["tensors"]),
            shard_sizes=d["shard_sizes"], shard_checksums=d["shard_checksums"], endpoint=d["endpoint"],
            created=d["created"], total_bytes=d["total_bytes"], shm=d["shm"], collective=d["collective"],
            base=d["base"], adapters_on=d["adapters_on"],
        )


def _scale_of(weight_name: str) -> str:
    return weight_name.removesuffix(".weight") + ".weight_scale"


def frozen_checksum(manifest: Manifest) -> str:
    """The identity of a LoRA job's frozen base as a version ships it: XXH3-128 over the name and checksum of every
    tensor of ``manifest`` that is not an adapter (:func:`fp8rl.model.lora.is_adapter`), in name order. Versions
    that ship the same base bytes have the same one."""
    parts = sorted(f"{e.name}={e.checksum}" for e in manifest.tensors if not is_adapter(e.name))
    return checksum("\n".join(parts).encode())


def _check_finite_all(state_dict: Mapping[str, torch.Tensor], version: int, skip: set[str]) -> None:
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"state dict entry {name!r} is a {type(t).__name__}, not a tensor")
        if name in skip or all_finite(t):  # FP8 weights are checked by the quantizer itself
            continue
        bad = int((~torch.isfinite(t.detach().float())).sum())
        raise ValueError(
            f"refusing to publish weight version {version}: tensor {name!r} holds {bad} NaN/Inf value(s) "
            f"out of {t.numel()}, shape {tuple(t.shape)}"
        )


def build_shards(
    state_dict: Mapping[str, torch.Tensor],
    version: int,
    *,
    job: str,
    recipe: str,
    endpoint: str,
    fp8_prefixes: Iterable[str] = (),
    pow2_scale: bool = False,
    scaling: str = "blockwise",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    alloc: Callable[[int, int, Sequence[TensorEntry]], Any] | None = None,
) -> tuple[Manifest, list[Any]]:
    """Quantize and serialise one policy version into shards plus its manifest.

    Args:
        state_dict: master weights under Hugging Face names (any float dtype; int64 buffers allowed).
        version: the weight version being published.
        job: job id.
        recipe: recipe name recorded in the manifest.
        endpoint: ``host:port`` of the WeightStore that will serve the shards ("" for in-process).
        fp8_prefixes: linears to ship in FP8 (``model.layers.3.self_attn.q_proj``), e.g. from
            :func:`fp8rl.fp8.fp8_linear_names`; each ``{p}.weight`` becomes E4M3 and gains
            ``{p}.weight_scale`` (``scaling``'s forward form: FP32 per 128×128 block, uint8 E8M0 per 1×32 along
            the input dimension, or one FP32), placed right after it. A ``{p}.weight`` that is already E4M3 (a
            frozen LoRA base the trainer holds in FP8 only) ships as it is, with the ``{p}.weight_scale`` beside it
            in ``state_dict``.
        pow2_scale: round FP32 scales up to powers of two.
        scaling: the FP8 format (:mod:`fp8rl.fp8.formats`; the job's ``fp8_recipe``).
        shard_bytes: most bytes per shard.
        alloc: where shard buffers come from (see :func:`~fp8rl.refit.shards.pack_tensors`).

    Returns:
        ``(manifest, shards)``.

    Raises:
        ValueError: a tensor holds NaN/Inf (named), an FP8 prefix has no 2-D ``.weight``, or a
            dtype is unsupported.
    """
    validate_version(version)
    validate_job_id(job)
    prefixes = list(dict.fromkeys(fp8_prefixes))
    for p in prefixes:
        w = state_dict.get(f"{p}.weight")
        if w is None or w.dim() != 2:
            got = "missing" if w is None else f"shape {tuple(w.shape)}"
            raise ValueError(f"FP8 prefix {p!r} needs a 2-D tensor {p}.weight in the state dict ({got})")
    fp8_weights = {f"{p}.weight" for p in prefixes}
    fmt = linear_format(scaling)
    scale_dtype = "uint8" if fmt.scale_dtype == torch.uint8 else "float32"
    # weights already in their FP8 form: E4M3 + the format's scale, copied in as they are
    held = {n: _scale_of(n) for n in fp8_weights if state_dict[n].dtype == E4M3}
    for name, sname in held.items():
        s = state_dict.get(sname)
        want = fmt.scale_shape(*state_dict[name].shape)
        if s is None or tuple(s.shape) != tuple(want) or s.dtype != fmt.scale_dtype:
            got = "missing" if s is None else f"{s.dtype} {tuple(s.shape)}"
            raise ValueError(f"{name} is E4M3: it needs {sname} as {fmt.scale_dtype} {tuple(want)} ({fmt.name}), "
                             f"got {got}")
    held_scales = set(held.values())
    _check_finite_all(state_dict, version, fp8_weights | held_scales)
    # Plan the layout from shapes alone, then quantize each FP8 weight once, straight into its place in
    # the shards (no E4M3 temporary, no second copy); every other tensor is copied in once.
    specs, order = [], []
    for name, t in state_dict.items():
        if name in held_scales:  # placed beside its weight
            continue
        if name in fp8_weights:  # keep each scale beside its weight (same shard in the common case)
            grid, block = fmt.scale_shape(*t.shape), fmt.block_size(*t.shape)
            specs += [(name, "float8_e4m3fn", tuple(t.shape), block),
                      (_scale_of(name), scale_dtype, grid, block)]
            order += [name, None]
        else:
            specs.append((name, DTYPE_NAMES.get(t.dtype, str(t.dtype)), tuple(t.shape), None))
            order.append(name)
    entries, sizes = plan_layout(specs, shard_bytes)
    writer = ShardWriter(entries, sizes, alloc)
    for i, name in enumerate(order):
        if name is None:  # a scale, written with its weight
            continue
        t = state_dict[name]
        if name not in fp8_weights:
            writer.write(i, t)
            continue
        if name in held:
            writer.write(i, t)
            writer.write(i + 1, state_dict[held[name]])
            continue
        qv, sv = writer.view(i), writer.view(i + 1)
        try:
            q, s = fmt.quantize_weight(t, pow2=pow2_scale, name=name,
                                       out=None if qv is None or sv is None else (qv, sv))
        except ValueError as exc:  # NaN/Inf in an FP8 weight, named by the quantizer
            raise ValueError(f"refusing to publish weight version {version}: {exc}") from exc
        if qv is None or sv is None:  # spans shards: quantized aside, then copied in
            writer.write(i, q)
            writer.write(i + 1, s)
    entries, shards = writer.finish()
    manifest = Manifest(
        version=version, job=job, recipe=recipe, tensors=tuple(entries), shard_sizes=tuple(len(s) for s in shards),
        shard_checksums=tuple(checksum(s) for s in shards), endpoint=endpoint, created=time.time(),
        total_bytes=sum(len(s) for s in shards),
    )
    return manifest, shards


def assemble(manifest: Manifest, shards: Sequence[Any], *, shards_verified: bool = False) -> dict[str, torch.Tensor]:
    """Rebuild version ``manifest.version``'s tensors, verifying every tensor and shard checksum.

    The tensors are views of the shard buffers where they can be (see
    :func:`~fp8rl.refit.shards.unpack_tensors`): keep the buffers alive while using them, copy them
    into the engine's own parameters.

    Args:
        shards_verified: the caller already checked every shard's checksum (the subscriber does, per
            shard, to re-fetch only a bad one); the tensor checksums are checked regardless.

    Raises:
        CorruptShardError: a wrong shard count or size, or any checksum mismatch (naming the
            tensor and shard).
    """
    if len(shards) != manifest.num_shards:
        raise CorruptShardError(f"got {len(shards)} shards, the manifest of version {manifest.version} lists "
                                f"{manifest.num_shards}")
    if not shards_verified:  # the shard checksums also catch a manifest whose two checksum lists disagree
        for i, (data, size, c) in enumerate(zip(shards, manifest.shard_sizes, manifest.shard_checksums,
                                                strict=True)):
            verify_shard(i, data, size, c)
    return unpack_tensors(manifest.tensors, shards, manifest.shard_sizes)
