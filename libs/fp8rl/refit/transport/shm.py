"""The same-node refit transport: shards written once into shared memory, mapped by the replicas.

Trainer side, :class:`ShmShardWriter` is a :class:`~fp8rl.refit.RefitPublisher` sink. For version v
it creates ``<root>/fp8rl-<job>-<pid>-<random>/v<v>.tmp/`` (the job directory is private, mode 0700;
a directory whose trainer pid is gone is removed by the next writer of the job) and
allocates each shard *inside* its file: ``pack_tensors`` writes the tensors' bytes straight into the
shared mapping, so the shards the publisher holds (and serves over gRPC too) are these pages — one
write, no second copy in the trainer. When the manifest is built the directory is renamed to
``v<v>/`` (atomic: a replica sees every file of a version or none), then the manifest, naming the
directory and this host's boot id, is published. Versions leave the directory when the publisher
evicts them (``keep`` newest), and the whole job directory goes at :meth:`ShmShardWriter.close`.

A shard file is a valid safetensors file (any tool can open it): an 8-byte little-endian header
length, a JSON header padded with spaces so the data starts at a multiple of 64 bytes, then the
shard's bytes exactly as on every other transport. The header lists each tensor wholly inside the
shard under its own name and dtype, and, as ``U8`` entries, the 64-byte alignment gaps
(``__pad__.<k>``) and the pieces of a tensor that spans shards (``__part__.<name>``), because
safetensors allows no holes. ``__metadata__`` holds the job, version, shard index and checksum.

Replica side, :class:`ShmShardSource` maps a shard file copy-on-write (``MAP_PRIVATE``, never written)
and returns a view of its data region — no socket and no copy; :func:`fp8rl.refit.assemble` views the
tensors in place and the engine copies them into its parameters, which is the one copy of a
same-node refit.

Invariant: a mapped shard is returned only when the file belongs to this job, version and shard and
is exactly header + ``shard_sizes[i]`` bytes; the subscriber still verifies every checksum. A published
file is written again only after the publisher recycles it for a later version, which it does only when
every live refit lease holds that version or a newer one (nobody can still be reading it), so what was
verified is what is copied. The files are the trainer's own pages (a shared mapping): whoever can write
them — the job directory is mode 0700, so only the trainer's user — changes what the trainer serves on
every transport, and the checksums catch it.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import struct
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..manifest import Manifest
from ..shards import ALIGN, TensorEntry

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_SHM_ROOT", "ShmShardWriter", "ShmShardSource", "ShmUnavailableError", "host_id"]

DEFAULT_SHM_ROOT = "/dev/shm"
_LEN = struct.Struct("<Q")
_ST_DTYPES = {"float8_e4m3fn": "F8_E4M3", "bfloat16": "BF16", "float16": "F16", "float32": "F32", "int64": "I64",
               "int32": "I32", "uint8": "U8"}
_MAX_HEADER = 64 * 1024 * 1024  # safetensors' own limit is 100 MB


class ShmUnavailableError(ConnectionError):
    """This replica cannot read the version from shared memory (another host, no files, a foreign file)."""


def host_id() -> str:
    """The kernel's boot id: the same for every process (and container) on one host, different elsewhere."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # not Linux: fall back to the hostname (containers then need a shared hostname)
        return os.uname().nodename


