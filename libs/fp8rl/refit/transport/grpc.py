"""The gRPC transport of refit shards: the ``WeightStore`` servicer and a :class:`ShardSource` over it.

``make_shard_source("grpc")`` builds the replica side.

Trainer side, :class:`WeightStoreServicer` serves the shards a :class:`RefitPublisher` holds:
``StreamShards`` sends one shard from the requested offset to its end in chunks of
``chunk_bytes`` (1–4 MiB), in order, the final one flagged ``last``; ``GetManifest`` returns a held
version's manifest JSON exactly as Redis stores it.

Replica side, :class:`GrpcShardSource` pulls one shard from the endpoint named in the manifest.
Every chunk must continue exactly where the bytes received so far end (same version, same shard,
contiguous offset); a transfer cut short — a transport error, a deadline, or a stream that ends
without ``last`` — is resumed from the bytes already received, with a fresh deadline, at most
``max_resumes`` times. Errors that a retry cannot fix (NOT_FOUND, OUT_OF_RANGE, auth) fail at once.

Invariant: :meth:`GrpcShardSource.fetch` returns exactly ``manifest.shard_sizes[i]`` bytes or
raises. It does not check the checksum — :class:`RefitSubscriber` verifies every shard (and every
tensor) and re-fetches a corrupt one, so no byte reaches an engine unverified.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from fp8rl.rpc import weights_pb2, weights_pb2_grpc
from fp8rl.rpc.channel import DEFAULT_DEADLINE_S, make_channel

from ..manifest import Manifest
from ..shards import CorruptShardError
from .base import ShardHolder

log = logging.getLogger(__name__)

__all__ = [
    "MIN_CHUNK_BYTES", "MAX_CHUNK_BYTES", "DEFAULT_CHUNK_BYTES", "WeightStoreServicer", "GrpcShardSource",
    "ShardTransferError",
]

MiB = 1024 * 1024
MIN_CHUNK_BYTES = 1 * MiB
MAX_CHUNK_BYTES = 4 * MiB  # well under every message limit, big enough that per-message overhead vanishes
DEFAULT_CHUNK_BYTES = 1 * MiB

# Codes a resumed stream can recover from; anything else (NOT_FOUND, OUT_OF_RANGE, INVALID_ARGUMENT,
# UNAUTHENTICATED, ...) fails the fetch at once and is left to the subscriber's retry budget.
_RESUMABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
})


class ShardTransferError(ConnectionError):
    """A shard could not be pulled from its WeightStore (not served there, or cut short too often)."""


class WeightStoreServicer(weights_pb2_grpc.WeightStoreServicer):
    """Serves the versions a :class:`RefitPublisher` holds (its newest ``keep`` versions).

    Args:
        publisher: the trainer's publisher; thread-safe, read on every call.
        chunk_bytes: bytes per ``ShardChunk`` (the last chunk of a shard may be shorter), in
            ``[MIN_CHUNK_BYTES, MAX_CHUNK_BYTES]``.
    """

    def __init__(self, publisher: ShardHolder, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
        self.publisher = publisher
        self.chunk_bytes = chunk_bytes

    def _shards(self, version: int, context: grpc.ServicerContext, delta: bool = False) -> list[bytes]:
        try:
            return self.publisher.shards(version, delta=delta)
        except LookupError as exc:  # evicted, or never published by this trainer
            context.abort(grpc.StatusCode.NOT_FOUND, f"WeightStore: {exc}")

    def GetManifest(self, request, context):
        self._shards(request.version, context)  # only versions whose bytes are served here
        manifest = self.publisher.store.get_manifest(request.version)
        if manifest is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"WeightStore: weight version {request.version} has no manifest")
        return weights_pb2.GetManifestResponse(version=request.version, manifest=manifest.to_json_bytes())

    def StreamShards(self, request, context):
        shards = self._shards(request.version, context, delta=request.delta)
        v, i, offset = request.version, request.shard_index, request.offset
        if not 0 <= i < len(shards):
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"WeightStore: weight version {v} has {len(shards)} shard(s), asked for shard {i}")
        data = memoryview(shards[i])
        if offset < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"WeightStore: offset must be >= 0, got {offset}")
        if offset > len(data):
            context.abort(grpc.StatusCode.OUT_OF_RANGE, f"WeightStore: offset {offset} is past the end of shard {i} "
                                                        f"of version {v} ({len(data)} bytes)")
        while True:  # at least one chunk, so a resume at the very end (or an empty shard) still sees `last`
            end = min(offset + self.chunk_bytes, len(data))
            yield weights_pb2.ShardChunk(version=v, shard_index=i, offset=offset, data=bytes(data[offset:end]),
                                         last=end == len(data))
            if end == len(data) or not context.is_active():
                return
            offset = end


class _Chunks:
    """The bytes of one shard received so far, written into one buffer allocated at the shard's size
    (one copy in all, and writable, so the tensors are views of it)."""

    def __init__(self, size: int) -> None:
        self.buf = bytearray(size)
        self.size = 0

    def append(self, data: bytes) -> None:
        end = self.size + len(data)
        if end > len(self.buf):
            raise OverflowError(end)
        self.buf[self.size:end] = data
        self.size = end

    def __len__(self) -> int:
        return self.size

    def join(self) -> bytearray:
        return self.buf


class GrpcShardSource:
    """A :class:`fp8rl.refit.ShardSource` pulling shards over ``WeightStore.StreamShards``.

    Channels are made with :func:`fp8rl.rpc.make_channel` (project limits, auth token and TLS from
    the environment) and cached per endpoint.

    Args:
        deadline_s: deadline of one ``StreamShards`` call (a resumed call gets a fresh one).
        max_resumes: how many times one fetch may resume a cut transfer before giving up.
        backoff_s: sleep before the n-th resume is ``n * backoff_s``.
    """

    def __init__(self, *, deadline_s: float = DEFAULT_DEADLINE_S.stream_shard, max_resumes: int = 3,
                 backoff_s: float = 0.1) -> None:
        if deadline_s <= 0 or max_resumes < 0 or backoff_s < 0:
            raise ValueError(f"need deadline_s > 0, max_resumes >= 0, backoff_s >= 0; got {deadline_s}, "
                             f"{max_resumes}, {backoff_s}")
        self.deadline_s, self.max_resumes, self.backoff_s = deadline_s, max_resumes, backoff_s
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def _stub(self, endpoint: str) -> weights_pb2_grpc.WeightStoreStub:
        with self._lock:
            if endpoint not in self._channels:
                self._channels[endpoint] = make_channel(endpoint)
            return weights_pb2_grpc.WeightStoreStub(self._channels[endpoint])

    def close(self) -> None:
        """Close every cached channel."""
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()

    def fetch(self, manifest: Manifest, shard_index: int) -> bytearray:
        """The ``manifest.shard_sizes[shard_index]`` bytes of that shard (checksum not verified here).

        Raises:
            ShardTransferError: no endpoint, not served there, or cut short more than ``max_resumes`` times.
            CorruptShardError: the server sent chunks that do not fit (wrong version/shard/offset, too many bytes).
        """
        v, endpoint = manifest.version, manifest.endpoint
        if not endpoint:
            raise ShardTransferError(f"the manifest of weight version {v} names no WeightStore endpoint")
        if not 0 <= shard_index < manifest.num_shards:
            raise ShardTransferError(f"weight version {v} has {manifest.num_shards} shard(s), asked for {shard_index}")
        size = manifest.shard_sizes[shard_index]
        stub = self._stub(endpoint)
        buf = _Chunks(size)
        why = ""
        for attempt in range(self.max_resumes + 1):
            if attempt:
                log.info("resuming shard %d of weight version %d from %s at byte %d/%d (resume %d/%d): %s",
                         shard_index, v, endpoint, len(buf), size, attempt, self.max_resumes, why)
                time.sleep(self.backoff_s * attempt)
            try:
                if self._stream_into(stub, v, shard_index, size, buf, manifest.base is not None):
                    return buf.join()
                why = "the stream ended before its last chunk"
            except grpc.RpcError as exc:
                code = exc.code()
                why = f"{code.name}: {exc.details()}"
                if code not in _RESUMABLE:
                    raise ShardTransferError(
                        f"cannot pull shard {shard_index} of weight version {v} from {endpoint}: {why}") from exc
        raise ShardTransferError(
            f"shard {shard_index} of weight version {v} from {endpoint} was cut short {self.max_resumes + 1} "
            f"time(s); got {len(buf)}/{size} bytes. Last: {why}")

    def _stream_into(self, stub, version: int, shard_index: int, size: int, buf: _Chunks, delta: bool) -> bool:
        """Append one stream's chunks to ``buf``; True when the shard's last chunk arrived."""
        request = weights_pb2.StreamShardsRequest(version=version, shard_index=shard_index, offset=len(buf),
                                                  delta=delta)
        call = stub.StreamShards(request, timeout=self.deadline_s)
        try:
            for chunk in call:
                if (chunk.version, chunk.shard_index, chunk.offset) != (version, shard_index, len(buf)):
                    raise CorruptShardError(
                        f"WeightStore sent version {chunk.version} shard {chunk.shard_index} offset {chunk.offset}, "
                        f"expected version {version} shard {shard_index} offset {len(buf)}", shard=shard_index)
                try:
                    buf.append(chunk.data)
                except OverflowError:
                    raise CorruptShardError(f"shard {shard_index} of version {version}: received "
                                            f"{len(buf) + len(chunk.data)} bytes, the manifest says {size}",
                                            shard=shard_index) from None
                if chunk.last:
                    if len(buf) != size:
                        raise CorruptShardError(f"shard {shard_index} of version {version} ended at {len(buf)} "
                                                f"bytes, the manifest says {size}", shard=shard_index)
                    return True
        finally:
            call.cancel()  # no-op on a finished stream; frees the server when we stop early
        return False
