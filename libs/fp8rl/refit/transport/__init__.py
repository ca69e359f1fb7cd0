"""Refit transports behind one seam: :class:`ShardSource` (``base``), in memory (``inprocess``), gRPC streams
from the trainer's ``WeightStore`` (``grpc``). :func:`make_shard_source` picks one by name.

Invariant: a transport moves bytes and nothing else — verification and applying stay in the subscriber.
"""

from __future__ import annotations

from .base import ShardSource
from .inprocess import InProcessShardSource

__all__ = ["TRANSPORTS", "InProcessShardSource", "ShardSource", "make_shard_source"]

TRANSPORTS = ("grpc", "inprocess")


def make_shard_source(kind: str = "grpc", **kwargs) -> ShardSource:
    """The :class:`ShardSource` named ``kind``: ``"grpc"`` (:class:`.grpc.GrpcShardSource`, kwargs: its
    options) or ``"inprocess"`` (:class:`InProcessShardSource`, kwarg ``shards``)."""
    if kind == "grpc":
        from .grpc import GrpcShardSource  # the gRPC stack only for those who use it

        return GrpcShardSource(**kwargs)
    if kind == "inprocess":
        return InProcessShardSource(**kwargs)
    raise ValueError(f"unknown refit transport {kind!r}; known: {', '.join(TRANSPORTS)}")
