"""The transport seam of refit: where the bytes of one shard come from.

A :class:`ShardSource` fetches shard bytes; it does not verify them — :class:`fp8rl.refit.RefitSubscriber`
checks every shard and tensor checksum and re-fetches a corrupt one, so any transport may be lossy.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ..manifest import Manifest

__all__ = ["CountingSource", "ShardHolder", "ShardSource"]


class _ManifestStore(Protocol):
    def get_manifest(self, version: int) -> Manifest | None: ...


class ShardHolder(Protocol):
    """What a serving transport reads from the trainer's side (:class:`fp8rl.refit.RefitPublisher` is one): the
    shards of the versions it holds and, through ``store``, their manifests. A protocol here, so the transports
    never import the publisher that imports them."""

    store: _ManifestStore

    def shards(self, version: int, *, delta: bool = False) -> list[Any]:
        """The shard bytes of ``version`` (its delta's with ``delta``); ``LookupError`` if not held."""
        ...


@runtime_checkable
class ShardSource(Protocol):
    """Fetches the bytes of one shard of a published version (from wherever they are served).

    A source whose ``verifies_shards`` attribute is True promises that every shard it returns already
    passed its checksum (:class:`~fp8rl.refit.transport.AutoShardSource`); the subscriber then does not
    hash it a second time.
    """

    def fetch(self, manifest: Manifest, shard_index: int) -> bytes:
        """The bytes of shard ``shard_index`` of ``manifest.version`` (any bytes-like object, writable for
        zero-copy assembly: ``bytearray``, a writable ``memoryview``); may raise on transport errors."""
        ...


class CountingSource:
    """A :class:`ShardSource` around another, counting the bytes of every shard it delivers (``bytes``): what a
    replica's transport moved, for benchmarks and tests that measure refits."""

    def __init__(self, inner: ShardSource) -> None:
        self.inner, self.bytes = inner, 0

    def fetch(self, manifest: Manifest, shard_index: int):
        data = self.inner.fetch(manifest, shard_index)
        self.bytes += len(data)
        return data
