"""Shards from memory: the in-process loop and tests (a live view of a publisher's held shards)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..manifest import Manifest

__all__ = ["InProcessShardSource"]


class InProcessShardSource:
    """A :class:`ShardSource` over an in-memory ``{version: [shard bytes, ...]}`` mapping (a live view).

    Args:
        shards: version → list of shard bytes, and ``(version, "delta")`` → a delta manifest's shards; read
            at every fetch, so later additions are seen.
    """

    def __init__(self, shards: Mapping[int, Sequence[bytes]]) -> None:
        self._shards = shards

    def fetch(self, manifest: Manifest, shard_index: int) -> bytes:
        key = manifest.version if manifest.base is None else (manifest.version, "delta")
        try:
            shards = self._shards[key]
        except KeyError:
            what = "shards" if manifest.base is None else "delta shards"
            raise LookupError(f"no {what} held for weight version {manifest.version}") from None
        if not 0 <= shard_index < len(shards):
            raise LookupError(f"weight version {manifest.version} has {len(shards)} shards, asked for {shard_index}")
        return shards[shard_index]