def _shard_header(job: str, version: int, index: int, size: int, entries: Sequence[TensorEntry],
                  starts: Sequence[int]) -> bytes:
    """The safetensors header of one shard (see the module docstring), padded so the data starts 64-aligned."""
    meta: dict[str, Any] = {"__metadata__": {"format": "fp8rl-refit-shard", "job": job, "version": str(version),
                                             "shard": str(index)}}
    lo_shard, hi_shard = starts[index], starts[index] + size
    pos, pads = 0, 0
    for e in entries:
        if e.shard > index:
            break
        a, b = starts[e.shard] + e.offset, starts[e.shard] + e.offset + e.nbytes  # logical stream range
        if e.shard < index and b <= lo_shard:  # wholly in an earlier shard
            continue
        begin, end = max(a, lo_shard) - lo_shard, min(b, hi_shard) - lo_shard
        if begin > pos:
            meta[f"__pad__.{pads}"] = {"dtype": "U8", "shape": [begin - pos], "data_offsets": [pos, begin]}
            pads += 1
        if a >= lo_shard and b <= hi_shard:
            meta[e.name] = {"dtype": _ST_DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [begin, end]}
        else:
            meta[f"__part__.{e.name}"] = {"dtype": "U8", "shape": [end - begin], "data_offsets": [begin, end]}
        pos = end
    if pos < size:  # cannot happen for a layout from pack_tensors; keeps the file valid regardless
        meta[f"__pad__.{pads}"] = {"dtype": "U8", "shape": [size - pos], "data_offsets": [pos, size]}
    raw = json.dumps(meta, separators=(",", ":")).encode()
    total = _LEN.size + len(raw)
    return raw + b" " * (-total % ALIGN)


