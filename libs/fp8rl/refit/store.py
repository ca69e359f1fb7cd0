"""Redis side of the refit protocol: versions, manifests, QKV scales, events, leases and acks.

Invariants this module enforces (each with a test in ``tests/integration/refit``):

* ``weights:latest`` only ever increases. :meth:`RefitStore.publish` stores a manifest and advances
  the pointer in one Lua script (compare-and-set), so of several publishers racing on the same
  version exactly one wins; the others get :class:`StaleVersionError`.
* QKV scales exist only for a published version and are never silently replaced: a second,
  different scale set for the same version is refused. :meth:`RefitStore.get_scales` returns None
  when absent — callers must never fall back to 1.0 (the NeMo RL #3225 failure).
* Only a replica holding a live lease can ack; fencing deletes the lease atomically, so a fenced
  replica's late ack is refused and its next heartbeat tells it to rejoin.
* Every service holds a lease naming its ``role`` (:data:`ROLES`) and the endpoint it serves on, so a
  service restarted on another port is found by reading Redis, never a flag. Refit acks are awaited
  from ``rollout`` leases only. A lease that ends without a clean release — fenced for a missed
  refit, or expired because its holder stopped heartbeating — emits exactly one ``replica_fenced``
  event, whose ``reason`` says which (``refit_timeout`` / ``lease_expired``).

All key names come from :mod:`fp8rl.refit.keys`. Values are bytes (the client must not decode
responses). Scripts receive every key through ``KEYS``, so they are cluster-safe.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import redis

from fp8rl.fp8 import QKVScales

from .keys import Keys, validate_replica_id, validate_version
from .manifest import Manifest
from .scales import decode_scales, encode_scales

__all__ = [
    "RefitError", "StaleVersionError", "UnknownVersionError", "LeaseExpiredError", "RefitConnectionError",
    "RefitAuthenticationError", "Event", "ReplicaLease", "RefitStore", "connect", "redact_url", "ROLES",
    "FENCE_REFIT_TIMEOUT", "FENCE_LEASE_EXPIRED",
]

# The roles a lease can name; a lease written before roles existed reads as "rollout".
ROLES = ("rollout", "calibrator", "trainer", "reward", "controller")
FENCE_REFIT_TIMEOUT = "refit_timeout"  # replica_fenced.reason: it did not ack a version in time
FENCE_LEASE_EXPIRED = "lease_expired"  # replica_fenced.reason: its lease ran out (holder dead or cut off)


class RefitError(RuntimeError):
    """Base class of refit-protocol failures."""


class StaleVersionError(RefitError):
    """A version that is not newer than the one already published (or held) was offered."""

    def __init__(self, version: int, latest: int | None, what: str = "publish") -> None:
        super().__init__(f"cannot {what} weight version {version}: version {latest} is already newer or equal")
        self.version, self.latest = version, latest


class UnknownVersionError(RefitError):
    """No manifest exists for the version asked for."""


class LeaseExpiredError(RefitError):
    """The replica holds no live lease (expired or fenced): it must re-register and pull ``weights:latest``."""


class RefitConnectionError(RefitError):
    """Redis could not be reached or refused our credentials."""


class RefitAuthenticationError(RefitConnectionError):
    """Redis refused our credentials: a wrong password, or none where the server requires one (``NOAUTH``)."""


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (safe for logs and error messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host  # IPv6 literal
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def connect(url: str, *, timeout_s: float = 10.0, check: bool = True) -> redis.Redis:
    """A Redis client for ``url`` (``redis://[:password@]host:port/db``), checked with a PING (unless ``check``
    is false: then only the URL is parsed and the first command connects).

    Args:
        url: Redis URL; passwords (``redis://:pw@host:6379/0``) and ACL users are supported.
        timeout_s: connect and per-command socket timeout (keeps a dead Redis from hanging us).

    Raises:
        RefitConnectionError: unreachable — with the URL redacted; :class:`RefitAuthenticationError` (a subclass)
            for a wrong or missing password.
    """
    try:
        client = redis.Redis.from_url(
            url, decode_responses=False, socket_connect_timeout=timeout_s, socket_timeout=timeout_s
        )
        if check:
            client.ping()
    except redis.AuthenticationError as exc:  # WRONGPASS, and NOAUTH when the URL has no password
        raise RefitAuthenticationError(
            f"Redis at {redact_url(url)} refused authentication ({exc}); check the password in the URL"
        ) from exc
    except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError, ValueError) as exc:
        raise RefitConnectionError(f"cannot use Redis at {redact_url(url)}: {exc}") from exc
    return client


@dataclass(frozen=True)
class Event:
    """One entry of the job's event stream.

    Attributes:
        id: the stream id (pass it back as ``after_id``).
        type: ``weights_published``, ``scales_published``, ``replica_registered`` or ``replica_fenced``.
        version: the weight version concerned (None when the event has none).
        replica: the replica id for replica events, else None.
        reason: for ``replica_fenced``, :data:`FENCE_REFIT_TIMEOUT` or :data:`FENCE_LEASE_EXPIRED`; else None.
    """

    id: str
    type: str
    version: int | None
    replica: str | None = None
    reason: str | None = None


@dataclass(frozen=True)
class ReplicaLease:
    """A live lease: its id, the endpoint it serves on, the version it holds, the lease TTL, its role and
    when it was (re)registered (ms since the epoch; a restart makes a new one)."""

    replica_id: str
    endpoint: str
    version: int | None
    ttl_ms: int
    role: str = "rollout"
    registered_ms: int = 0


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def _opt_int(x: bytes | str | None) -> int | None:
    return None if x is None or _s(x) == "" else int(_s(x))


_PUBLISH = """
local cur = redis.call('GET', KEYS[1])
if cur and tonumber(cur) >= tonumber(ARGV[1]) then return {0, cur} end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('SET', KEYS[1], ARGV[1])
return {1, redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'type', 'weights_published', 'version', ARGV[1])}
"""
_PUT_SCALES = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1} end
local cur = redis.call('GET', KEYS[2])
if cur then if cur == ARGV[1] then return {0} end return {-2} end
redis.call('SET', KEYS[2], ARGV[1])
return {1, redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'type', 'scales_published', 'version', ARGV[2])}
"""
_REGISTER = """
redis.call('DEL', KEYS[1])
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], 'endpoint', ARGV[2], 'version', ARGV[3], 'ttl_ms', ARGV[4], 'role', ARGV[6],
           'registered_ms', tostring(tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)))
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', 'type', 'replica_registered', 'version', ARGV[3],
           'replica', ARGV[1], 'role', ARGV[6])
return 1
"""
_HEARTBEAT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'version', ARGV[1])
redis.call('PEXPIRE', KEYS[1], redis.call('HGET', KEYS[1], 'ttl_ms'))
return 1
"""
_ACK = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('EXISTS', KEYS[2]) == 0 then return -2 end
redis.call('SADD', KEYS[3], ARGV[1])
redis.call('HSET', KEYS[1], 'version', ARGV[2])
return 1
"""
_FENCE = """
local had = redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'type', 'replica_fenced', 'version', ARGV[2],
           'replica', ARGV[1], 'reason', 'refit_timeout')
return had
"""
_PRUNE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if redis.call('SREM', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[2], '*', 'type', 'replica_fenced', 'version', '',
           'replica', ARGV[1], 'reason', 'lease_expired')
