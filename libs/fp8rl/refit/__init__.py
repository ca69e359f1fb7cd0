"""Redis-coordinated refit protocol (DESIGN §3): move each policy version from trainer to rollout replicas.

Invariants: ``weights:latest`` only increases; a replica applies version v only when every tensor
arrived intact, only together with v's own QKV scales when it runs an FP8 KV cache, never when v is
older than what it holds; and only a replica with a live lease can ack.

Modules: :mod:`.keys` (every Redis key name), :mod:`.shards` (raw-byte shard format),
:mod:`.scales` (the one wire format of a QKV scale set, in Redis and over gRPC),
:mod:`.manifest` (manifest, ``build_shards``, ``assemble``), :mod:`.store` (Redis state),
:mod:`.subscriber` (``RefitPublisher``, ``RefitSubscriber``, ``ShardSource``).
"""

from .follower import AWAITING_SCALES, REFIT_FAILED, PendingRefit, RefitFollower, RefitHeld
from .keys import JOBS_INDEX, Keys, validate_job_id, validate_replica_id, validate_version
from .lease import LeaseHolder, RoleLease
from .manifest import Manifest, assemble, build_shards
from .publisher import RefitPublisher
from .scales import decode_scales, encode_scales
from .shards import DEFAULT_SHARD_BYTES, DTYPES, CorruptShardError, TensorEntry, pack_tensors, unpack_tensors
from .store import (
    Event,
    LeaseExpiredError,
    RefitAuthenticationError,
    RefitConnectionError,
    RefitError,
    RefitStore,
    ReplicaLease,
    StaleVersionError,
    UnknownVersionError,
    connect,
    redact_url,
)
from .subscriber import MissingScalesError, RefitFailedError, RefitSubscriber, RefitTarget
from .transport import InProcessShardSource, ShardSource, make_shard_source

__all__ = [
    "JOBS_INDEX", "Keys", "validate_job_id", "validate_replica_id", "validate_version",
    "Manifest", "assemble", "build_shards",
    "DEFAULT_SHARD_BYTES", "DTYPES", "CorruptShardError", "TensorEntry", "pack_tensors", "unpack_tensors",
    "encode_scales", "decode_scales",
    "RefitTarget", "make_shard_source", "RefitFollower", "RefitHeld", "PendingRefit", "LeaseHolder", "RoleLease",
    "AWAITING_SCALES", "REFIT_FAILED", "Event", "ReplicaLease", "RefitStore", "connect", "redact_url",
    "RefitError", "StaleVersionError", "UnknownVersionError", "LeaseExpiredError", "RefitConnectionError",
    "RefitAuthenticationError",
    "InProcessShardSource", "MissingScalesError", "RefitFailedError", "RefitPublisher", "RefitSubscriber",
    "ShardSource",
]
