"""Client side of the rollout replicas of one job: find them through their Redis leases, and sample a batch
across all of them, every request pinned to one weight version.

Invariant: every sample returned was produced at the version its request was pinned to (a replica holding
another version refuses with FAILED_PRECONDITION, and a sample claiming another version fails the batch),
and every prompt gets exactly ``n`` samples, in prompt-major order — whatever the split between replicas.
A request is pinned to the batch's version, or (``at_least``, asynchronous GRPO) to the version the chosen
replica holds when that is not older: every sample carries the version that produced it.

Multi-turn trajectories (:meth:`RolloutPool.generate_turn`) are *sticky*: every turn of a trajectory goes to the
replica that served its first, which keeps its K/V under the trajectory's session key; a trajectory whose replica
is gone (suspect, expired, another version) moves to the least loaded live one, which recomputes its history.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc

from fp8rl.controller.plan import split_evenly
from fp8rl.refit import RefitStore
from fp8rl.refit.store import ReplicaLease
from fp8rl.rpc import rollout_pb2
from fp8rl.rpc.channel import DEFAULT_DEADLINE_S

log = logging.getLogger(__name__)

__all__ = ["RolloutError", "RolloutPool"]

# A chunk that failed with one of these is retried on the next replica.
_RETRY = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.FAILED_PRECONDITION,
          grpc.StatusCode.CANCELLED}


class RolloutError(RuntimeError):
    """A batch could not be sampled. ``code`` is the gRPC status of the last failure (None: no replica)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class RolloutPool:
    """The rollout replicas holding live ``rollout`` leases in ``refit``'s job.

    A replica whose Generate fails UNAVAILABLE is *suspect* at once: no chunk goes to that lease (its id
    and registration) for ``suspect_s`` seconds, though Redis may keep it live until its TTL runs out —
    its chunk is re-issued to another replica, or, when none is left, to the first new lease (a
    restarted replica registers afresh, so it is never suspect).

    Args:
        refit: the job's refit state (leases name each replica's endpoint and held version).
        stub: endpoint → ``RolloutServiceStub`` (the caller owns and caches the channels).
        attempts: Generate calls for one prompt chunk before the batch fails.
        suspect_s: how long a lease that failed UNAVAILABLE gets no work.
    """

    def __init__(self, refit: RefitStore, stub: Callable[[str], object], attempts: int = 3,
                 suspect_s: float = 30.0) -> None:
        self.refit, self.stub, self.attempts, self.suspect_s = refit, stub, attempts, suspect_s
        self._suspect: dict[tuple[str, int], float] = {}  # (replica id, registered_ms) -> monotonic expiry
        self._lock = threading.Lock()

    @staticmethod
    def _key(lease: ReplicaLease) -> tuple[str, int]:
        return lease.replica_id, lease.registered_ms

    def suspect(self, lease: ReplicaLease) -> None:
        """Give ``lease`` no work for ``suspect_s`` seconds."""
        with self._lock:
            self._suspect[self._key(lease)] = time.monotonic() + self.suspect_s

    def _usable(self, lease: ReplicaLease) -> bool:
        with self._lock:
            until = self._suspect.get(self._key(lease))
            if until is not None and until <= time.monotonic():
                del self._suspect[self._key(lease)]
                until = None
            return until is None

    def live(self, version: int, at_least: bool = False) -> list[ReplicaLease]:
        """The live, non-suspect rollout leases holding ``version`` (or, ``at_least``, a newer one), by replica id."""
        return [ls for _, ls in sorted(self.refit.live_replicas("rollout").items())
                if (ls.version == version or at_least and ls.version is not None and ls.version > version)
                and self._usable(ls)]

    def wait_live(self, version: int, wait_s: float, tick: Callable[[], None] = lambda: None,
                  at_least: bool = False) -> list[ReplicaLease]:
        """:meth:`live`, waiting up to ``wait_s`` for one; ``tick`` runs between polls (it may raise to stop)."""
        deadline = time.monotonic() + wait_s
        while True:
            found = self.live(version, at_least)
            if found:
                return found
            if time.monotonic() > deadline:
                held = {rid: ls.version for rid, ls in self.refit.live_replicas("rollout").items()}
                raise RolloutError(f"no live rollout replica holds weight version {version} after {wait_s:g} s "
                                   f"(live leases and the versions they hold: {held}; suspect ones get no work)")
            tick()
            time.sleep(0.25)

    def replicas(self, version: int, wait_s: float, tick: Callable[[], None] = lambda: None) -> list[str]:
        """Endpoints of :meth:`wait_live`."""
        return [ls.endpoint for ls in self.wait_live(version, wait_s, tick)]

    def generate_turn(self, prompts: list[list[int]], keys: list[str], version: int, *, sampling: dict,
                      seed_of: Callable[[int], int], request_id: str, wait_s: float,
                      sticky: dict[str, tuple[str, int]], pins: dict[str, int] | None = None,
                      tick: Callable[[], None] = lambda: None, at_least: bool = False,
                      max_weight_lag: int = 0) -> list[rollout_pb2.Sample]:
        """One sample of every prompt, in order: one turn of the trajectories ``keys`` (their session keys), each at
        ``version`` — or (``at_least``, asynchronous GRPO) at the version its first turn was served at, recorded in
        ``pins``, which is at least ``version``. ``sticky`` (the caller's, kept across the turns) maps each key to
        the replica (id, registration) that holds its K/V; a key without a live owner holding its version goes to
        the least loaded replica that holds it (a new key: any live one). The prompts of one replica go in one
        request, seeded ``seed_of(first index)``, carrying ``max_weight_lag`` (a replica holds newer versions
        back, up to that many, while the trajectories are in flight). A replica that fails as :meth:`generate`
        retries is left (UNAVAILABLE: suspect) and its prompts move to another, up to ``attempts`` tries.

        Raises:
            RolloutError: as :meth:`generate`; also when no live replica holds a trajectory's version.
        """
        pins = {} if pins is None else pins
        out: list[rollout_pb2.Sample | None] = [None] * len(prompts)
        todo = list(range(len(prompts)))
        for attempt in range(self.attempts):
            replicas = {self._key(ls): ls for ls in self.wait_live(version, wait_s, tick, at_least)}
            load = {k: 0 for k in replicas}
            for owner in sticky.values():
                if owner in load:
                    load[owner] += 1
            groups: dict[tuple[str, int], list[int]] = {}
            for i in todo:
                owner, pin = sticky.get(keys[i]), pins.get(keys[i], None if at_least else version)
                if owner not in replicas or (pin is not None and replicas[owner].version != pin):
                    # new, or its replica is gone: it re-prefills on the least loaded one holding its version
                    fits = [o for o in replicas if pin is None or replicas[o].version == pin]
                    if not fits:
                        raise RolloutError(f"no live rollout replica holds weight version {pin}, which trajectory "
                                           f"{keys[i][:80]!r} is sampled at (live: "
                                           f"{ {ls.replica_id: ls.version for ls in replicas.values()} })",
                                           grpc.StatusCode.UNAVAILABLE)
                    owner = min(fits, key=lambda k: (load[k], k))
                    sticky[keys[i]] = owner
                    load[owner] += 1
                groups.setdefault(owner, []).append(i)
            # a group's version: its replica's (asynchronous) or the batch's; every pinned key in it holds it (above)
            pinned_of = {o: (replicas[o].version if at_least else version) for o in groups}

            def run(owner: tuple[str, int], idx: list[int], replicas=replicas, pinned_of=pinned_of
                    ) -> tuple[list[int], list | grpc.RpcError]:
                lease = replicas[owner]
                req = rollout_pb2.GenerateRequest(
                    request_id=f"{request_id}-p{idx[0]}", weight_version=pinned_of[owner],
                    prompts=[rollout_pb2.Prompt(token_ids=prompts[i]) for i in idx],
                    session_keys=[keys[i] for i in idx], max_weight_lag=max_weight_lag,
                    sampling=rollout_pb2.SamplingParams(n=1, seed=seed_of(idx[0]), **sampling))
                try:
                    return idx, [r.sample for r in self.stub(lease.endpoint).Generate(
                        req, timeout=DEFAULT_DEADLINE_S.generate)]
                except grpc.RpcError as err:
                    return idx, err

            with ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="generate-turn") as ex:
                results = list(ex.map(lambda g: (g[0], *run(*g)), groups.items()))
            todo = []
            for owner, idx, got in results:
                if isinstance(got, grpc.RpcError):
                    lease = replicas[owner]
                    if got.code() not in _RETRY or attempt + 1 == self.attempts:
                        raise RolloutError(f"Generate on {lease.endpoint}: {got.code().name}: {got.details()}",
                                           got.code())
                    if got.code() == grpc.StatusCode.UNAVAILABLE:
                        self.suspect(lease)
                    log.warning("Generate on %s (%s) failed (%s); its %d trajectories move to another replica",
                                lease.replica_id, lease.endpoint, got.code().name, len(idx))
                    for i in idx:
                        sticky.pop(keys[i], None)
                    todo += idx
                    continue
                pinned = pinned_of[owner]
                for i in idx:  # a trajectory is pinned once a turn of it was sampled (a refused first turn is not)
                    pins[keys[i]] = pinned
                for s in got:
                    if s.weight_version != pinned or s.sample_index != 0 or not 0 <= s.prompt_index < len(idx):
                        raise RolloutError(f"a replica returned a sample of version {s.weight_version} (prompt "
                                           f"{s.prompt_index}, index {s.sample_index}) for a turn pinned to {pinned}")
                    out[idx[s.prompt_index]] = s
            if not todo:
                break
        if any(s is None for s in out):
            raise RolloutError("replicas returned fewer samples than the turn's prompts")
        return out

    def release(self, keys: list[str], sticky: dict[str, tuple[str, int]]) -> None:
        """Tell each replica holding some of ``keys`` (per ``sticky``) to drop their K/V; a replica that does not
        answer is skipped (its sessions age out of its bounded cache)."""
        live = {self._key(ls): ls for ls in self.refit.live_replicas("rollout").values()}
        by_owner: dict[tuple[str, int], list[str]] = {}
        for k in keys:
            if (owner := sticky.get(k)) in live:
                by_owner.setdefault(owner, []).append(k)
        for owner, ks in by_owner.items():
            try:
                self.stub(live[owner].endpoint).ReleaseSessions(
                    rollout_pb2.ReleaseSessionsRequest(session_keys=ks), timeout=DEFAULT_DEADLINE_S.status)
            except grpc.RpcError as err:
                log.info("ReleaseSessions on %s failed (%s); its sessions age out", live[owner].endpoint,
                         err.code().name)

    def generate(self, prompts: list[list[int]], version: int, *, n: int, sampling: dict,
                 seed_of: Callable[[int], int], request_id: str, wait_s: float,
                 tick: Callable[[], None] = lambda: None, at_least: bool = False,
                 images: Sequence[Sequence[bytes]] | None = None) -> list[tuple[int, rollout_pb2.Sample]]:
        """``n`` samples of every prompt at ``version`` (``at_least``: at it or at the newer version the replica
        serving the chunk holds), prompt-major, as ``(prompt index, sample)``.

        The prompts are cut into one contiguous chunk per replica; chunk ``[a, b)`` is sampled with
        ``seed_of(a)`` so a chunk draws the same samples whichever replica serves it.

        Args:
            sampling: ``SamplingParams`` fields other than ``n`` and ``seed``.
            images: a vision-language job's: per prompt its image files (``Prompt.images``), or None.

        Raises:
            RolloutError: no replica holds ``version``, a chunk failed on every try, or replicas
                returned a wrong version or too few samples.
        """
        replicas = self.wait_live(version, wait_s, tick, at_least)
        chunks = split_evenly(len(prompts), len(replicas))

        def run(i: int, a: int, b: int) -> tuple[int, list[rollout_pb2.Sample]]:
            lease = replicas[i]
            for attempt in range(self.attempts):
                pinned = lease.version if at_least else version
                req = rollout_pb2.GenerateRequest(
                    request_id=f"{request_id}-p{a}", weight_version=pinned,
                    prompts=[rollout_pb2.Prompt(token_ids=prompts[j], images=images[j] if images else ())
                             for j in range(a, b)],
                    sampling=rollout_pb2.SamplingParams(n=n, seed=seed_of(a), **sampling))
                try:
                    return pinned, [r.sample for r in self.stub(lease.endpoint).Generate(
                        req, timeout=DEFAULT_DEADLINE_S.generate)]
                except grpc.RpcError as err:
                    if err.code() not in _RETRY or attempt + 1 == self.attempts:
                        raise RolloutError(f"Generate on {lease.endpoint}: {err.code().name}: {err.details()}",
                                           err.code()) from None
                    if err.code() == grpc.StatusCode.UNAVAILABLE:
                        self.suspect(lease)
                    log.warning("Generate on %s (%s) failed (%s); re-issuing the chunk to another replica%s",
                                lease.replica_id, lease.endpoint, err.code().name,
                                " (this one is suspect)" if err.code() == grpc.StatusCode.UNAVAILABLE else "")
                    others = [ls for ls in self.live(version, at_least) if self._key(ls) != self._key(lease)]
                    lease = others[(i + attempt) % len(others)] if others else \
                        self.wait_live(version, wait_s, tick, at_least)[0]
            raise AssertionError("unreachable")
        with ThreadPoolExecutor(max_workers=len(chunks), thread_name_prefix="generate") as ex:
            results = list(ex.map(lambda c: run(c[0], *c[1]), enumerate(chunks)))
        groups: list[list] = [[None] * n for _ in prompts]
        for (a, _), (pinned, samples) in zip(chunks, results, strict=True):
            for s in samples:
                if s.weight_version != pinned or not 0 <= s.sample_index < n:
                    raise RolloutError(f"a replica returned a sample of version {s.weight_version} (index "
                                       f"{s.sample_index}) for a request pinned to {pinned} with n={n}")
                groups[a + s.prompt_index][s.sample_index] = s
        if any(s is None for grp in groups for s in grp):
            raise RolloutError(f"replicas returned fewer than {n} samples for some prompt")
        return [(i, s) for i, grp in enumerate(groups) for s in grp]