return 1
"""
_RELEASE = """
redis.call('DEL', KEYS[1])
return redis.call('SREM', KEYS[2], ARGV[1])
"""

class RefitStore:
    """The refit protocol's Redis state of one job.

    Args:
        client: a ``redis.Redis`` made with ``decode_responses=False`` (see :func:`connect`).
        job: the job id.
        events_maxlen: approximate cap on the events stream length.
    """

    def __init__(self, client: redis.Redis, job: str, *, events_maxlen: int = 10_000) -> None:
        if client.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("RefitStore needs a Redis client with decode_responses=False (manifests/scales are bytes)")
        self.client = client
        self.keys = Keys(job)
        self.job = self.keys.job
        self.events_maxlen = events_maxlen
        self._scripts = {
            name: client.register_script(src) for name, src in (
                ("publish", _PUBLISH), ("put_scales", _PUT_SCALES), ("register", _REGISTER),
                ("heartbeat", _HEARTBEAT), ("ack", _ACK), ("fence", _FENCE), ("prune", _PRUNE),
                ("release", _RELEASE),
            )
        }

    # -- weights ------------------------------------------------------------------------------
    def publish(self, manifest: Manifest) -> str:
        """Store ``manifest`` and advance ``weights:latest`` to its version, atomically.

        Returns:
            the id of the ``weights_published`` event.

        Raises:
            StaleVersionError: ``weights:latest`` is already >= ``manifest.version`` (nothing written).
            ValueError: the manifest belongs to another job.
        """
        if manifest.job != self.job:
            raise ValueError(f"manifest of job {manifest.job!r} cannot be published in job {self.job!r}")
        v = manifest.version
        k = self.keys
        won, detail = self._scripts["publish"](
            keys=[k.latest(), k.manifest(v), k.events()], args=[v, manifest.to_json_bytes(), self.events_maxlen]
        )
        if not won:
            raise StaleVersionError(v, int(_s(detail)))
        return _s(detail)

    def latest(self) -> int | None:
        """The newest published version, or None before the first publish."""
        return _opt_int(self.client.get(self.keys.latest()))

    def get_manifest(self, version: int) -> Manifest | None:
        """Version ``version``'s manifest, or None if it was never published."""
        data = self.client.get(self.keys.manifest(version))
        if data is None:
            return None
        m = Manifest.from_json_bytes(data)
        if m.version != version or m.job != self.job:
            raise RefitError(f"manifest stored for {self.job} v{version} describes {m.job} v{m.version}")
        return m

    def put_delta(self, manifest: Manifest) -> None:
        """Store a delta manifest (``manifest.base`` set) of a version about to be published (before it is)."""
        if manifest.base is None or manifest.job != self.job:
            raise ValueError(f"not a delta manifest of job {self.job!r}: base {manifest.base}, job {manifest.job!r}")
        self.client.set(self.keys.delta(manifest.version), manifest.to_json_bytes())

    def get_delta(self, version: int) -> Manifest | None:
        """Version ``version``'s delta manifest, or None when it was published whole only."""
        data = self.client.get(self.keys.delta(version))
        if data is None:
            return None
        m = Manifest.from_json_bytes(data)
        if m.version != version or m.job != self.job or m.base is None:
            raise RefitError(f"delta manifest stored for {self.job} v{version} describes {m.job} v{m.version} "
                             f"(base {m.base})")
        return m

    def mark_restored(self, version: int, from_version: int) -> None:
        """Record that ``version`` (about to be published) carries the weights of checkpoint ``from_version``.

        A trainer restarted from a checkpoint older than ``weights:latest`` cannot publish that old
        version again (versions only increase), so it republishes the checkpoint's weights under the
        next free version; the controller reads this record to rewind the job to the checkpoint's step.
        """
        validate_version(from_version)
        self.client.set(self.keys.restored_from(version), from_version)

    def restored_from(self, version: int) -> int | None:
        """The checkpoint version that ``version`` republished, or None for an ordinary train step."""
        return _opt_int(self.client.get(self.keys.restored_from(version)))

    def mark_trained(self, version: int, from_version: int) -> None:
        """Record that ``version`` (about to be published) is the optimizer step taken from ``from_version``.

        With :meth:`mark_restored` this is each version's lineage in Redis: the controller reads it to
        learn where a job stands after a restart instead of inferring versions by arithmetic.
        """
        validate_version(from_version)
        self.client.set(self.keys.trained_from(version), from_version)

    def trained_from(self, version: int) -> int | None:
        """The version whose optimizer step produced ``version``, or None (initial weights, a republish)."""
        return _opt_int(self.client.get(self.keys.trained_from(version)))

    # -- QKV scales ---------------------------------------------------------------------------
    def put_scales(self, scales: QKVScales) -> str | None:
        """Store the FP32 Q/K/V scales calibrated on ``scales.version`` and announce them.

        Putting the identical scale set again is a no-op (returns None); a different one is refused.

        Returns:
            the ``scales_published`` event id, or None when the same scales were already stored.

        Raises:
            UnknownVersionError: no manifest exists for ``scales.version``.
            RefitError: other scales are already stored for that version.
        """
        v = validate_version(scales.version)
        k = self.keys
        res = self._scripts["put_scales"](
            keys=[k.manifest(v), k.scales(v), k.events()], args=[encode_scales(scales), v, self.events_maxlen]
        )
        if res[0] == -1:
            raise UnknownVersionError(f"no manifest for weight version {v}: publish the weights before their scales")
        if res[0] == -2:
            raise RefitError(f"different QKV scales are already stored for weight version {v}; scales are immutable")
        return _s(res[1]) if res[0] == 1 else None

    def get_scales(self, version: int) -> QKVScales | None:
        """The scales calibrated on exactly ``version``, or None (never a 1.0 default)."""
        data = self.client.get(self.keys.scales(version))
        return None if data is None else decode_scales(data, version)

    # -- events -------------------------------------------------------------------------------
    def last_event_id(self) -> str:
        """Id of the newest event ("0-0" when the stream is empty); use it to read only new events."""
        last = self.client.xrevrange(self.keys.events(), count=1)
        return _s(last[0][0]) if last else "0-0"

    def events(self, after_id: str = "0-0", block_ms: int | None = None, count: int = 100) -> list[Event]:
        """Events strictly after ``after_id``, oldest first.

        Args:
            after_id: a stream id from a previous :class:`Event` ("0-0" for all, see :meth:`last_event_id`).
            block_ms: when nothing is there yet, wait up to this long for a new event (None: do not wait).
                Must stay below the client's socket timeout.
            count: most events returned.
        """
        key = self.keys.events()
        out = self._range(key, after_id, count)
        if not out and block_ms:
            timeout = self.client.connection_pool.connection_kwargs.get("socket_timeout")
            if timeout is not None and block_ms / 1000.0 >= timeout:
                raise ValueError(f"block_ms={block_ms} must be below the client's socket timeout ({timeout} s)")
            self.client.xread({key: after_id}, count=1, block=block_ms)
            out = self._range(key, after_id, count)
        return out

    def _range(self, key: str, after_id: str, count: int) -> list[Event]:
        # XRANGE with an exclusive start: its reply has one shape under RESP2 and RESP3 alike.
        events = []
        for eid, fields in self.client.xrange(key, min=f"({after_id}", count=count):
            pairs = fields.items() if isinstance(fields, dict) else zip(fields[::2], fields[1::2], strict=True)
            f = {_s(a): _s(b) for a, b in pairs}
            events.append(Event(_s(eid), f.get("type", ""), _opt_int(f.get("version")), f.get("replica"),
                                f.get("reason")))
        return events

    # -- replica leases and acks -------------------------------------------------------------
    def register_replica(self, replica_id: str, endpoint: str, version: int | None, ttl_s: float,
                         role: str = "rollout") -> None:
        """Create (or replace) ``replica_id``'s lease of ``role`` (one of :data:`ROLES`), valid for ``ttl_s``
        unless renewed. Replacing a lease (a restart under the same id) is not a fence: no event but
        ``replica_registered``."""
        validate_replica_id(replica_id)
        if role not in ROLES:
            raise ValueError(f"unknown lease role {role!r}; known roles: {', '.join(ROLES)}")
        ttl_ms = self._ttl_ms(ttl_s)
        k = self.keys
        self._scripts["register"](
            keys=[k.replica(replica_id), k.replica_index(), k.events()],
            args=[replica_id, endpoint, "" if version is None else validate_version(version), ttl_ms,
                  self.events_maxlen, role],
        )

    def release(self, replica_id: str) -> bool:
        """Drop ``replica_id``'s lease on a clean shutdown (no ``replica_fenced`` event); whether it was held."""
        k = self.keys
        return bool(self._scripts["release"](keys=[k.replica(replica_id), k.replica_index()], args=[replica_id]))

    def heartbeat(self, replica_id: str, version: int | None) -> bool:
        """Renew the lease for another TTL and record the held version.

        Returns:
            False if the lease had expired or was fenced: the replica must re-register and pull
            ``weights:latest``.
        """
        v = "" if version is None else validate_version(version)
        return bool(self._scripts["heartbeat"](keys=[self.keys.replica(replica_id)], args=[v]))

    def live_replicas(self, role: str | None = None) -> dict[str, ReplicaLease]:
        """Lease id → lease, for every lease of ``role`` (None: any role) that has not expired.

        Expired ids are pruned here, each emitting one ``replica_fenced`` event with reason
        :data:`FENCE_LEASE_EXPIRED` (whoever reads first emits it; the others see it gone).
        """
        ids = sorted(_s(x) for x in self.client.smembers(self.keys.replica_index()))
        pipe = self.client.pipeline(transaction=False)
        for rid in ids:
            pipe.hgetall(self.keys.replica(rid))
        out: dict[str, ReplicaLease] = {}
        for rid, h in zip(ids, pipe.execute(), strict=True):
            if not h:
                self._scripts["prune"](keys=[self.keys.replica(rid), self.keys.replica_index(), self.keys.events()],
                                       args=[rid, self.events_maxlen])
                continue
            h = {_s(a): b for a, b in h.items()}
            lease = ReplicaLease(rid, _s(h.get("endpoint", b"")), _opt_int(h.get("version")),
                                 int(_s(h.get("ttl_ms", b"0"))), _s(h.get("role", b"rollout")) or "rollout",
                                 int(_s(h.get("registered_ms", b"0")) or 0))
            if role is None or lease.role == role:
                out[rid] = lease
        return out

    def set_graders(self, names: list[str]) -> None:
        """Record the grader names the job's reward service grades with (replacing any earlier record)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.keys.graders())
        if names:
            pipe.sadd(self.keys.graders(), *names)
        pipe.execute()

    def graders(self) -> set[str] | None:
        """The grader names the reward service recorded, or None when it has recorded none yet."""
        names = self.client.smembers(self.keys.graders())
        return {n.decode() if isinstance(n, bytes) else n for n in names} or None

    def set_envs(self, names: list[str], modules: list[str]) -> None:
        """Record the environments the reward service's env workers run: registered ``names`` and the user
        ``modules`` they imported (stored as ``module:`` entries; replacing any earlier record)."""
        entries = [*names, *(f"{m}:" for m in modules)]
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.keys.envs())
        if entries:
            pipe.sadd(self.keys.envs(), *entries)
        pipe.execute()

    def envs(self) -> tuple[set[str], set[str]] | None:
        """``(registered names, user modules)`` the env workers run, or None when none were recorded yet."""
        raw = self.client.smembers(self.keys.envs())
        entries = {n.decode() if isinstance(n, bytes) else n for n in raw}
        if not entries:
            return None
        return {e for e in entries if not e.endswith(":")}, {e[:-1] for e in entries if e.endswith(":")}

    def set_agent_endpoint(self, replica_id: str, base_url: str | None) -> None:
        """Record (None: forget) the base URL of ``replica_id``'s OpenAI-compatible endpoint, where an agent job's
        calls go (:mod:`services.controller.agents`); only replicas with a live lease are used."""
        validate_replica_id(replica_id)
        if base_url is None:
            self.client.hdel(self.keys.agent_endpoints(), replica_id)
        else:
            self.client.hset(self.keys.agent_endpoints(), replica_id, base_url)

    def agent_endpoints(self) -> dict[str, str]:
        """Replica id → the base URL of its OpenAI-compatible endpoint, for every replica that recorded one (its
        lease may have expired: join with :meth:`live_replicas`)."""
        return {_s(a): _s(b) for a, b in self.client.hgetall(self.keys.agent_endpoints()).items()}

    def endpoint_of(self, role: str) -> ReplicaLease | None:
        """The newest live lease of ``role`` (latest registration), or None when none is live."""
        leases = self.live_replicas(role)
        return max(leases.values(), key=lambda ls: (ls.registered_ms, ls.replica_id)) if leases else None

    def ack(self, replica_id: str, version: int) -> None:
        """Record that ``replica_id`` applied ``version`` (weights and scales).

        Raises:
            LeaseExpiredError: the replica holds no live lease (expired or fenced).
            UnknownVersionError: ``version`` was never published.
        """
        k = self.keys
        res = self._scripts["ack"](
            keys=[k.replica(replica_id), k.manifest(version), k.acks(version)], args=[replica_id, version]
        )
        if res == -1:
            raise LeaseExpiredError(
                f"replica {replica_id!r} cannot ack weight version {version}: it holds no live lease "
                f"(expired or fenced); re-register and pull weights:latest"
            )
        if res == -2:
            raise UnknownVersionError(f"replica {replica_id!r} cannot ack weight version {version}: never published")

    def acks(self, version: int) -> set[str]:
        """Replica ids that acked ``version``."""
        return {_s(x) for x in self.client.smembers(self.keys.acks(version))}

    def wait_for_acks(self, version: int, timeout_s: float, poll_s: float = 0.05,
                      role: str = "rollout") -> tuple[list[str], list[str]]:
        """Wait until every live ``role`` lease (the rollout replicas) acked ``version`` or holds a newer one, or
        ``timeout_s`` passes.

        A replica that holds a newer version moved past ``version`` without applying it: a follower goes straight to
        ``weights:latest``, and a rollout replica holding a refit back while multi-turn trajectories are in flight
        (asynchronous GRPO, ``env.partial: finish``) may skip the held-back version when the trainer published the
        next one meanwhile. It serves at least ``version``, which is all the wait is for. A replica whose lease
        expires while we wait stops being waited for (it is not live); with no live replica at all this returns at
        once.

        Returns:
            ``(acked, missing)``: sorted ids that acked ``version`` or hold a newer one, and sorted live ids that
            did neither (fence them).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            live = self.live_replicas(role)
            past = {r for r, ls in live.items() if ls.version is not None and ls.version > version}
            acked = self.acks(version) | past
            missing = sorted(set(live) - acked)
            if not missing or time.monotonic() >= deadline:
                return sorted(acked), missing
            time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))

    def fence(self, replica_id: str, version: int) -> bool:
        """Delete ``replica_id``'s lease (it missed ``version``) and emit ``replica_fenced``.

        Returns:
            whether a live lease was deleted.
        """
        k = self.keys
        had = self._scripts["fence"](
            keys=[k.replica(replica_id), k.replica_index(), k.events()],
            args=[replica_id, validate_version(version), self.events_maxlen],
        )
        return bool(had)

    @staticmethod
    def _ttl_ms(ttl_s: float) -> int:
        if not (isinstance(ttl_s, int | float) and 0 < ttl_s < 86400 * 365):
            raise ValueError(f"lease ttl_s must be > 0 seconds, got {ttl_s!r}")
        return max(1, int(round(ttl_s * 1000)))