class ShmShardWriter:
    """Trainer side: allocates each version's shards inside shared-memory files (a publisher sink).

    Args:
        job: the job id (part of the directory name and of every file's metadata).
        root: the shared-memory mount (``/dev/shm``; in containers, a volume shared with the replicas).

    Raises:
        ShmUnavailableError: ``root`` is missing or not writable (nothing created).
    """

    def __init__(self, job: str, root: str = DEFAULT_SHM_ROOT) -> None:
        if not os.path.isdir(root) or not os.access(root, os.W_OK | os.X_OK):
            raise ShmUnavailableError(f"shared-memory refit needs a writable directory {root!r}")
        self.job, self.host = job, host_id()
        _remove_orphans(Path(root), job)
        self.dir = Path(tempfile.mkdtemp(prefix=f"fp8rl-{job}-{os.getpid()}-", dir=root))  # mode 0700
        self._lock = threading.Lock()
        self._maps: dict[int, list[tuple[Path, mmap.mmap]]] = {}  # version -> its files and their mappings
        self._spares: list[tuple[Path, mmap.mmap]] = []  # recycled files (and mappings) for the next version
        log.info("shared-memory refit: version shards in %s", self.dir)

    def _vdir(self, version: int, tmp: bool = False) -> Path:
        return self.dir / (f"v{version}.tmp" if tmp else f"v{version}")

    def begin(self, version: int):
        """Start version ``version``: returns the ``alloc`` for :func:`~fp8rl.refit.shards.pack_tensors`.

        A shard reuses a recycled file of the same length (and its mapping) when there is one: no page
        is allocated, zeroed or mapped again, which on this kind of VM is most of what writing costs.
        """
        d = self._vdir(version, tmp=True)
        shutil.rmtree(d, ignore_errors=True)  # a build that failed before its rename
        d.mkdir(mode=0o700)
        with self._lock:
            self._maps[version] = []
        starts = [0]  # logical stream offset of each shard's start (alloc is called for shards 0, 1, ... in order)

        def alloc(index: int, size: int, entries: Sequence[TensorEntry]) -> memoryview:
            if index != len(starts) - 1:
                raise ValueError(f"shards must be allocated in order: got {index} after {len(starts) - 2}")
            starts.append(starts[-1] + size)
            header = _shard_header(self.job, version, index, size, entries, starts)
            path = d / f"shard-{index:05d}.safetensors"
            length = _LEN.size + len(header) + size
            mm = self._take_spare(length, path)
            if mm is None:
                with open(path, "w+b") as f:
                    try:  # reserve the pages now: a full tmpfs is ENOSPC here, never a SIGBUS on a write later
                        os.posix_fallocate(f.fileno(), 0, length)
                    except OSError as exc:
                        raise ShmUnavailableError(f"cannot reserve {length} bytes in {self.dir}: {exc}") from exc
                    mm = mmap.mmap(f.fileno(), length, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            mm[:_LEN.size + len(header)] = _LEN.pack(len(header)) + header
            self._maps[version].append((path, mm))
            return memoryview(mm)[_LEN.size + len(header):]

        return alloc

    def _take_spare(self, length: int, path: Path) -> mmap.mmap | None:
        with self._lock:
            for i, (spare, mm) in enumerate(self._spares):
                if len(mm) == length:
                    del self._spares[i]
                    os.replace(spare, path)  # the same inode and pages, under the new version's name
                    return mm
        return None

    def commit(self, version: int) -> dict[str, Any]:
        """The shards of ``version`` are complete: make them visible; returns the manifest fields to add."""
        os.replace(self._vdir(version, tmp=True), self._vdir(version))
        with self._lock:
            self._maps[version] = [(self._vdir(version) / p.name, mm) for p, mm in self._maps[version]]
            leftover, self._spares = self._spares, []
        for spare, _ in leftover:  # spares no shard of this version could use (another size)
            spare.unlink(missing_ok=True)
        return {"shm": {"dir": str(self._vdir(version)), "host": self.host}}

    def abort(self, version: int) -> None:
        """Building or publishing ``version`` failed: drop its files."""
        self.evict(version)

    def evict(self, version: int, *, recycle: bool = False) -> None:
        """Remove ``version``'s files from view.

        Without ``recycle`` they are deleted (mapped views stay valid until released). With ``recycle``
        the files and their mappings are kept aside for the next version to overwrite: the caller
        guarantees that no replica can still be reading ``version`` (every live refit lease holds a
        newer one), since a replica's private mapping would see the new bytes.
        """
        with self._lock:
            maps = self._maps.pop(version, [])
        if recycle and maps:
            spare_dir = self.dir / "spare"
            spare_dir.mkdir(mode=0o700, exist_ok=True)
            kept = []
            for path, mm in maps:
                spare = spare_dir / f"v{version}-{path.name}"
                try:
                    os.replace(path, spare)
                except OSError:
                    continue
                kept.append((spare, mm))
            with self._lock:
                self._spares += kept
        for d in (self._vdir(version), self._vdir(version, tmp=True)):
            shutil.rmtree(d, ignore_errors=True)

    def versions(self) -> list[int]:
        """Versions whose files exist."""
        out = []
        for p in self.dir.iterdir() if self.dir.exists() else ():  # (the "spare" directory is not a version)
            if p.name.startswith("v") and p.name[1:].isdigit():
                out.append(int(p.name[1:]))
        return sorted(out)

    def close(self) -> None:
        """Remove the job directory and every version in it."""
        with self._lock:
            self._maps.clear()
            self._spares.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


def _remove_orphans(root: Path, job: str) -> None:
    """Remove this job's directories left by a trainer that died without :meth:`ShmShardWriter.close`
    (``fp8rl-<job>-<pid>-*`` whose pid is gone); others' are left alone."""
    for d in root.glob(f"fp8rl-{job}-*-*"):
        pid = d.name[len(f"fp8rl-{job}-"):].split("-", 1)[0]
        if not pid.isdigit() or d.stat().st_uid != os.getuid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            log.info("removing %s, left by trainer process %s that is gone", d, pid)
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


class ShmShardSource:
    """A :class:`~fp8rl.refit.ShardSource` mapping the shard files named by the manifest (same host only).

    Raises (from :meth:`fetch`):
        ShmUnavailableError: the manifest names no shm directory, another host's, or the file is
            missing, foreign (another job/version/shard) or of the wrong size.
    """

    def __init__(self) -> None:
        self.host = host_id()
        self._lock = threading.Lock()
        # (device, inode) -> (mapping, newest version read through it). The trainer recycles an evicted
        # version's files for a later one (only once every refit lease holds something newer), so a
        # replica that keeps its mapping of a file reads the next version through page tables that are
        # already there: a copy at memory speed instead of one page fault per 4 KiB.
        self._maps: dict[tuple[int, int], tuple[mmap.mmap, int]] = {}

    def available(self, manifest: Manifest) -> bool:
        """Whether ``manifest``'s shards can be mapped here (same host, directory present)."""
        shm = manifest.shm
        return shm is not None and shm["host"] == self.host and os.path.isdir(shm["dir"])

    def fetch(self, manifest: Manifest, shard_index: int) -> memoryview:
        shm, v = manifest.shm, manifest.version
        if shm is None:
            raise ShmUnavailableError(f"weight version {v} was not published to shared memory")
        if shm["host"] != self.host:
            raise ShmUnavailableError(f"weight version {v} is in shared memory of host {shm['host']}, not this one")
        if not 0 <= shard_index < manifest.num_shards:
            raise ShmUnavailableError(f"weight version {v} has {manifest.num_shards} shard(s), asked for {shard_index}")
        path = Path(shm["dir"]) / f"shard-{shard_index:05d}.safetensors"
        size = manifest.shard_sizes[shard_index]
        try:
            with open(path, "rb") as f:
                length = os.fstat(f.fileno()).st_size
                head = f.read(_LEN.size)
                if len(head) != _LEN.size:
                    raise ShmUnavailableError(f"{path} is truncated ({length} bytes)")
                (n,) = _LEN.unpack(head)
                if n > _MAX_HEADER or _LEN.size + n + size != length:
                    raise ShmUnavailableError(f"{path}: header of {n} bytes + shard of {size} != file size {length}")
                meta = _parse_meta(path, f.read(n))
                mm = self._mapping(f.fileno(), length, v)
        except FileNotFoundError as exc:
            raise ShmUnavailableError(f"weight version {v} shard {shard_index}: {path} is gone (evicted?)") from exc
        except OSError as exc:
            raise ShmUnavailableError(f"cannot map {path}: {exc}") from exc
        want = {"job": manifest.job, "version": str(v), "shard": str(shard_index)}
        got = {k: meta.get(k) for k in want}
        if got != want:
            raise ShmUnavailableError(f"{path} holds {got}, expected {want}")
        return memoryview(mm)[_LEN.size + n:]

    def _mapping(self, fd: int, length: int, version: int) -> mmap.mmap:
        """The file's mapping: the cached one of the same inode and length, else a new one.

        Private (copy-on-write) and writable, so views are ordinary writable tensors without a copy and
        nothing is ever written back; on Linux a private mapping keeps showing the file's current bytes
        for every page it never wrote (a page some consumer wrote to would keep its old bytes, fail the
        next checksum and cost a fallback, never a wrong weight). Faulted lazily (MAP_POPULATE measured
        slower here: the checksum pass touches every page anyway). Mappings not used by this version or
        the one before are dropped.
        """
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        with self._lock:
            hit = self._maps.get(key)
            if hit is not None and len(hit[0]) == length:
                mm = hit[0]
            else:
                mm = mmap.mmap(fd, length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self._maps[key] = (mm, max(version, hit[1]) if hit is not None and hit[0] is mm else version)
            for k in [k for k, (_, used) in self._maps.items() if used < version - 1]:
                del self._maps[k]  # (a view still held keeps its mapping alive)
        return mm

    def close(self) -> None:
        """Drop the cached mappings (views still held keep theirs alive)."""
        with self._lock:
            self._maps.clear()


def _parse_meta(path: Path, raw: bytes) -> dict[str, str]:
    try:
        header = json.loads(raw)
        meta = header["__metadata__"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ShmUnavailableError(f"{path} has no valid safetensors header: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != "fp8rl-refit-shard":
        raise ShmUnavailableError(f"{path} is not an fp8rl refit shard")
    return meta
