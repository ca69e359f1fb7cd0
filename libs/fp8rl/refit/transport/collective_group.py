"""The collective transport's building blocks: the epoch record in Redis and one process group of an epoch.

:class:`EpochSpec` is ``P collective:epoch`` (strict JSON: epoch, TCPStore endpoint, ordered members,
backend, timeouts); :class:`_Group` is one epoch's ``ProcessGroupGloo`` / ``ProcessGroupNCCL``, built
directly on a ``PrefixStore`` (never ``init_process_group``) with bounded broadcast and receive.
The protocol around them is described in :mod:`.collective`.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..keys import validate_replica_id

log = logging.getLogger("fp8rl.refit.transport.collective")

BACKENDS = ("gloo", "nccl")
_STORE_POLL_S = 0.02  # TCPStore polling; check() instead of wait(), whose timeouts log C++ warnings
_EPOCH_FIELDS = {"epoch", "store", "members", "backend", "join_timeout_s", "op_timeout_s"}
_LOOPBACK = ("127.", "localhost", "::1")


class CollectiveTransferError(ConnectionError):
    """A shard is not available from the collective broadcast (not received in time, failed, or mismatched)."""


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"collective store endpoint must look like 'host:port' (port 1-65535), got {endpoint!r}")
    return host, int(port)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} in collective epoch JSON")


@dataclass(frozen=True)
class EpochSpec:
    """One epoch of the broadcast group, as the trainer announces it in ``P collective:epoch``.

    Attributes:
        epoch: the epoch number (>= 0; a new one per change of members or after a failure).
        store: ``host:port`` of the trainer's TCPStore where the group rendezvous.
        members: replica ids in rank order (``members[k]`` is rank ``k + 1``); unique, at least one.
        backend: ``gloo`` or ``nccl``.
        join_timeout_s: how long joining (rendezvous and group construction) may take.
        op_timeout_s: how long one collective may take before the group counts as broken.
    """

    epoch: int
    store: str
    members: tuple[str, ...]
    backend: str
    join_timeout_s: float
    op_timeout_s: float

    def __post_init__(self) -> None:
        if not isinstance(self.members, list | tuple):
            raise ValueError(f"collective epoch members must be a list, got {type(self.members).__name__}")
        object.__setattr__(self, "members", tuple(self.members))
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 0:
            raise ValueError(f"collective epoch number must be an int >= 0, got {self.epoch!r}")
        if not isinstance(self.store, str):
            raise ValueError(f"collective epoch store must be a string 'host:port', got {self.store!r}")
        _split_endpoint(self.store)
        if not self.members:
            raise ValueError("collective epoch lists no members")
        for m in self.members:
            validate_replica_id(m)
        if len(set(self.members)) != len(self.members):
            raise ValueError(f"collective epoch lists a member twice: {list(self.members)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"collective backend must be one of {BACKENDS}, got {self.backend!r}")
        _positive("join_timeout_s", self.join_timeout_s)
        _positive("op_timeout_s", self.op_timeout_s)

    @property
    def key(self) -> tuple[int, str]:
        """What identifies an epoch: its number and the store (a restarted trainer has a new store)."""
        return self.epoch, self.store

    def to_json_bytes(self) -> bytes:
        """Compact, key-sorted UTF-8 JSON (what Redis stores)."""
        d = {"epoch": self.epoch, "store": self.store, "members": list(self.members), "backend": self.backend,
             "join_timeout_s": self.join_timeout_s, "op_timeout_s": self.op_timeout_s}
        return json.dumps(d, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_json_bytes(cls, data: bytes) -> EpochSpec:
        """Strict inverse of :meth:`to_json_bytes`: bad JSON, unknown or missing fields → ``ValueError``."""
        try:
            d = json.loads(data, parse_constant=_reject_constant)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"collective epoch is not valid JSON: {exc}") from exc
        if not isinstance(d, dict) or set(d) != _EPOCH_FIELDS:
            got = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"collective epoch must be an object with fields {sorted(_EPOCH_FIELDS)}, got {got}")
        return cls(**d)


def _buckets(total: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """``(offset, size)`` of each bucket of a ``total``-byte payload: consecutive, all but the last full."""
    return [(off, min(bucket_bytes, total - off)) for off in range(0, total, bucket_bytes)]


def _gloo_device(host: str | None):
    # An explicit address binds gloo there; None lets gloo choose (GLOO_SOCKET_IFNAME, else the hostname).
    if host is None or host in ("", "0.0.0.0", "::"):
        return dist.ProcessGroupGloo.create_default_device()
    return dist.ProcessGroupGloo.create_device(hostname=host)


class _Group:
    """One epoch's process group as rank ``rank`` of ``world``; every collective is a broadcast from rank 0.

    gloo works on the CPU tensors themselves; NCCL stages each bucket through one device buffer.
    A failed or timed-out collective leaves the group unusable (gloo closes its pairs): close it.
    """

    @staticmethod
    def local_device(backend: str, bind_host: str | None):
        """What this process can check alone, before any rendezvous: the backend is built in, a GPU for NCCL,
        the gloo interface exists. Returns the gloo device (None for NCCL); raises otherwise."""
        if backend == "gloo":
            if not dist.is_gloo_available():
                raise RuntimeError("this torch build has no gloo backend; the collective refit transport needs it")
            return _gloo_device(bind_host)
        if not (dist.is_nccl_available() and torch.cuda.is_available()):
            raise RuntimeError("the collective refit backend 'nccl' needs a CUDA build of torch and a GPU")
        return None

    def __init__(self, backend: str, store, rank: int, world: int, *, join_timeout_s: float,
                 op_timeout_s: float, device) -> None:
        self.backend, self.op_timeout = backend, _td(op_timeout_s)
        self._staging: torch.Tensor | None = None
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = _td(join_timeout_s)  # bounds the rendezvous (connectFullMesh) in the constructor
            opts._devices = [device]
            self.pg = dist.ProcessGroupGloo(store, rank, world, opts)
            self.pg._set_default_timeout(self.op_timeout)
            self.device = torch.device("cpu")
        else:  # nccl: untested (no GPU here); the communicator is created at the first collective
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.op_timeout
            opts.is_high_priority_stream = False
            self.pg = dist.ProcessGroupNCCL(store, rank, world, opts)
            self.device = torch.device("cuda", torch.cuda.current_device())

    def _device_view(self, n: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < n:
            self._staging = torch.empty(n, dtype=torch.uint8, device=self.device)
        return self._staging[:n]

    def _bcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.timeout = 0, self.op_timeout
        self.pg.broadcast([t], opts).wait(self.op_timeout)
        if t.is_cuda:
            torch.cuda.current_stream(t.device).synchronize()

    def send(self, host: torch.Tensor) -> None:
        """Rank 0: broadcast the bytes of the CPU tensor ``host``."""
        if self.device.type == "cpu":
            return self._bcast(host)
        dev = self._device_view(host.numel() * host.element_size()).view(host.dtype)[:host.numel()]
        dev.copy_(host)
        self._bcast(dev)

    def recv_into(self, host: torch.Tensor) -> None:
        """Ranks > 0: receive one broadcast into the CPU tensor ``host`` (same size and dtype as sent)."""
        if self.device.type == "cpu":
            return self._bcast(host)
        dev = self._device_view(host.numel() * host.element_size()).view(host.dtype)[:host.numel()]
        self._bcast(dev)
        host.copy_(dev)

    def close(self) -> None:
        """Drop the group; closing its connections also ends peers' pending receives with an error."""
        try:
            if self.backend == "nccl":
                self.pg.shutdown()
        except Exception as exc:  # noqa: BLE001 - best effort on a broken group
            log.debug("collective group shutdown: %s", exc)
        self.pg = None
        self._staging = None


def _await_key(store, key: str, timeout_s: float, stopping: threading.Event) -> bytes | None:
    """``store.get(key)`` once it exists, or None after ``timeout_s`` / when ``stopping`` is set."""
    deadline = time.monotonic() + timeout_s
    while not stopping.is_set():
        if store.check([key]):
            return store.get(key)
        if time.monotonic() >= deadline:
            return None
        stopping.wait(_STORE_POLL_S)
    return None


