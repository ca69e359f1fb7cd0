"""The controller's job state in Redis: one record per job, its step reports, and the jobs index.

Layout (``P = fp8rl:{job}:``; ``job:state``, ``job:step``, ``job:config`` and ``fp8rl:jobs`` come from
:class:`fp8rl.refit.keys.Keys`; ``job:info`` and ``job:reports`` also from it)::

    P job:state     string  pending | running | succeeded | failed | cancelled
    P job:step      int     last finished step (absent before the first)
    P job:config    bytes   the submitted job YAML, as given
    P job:info      hash    created_unix, updated_unix, total_steps, error, cancel_reason,
                            start_version, next_version, checkpoint_path, checkpoint_version,
                            inflight (JSON)
    P job:reports   list    one JSON step report per finished step; index == step
    fp8rl:jobs      set     every job id (the authority on which ids are taken)
    fp8rl:jobs:created      zset  every stored job id by submission time (ListJobs pages through it)
    fp8rl:jobs:state:{s}    zset  the ids in state s by submission time (the queue: the runner reads its head)
    fp8rl:jobs:finished     zset  terminal ids by the time they ended (retention deletes from its head)

Invariants:

* A step is finished exactly when its report is in ``job:reports``: the report, ``job:step``, the
  state after it, ``next_version`` and ``updated_unix`` are written in one MULTI, so a crash never
  leaves half of it.
* Versions are recorded, never computed: each report's ``weight_version`` is the version its step
  started from, and ``next_version`` the one the next step starts from (the trainer's update of the last
  recorded step, or the version a resume moved the job to; see :mod:`fp8rl.controller.reconcile`).
* State changes that race (a pending job being cancelled while the runner picks it up) go through
  :meth:`JobStore.transition`, a compare-and-set: of two racers exactly one wins.
* Terminal states (succeeded, failed, cancelled) never change again.
* The indexes move with the state in the same script (:data:`_SET_STATE`), so a job is in exactly the
  state zset of its state: listing, the queue and retention read an index, never scan every job.
* Bounded: :meth:`JobStore.create` refuses a job past ``max_jobs`` stored or ``max_queued`` pending
  (:class:`JobLimitError`); :meth:`JobStore.prune` deletes terminal jobs past an age or a count, every key
  of them. Only terminal jobs are ever deleted.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

import redis

from fp8rl.refit.keys import Keys, validate_job_id

__all__ = ["JOB_STATES", "TERMINAL_STATES", "JobExistsError", "JobLimitError", "JobRecord", "JobStore"]

JOB_STATES = ("pending", "running", "succeeded", "failed", "cancelled")
TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})


class JobExistsError(ValueError):
    """A job with this id was already submitted."""


class JobLimitError(RuntimeError):
    """The store holds as many jobs (or pending jobs) as it may: nothing was created."""


@dataclass(frozen=True)
class JobRecord:
    """One job as stored.

    Attributes:
        job_id: the job.
        state: one of :data:`JOB_STATES`.
        steps_done: finished steps (== number of reports).
        total_steps: steps the job runs in total (``job.steps``).
        error: why it failed ("" otherwise).
        created_unix, updated_unix: submission time and time of the last change.
        cancel_reason: set once cancellation was requested ("" otherwise).
        start_version: the version step 0 started from (None before the first step).
        next_version: the version the next step starts from (None before the first step): the new
            version of the last recorded step, or where a resume moved the job.
        checkpoint_path, checkpoint_version: the newest checkpoint written for the job.
        rollouts_begun: the newest step whose rollout a controller began (None before the first): a controller that
            resumes the job re-runs the begun steps past ``steps_done`` from their plan and counts their rollouts
            as restarted (``resume/rollouts_restarted``).
    """

    job_id: str
    state: str
    steps_done: int = 0
    total_steps: int = 0
    error: str = ""
    created_unix: float = 0.0
    updated_unix: float = 0.0
    cancel_reason: str = ""
    start_version: int | None = None
    next_version: int | None = None
    checkpoint_path: str = ""
    checkpoint_version: int | None = None
    rollouts_begun: int | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def cancel_requested(self) -> bool:
        return bool(self.cancel_reason)


def _s(x: bytes | str | None) -> str:
    return "" if x is None else x.decode() if isinstance(x, bytes) else x


def _opt_int(x: bytes | str | None) -> int | None:
    return None if _s(x) == "" else int(_s(x))


def _parse_cursor(cursor: str) -> tuple[float, str]:
    """``"<score>/<job id>"`` (what :meth:`JobStore.page` returns) → its parts; ValueError for anything else."""
    score, sep, job_id = cursor.partition("/")
    try:
        value = float(score)
        validate_job_id(job_id)
    except ValueError:
        value = math.nan
    if not sep or not math.isfinite(value):
        raise ValueError(f"page_token {cursor[:80]!r} is not a token ListJobs returned")
    return value, job_id


# KEYS: job:state, job:info, jobs:finished, jobs:created, jobs:state:<each of JOB_STATES, in order>
# ARGV: job_id, to_state, now, error ("" sets none), from_state... (none: unconditional)
# The state, its error and every index change together: a reader never sees one without the other.
_SET_STATE = """
local cur = redis.call('GET', KEYS[1])
if #ARGV > 4 then
  local ok = false
  for i = 5, #ARGV do
    if cur == ARGV[i] then ok = true end
  end
  if not ok then return 0 end
end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('HSET', KEYS[2], 'updated_unix', ARGV[3])
if ARGV[4] ~= '' then
  redis.call('HSET', KEYS[2], 'error', ARGV[4])
end
local score = redis.call('ZSCORE', KEYS[4], ARGV[1]) or ARGV[3]
for i = 5, #KEYS do
  redis.call('ZREM', KEYS[i], ARGV[1])
end
local states = {STATE_LIST}
for i, s in ipairs(states) do
  if s == ARGV[2] then redis.call('ZADD', KEYS[4 + i], score, ARGV[1]) end
end
if ARGV[2] == 'succeeded' or ARGV[2] == 'failed' or ARGV[2] == 'cancelled' then
  redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
end
return 1
""".replace("STATE_LIST", ", ".join(f"'{s}'" for s in JOB_STATES))

# KEYS: jobs (set), jobs:created, jobs:state:pending, job:config, job:info, job:state
# ARGV: job_id, now, yaml, total_steps, max_jobs (0: no cap), max_queued (0: no cap)
_CREATE = """
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return -1 end
local max_jobs, max_queued = tonumber(ARGV[5]), tonumber(ARGV[6])
if max_jobs > 0 and redis.call('ZCARD', KEYS[2]) >= max_jobs then return -2 end
if max_queued > 0 and redis.call('ZCARD', KEYS[3]) >= max_queued then return -3 end
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
redis.call('SET', KEYS[4], ARGV[3])
redis.call('HSET', KEYS[5], 'created_unix', ARGV[2], 'updated_unix', ARGV[2], 'total_steps', ARGV[4],
           'error', '', 'cancel_reason', '')
redis.call('SET', KEYS[6], 'pending')
return 1
"""

# KEYS: jobs (set), jobs:created, jobs:finished, jobs:state:<each state>, then the job's own keys
# ARGV: job_id. Deletes only a terminal job (a running one is never pulled from under the runner).
_DELETE = """
local st = redis.call('GET', KEYS[#KEYS - 4])
if st ~= false and st ~= 'succeeded' and st ~= 'failed' and st ~= 'cancelled' then return 0 end
for i = 1, 3 + NSTATES do
  if i == 1 then redis.call('SREM', KEYS[i], ARGV[1]) else redis.call('ZREM', KEYS[i], ARGV[1]) end
end
redis.call('DEL', unpack(KEYS, 4 + NSTATES))
return 1
""".replace("NSTATES", str(len(JOB_STATES)))

_PRUNE_BATCH = 500  # jobs deleted per prune() call at most: one call stays short however large the backlog


class JobStore:
    """Jobs of one controller deployment, kept in Redis (thread-safe: one client, no local state).

    Args:
        client: a ``redis.Redis`` (either ``decode_responses`` setting works).
        max_jobs: most jobs stored at once (0: no cap); :meth:`create` refuses more.
        max_queued: most pending jobs at once (0: no cap).
    """

    def __init__(self, client: redis.Redis, *, max_jobs: int = 0, max_queued: int = 0) -> None:
        if max_jobs < 0 or max_queued < 0:
            raise ValueError(f"max_jobs and max_queued must be >= 0, got {max_jobs}, {max_queued}")
        self.client, self.max_jobs, self.max_queued = client, max_jobs, max_queued
        self._set_state = client.register_script(_SET_STATE)
        self._create = client.register_script(_CREATE)
        self._delete = client.register_script(_DELETE)

    @staticmethod
    def _state_keys(job_id: str) -> list[str]:
        k = Keys(job_id)
        return [k.job_state(), k.job_info(), Keys.jobs_finished(), Keys.jobs_created(),
                *(Keys.jobs_in_state(s) for s in JOB_STATES)]

    # -- create and read ----------------------------------------------------------------------
    def create(self, job_id: str, job_yaml: str, total_steps: int) -> JobRecord:
        """Record a new pending job.

        Raises:
            ValueError: ``job_id`` is not a valid id (the message says which characters are allowed).
            JobExistsError: the id is taken.
            JobLimitError: ``max_jobs`` jobs are stored, or ``max_queued`` are pending.
        """
        k = Keys(validate_job_id(job_id))
        got = self._create(keys=[Keys.jobs_index(), Keys.jobs_created(), Keys.jobs_in_state("pending"),
                                 k.job_config(), k.job_info(), k.job_state()],
                           args=[job_id, time.time(), job_yaml.encode(), total_steps, self.max_jobs, self.max_queued])
        if got == -1:
            raise JobExistsError(f"job id {job_id!r} is already taken; pick another or leave it unset")
        if got == -2:
            raise JobLimitError(f"{self.max_jobs} jobs are stored (the limit, --max-jobs): wait for finished ones to "
                                f"expire (--job-retention-s, --max-finished-jobs)")
        if got == -3:
            raise JobLimitError(f"{self.max_queued} jobs are pending (the limit, --max-queued-jobs): wait for the "
                                f"queue to drain or cancel some")
        return self.get(job_id)

    def get(self, job_id: str) -> JobRecord | None:
        """The job, or None when no job has this id (an invalid id is simply unknown)."""
        return self.get_many([job_id])[0]

    def get_many(self, job_ids: list[str]) -> list[JobRecord | None]:
        """The jobs (None for unknown ids), read in one round trip."""
        pipe = self.client.pipeline(transaction=True)
        valid = []
        for job_id in job_ids:
            try:
                k = Keys(job_id)
            except ValueError:
                valid.append(False)
                continue
            valid.append(True)
            pipe.get(k.job_state())
            pipe.hgetall(k.job_info())
            pipe.llen(k.job_reports())
        raw = iter(pipe.execute() if any(valid) else [])
        return [self._record(job_id, next(raw), next(raw), next(raw)) if ok else None
                for job_id, ok in zip(job_ids, valid, strict=True)]

    @staticmethod
    def _record(job_id: str, state, info, n) -> JobRecord | None:
        if state is None:
            return None
        f = {_s(a): _s(b) for a, b in info.items()}
        return JobRecord(
            job_id=job_id, state=_s(state), steps_done=int(n), total_steps=int(f.get("total_steps") or 0),
            error=f.get("error", ""), created_unix=float(f.get("created_unix") or 0.0),
            updated_unix=float(f.get("updated_unix") or 0.0), cancel_reason=f.get("cancel_reason", ""),
            start_version=_opt_int(f.get("start_version")),
            next_version=_opt_int(f.get("next_version")), checkpoint_path=f.get("checkpoint_path", ""),
            checkpoint_version=_opt_int(f.get("checkpoint_version")),
            rollouts_begun=_opt_int(f.get("rollouts_begun")),
        )

    def config_text(self, job_id: str) -> str:
        """The job YAML as submitted."""
        return _s(self.client.get(Keys(job_id).job_config()))

    def page(self, state: str = "", limit: int = 100, after: str = "") -> tuple[list[JobRecord], str]:
        """One page of jobs, newest first, optionally only those in ``state``: at most ``limit`` of them, after
        the cursor ``after`` ("" = from the newest). Returns the jobs and the cursor of the next page ("" at
        the end). Reads ``limit`` index entries and their records, never every job.

        Raises:
            ValueError: ``after`` is not a cursor this method returned, or ``limit`` < 1.
        """
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        key = Keys.jobs_in_state(state) if state else Keys.jobs_created()
        if after:
            score, last = _parse_cursor(after)
            ties = int(self.client.zcount(key, score, score))  # entries sharing the cursor's score: skip the seen
            raw = self.client.zrevrangebyscore(key, score, "-inf", start=0, num=limit + ties, withscores=True)
            # equal scores come in reverse lexical order: those >= the cursor's id were on earlier pages
            raw = [(m, sc) for m, sc in raw if not (sc == score and _s(m) >= last)][:limit]
        else:
            raw = self.client.zrevrangebyscore(key, "+inf", "-inf", start=0, num=limit, withscores=True)
        ids = [_s(m) for m, _ in raw]
        recs = [r for r in self.get_many(ids) if r is not None]
        cursor = f"{raw[-1][1]!r}/{ids[-1]}" if len(raw) == limit else ""
        return recs, cursor

    def list(self, state: str = "", limit: int = 0) -> list[JobRecord]:
        """Jobs newest first, optionally only those in ``state``, at most ``limit`` (0: all — tests and tools only)."""
        if limit > 0:
            return self.page(state, limit)[0]
        key = Keys.jobs_in_state(state) if state else Keys.jobs_created()
        return [r for r in self.get_many([_s(m) for m in self.client.zrevrange(key, 0, -1)]) if r is not None]

    def in_state(self, state: str) -> list[JobRecord]:
        """Jobs in ``state``, oldest first (the queue order)."""
        ids = [_s(m) for m in self.client.zrange(Keys.jobs_in_state(state), 0, -1)]
        return [r for r in self.get_many(ids) if r is not None]

    def first_in_state(self, state: str) -> JobRecord | None:
        """The oldest job in ``state`` (the head of the queue), or None: one index read, whatever the store holds."""
        ids = [_s(m) for m in self.client.zrange(Keys.jobs_in_state(state), 0, 0)]
        return self.get_many(ids)[0] if ids else None

    def count(self, state: str = "") -> int:
        """How many jobs are stored (in ``state``)."""
        return int(self.client.zcard(Keys.jobs_in_state(state) if state else Keys.jobs_created()))

    def ensure_indexes(self) -> int:
        """Index jobs recorded before the indexes existed (an older controller's); returns how many. Idempotent."""
        ids = [_s(j) for j in self.client.smembers(Keys.jobs_index())]
        if len(ids) == self.client.zcard(Keys.jobs_created()):
            return 0
        added = 0
        for job_id, rec in zip(ids, self.get_many(ids), strict=True):
            if rec is None or self.client.zscore(Keys.jobs_created(), job_id) is not None:
                continue
            pipe = self.client.pipeline(transaction=True)
            pipe.zadd(Keys.jobs_created(), {job_id: rec.created_unix})
            pipe.zadd(Keys.jobs_in_state(rec.state), {job_id: rec.created_unix})
            if rec.terminal:
                pipe.zadd(Keys.jobs_finished(), {job_id: rec.updated_unix})
            pipe.execute()
            added += 1
        return added

    # -- retention ----------------------------------------------------------------------------
    def delete(self, job_id: str) -> bool:
        """Delete a terminal job: every key of it and its index entries. False (nothing deleted) when it is not
        terminal; True when it is gone."""
        k = Keys(job_id)
        keys = [Keys.jobs_index(), Keys.jobs_created(), Keys.jobs_finished(), *(Keys.jobs_in_state(s) for s in
                                                                                JOB_STATES),
                k.job_state(), k.job_step(), k.job_config(), k.job_info(), k.job_reports()]
        return bool(self._delete(keys=keys, args=[job_id]))

    def prune(self, max_age_s: float, max_finished: int, now: float | None = None) -> int:
        """Delete terminal jobs that ended more than ``max_age_s`` ago, then the oldest beyond ``max_finished``
        terminal ones (at most 500 per call); returns how many were deleted."""
        now = time.time() if now is None else now
        key = Keys.jobs_finished()
        old = [_s(j) for j in self.client.zrangebyscore(key, "-inf", now - max_age_s, start=0, num=_PRUNE_BATCH)]
        excess = int(self.client.zcard(key)) - len(old) - max_finished
        if excess > 0:
            more = self.client.zrange(key, len(old), len(old) + min(excess, _PRUNE_BATCH - len(old)) - 1)
            old += [_s(j) for j in more]
        return sum(self.delete(j) for j in old)

    # -- state changes ------------------------------------------------------------------------
    def transition(self, job_id: str, to_state: str, from_states: tuple[str, ...], error: str = "") -> bool:
        """Set the state to ``to_state`` (and ``error``, when given) only if it is one of ``from_states`` now, in one
        atomic step (a reader never sees ``failed`` without its error); returns whether it did."""
        if to_state not in JOB_STATES:
            raise ValueError(f"unknown job state {to_state!r}; expected one of {', '.join(JOB_STATES)}")
        if not from_states:
            raise ValueError("transition needs the states it may move from")
        return bool(self._set_state(keys=self._state_keys(job_id),
                                    args=[job_id, to_state, time.time(), error, *from_states]))

    def update(self, job_id: str, **fields: Any) -> None:
        """Set bookkeeping fields of ``job:info`` (None deletes a field) and touch ``updated_unix``."""
        k = Keys(job_id)
        pipe = self.client.pipeline(transaction=True)
        for name, value in fields.items():
            if value is None:
                pipe.hdel(k.job_info(), name)
            else:
                pipe.hset(k.job_info(), name, value)
        pipe.hset(k.job_info(), "updated_unix", time.time())
        pipe.execute()

    def request_cancel(self, job_id: str, reason: str) -> None:
        """Ask the runner to stop the job after its current step (it reads this from Redis)."""
        self.update(job_id, cancel_reason=reason or "cancelled")

    # -- step reports -------------------------------------------------------------------------
    def append_report(self, job_id: str, report: dict, state: str, next_version: int) -> None:
        """Record a finished step, the job's state after it and the version the next step starts from,
        atomically (see the invariants).

        Raises:
            ValueError: ``report["step"]`` is not the next step (steps are recorded in order, once).
        """
        k = Keys(job_id)
        n = self.client.llen(k.job_reports())
        if report["step"] != n:
            raise ValueError(f"job {job_id}: step {report['step']} cannot be recorded after {n} finished steps")
        pipe = self.client.pipeline(transaction=True)
        pipe.rpush(k.job_reports(), json.dumps({**report, "state": state}))
        pipe.set(k.job_step(), report["step"])
        self._set_state(keys=self._state_keys(job_id), args=[job_id, state, time.time(), ""], client=pipe)
        pipe.hdel(k.job_info(), "inflight")
        pipe.hset(k.job_info(), mapping={"next_version": next_version, "updated_unix": time.time()})
        pipe.execute()

    def reports(self, job_id: str, from_step: int = 0) -> list[dict]:
        """Reports of finished steps ``from_step`` onwards, in step order."""
        raw = self.client.lrange(Keys(job_id).job_reports(), max(0, from_step), -1)
        return [json.loads(_s(r)) for r in raw]

    def truncate_reports(self, job_id: str, keep: int) -> None:
        """Forget reports of steps >= ``keep`` (the trainer was rolled back to an older checkpoint)."""
        k = Keys(job_id)
        pipe = self.client.pipeline(transaction=True)
        if keep > 0:
            pipe.ltrim(k.job_reports(), 0, keep - 1)
            pipe.set(k.job_step(), keep - 1)
        else:
            pipe.delete(k.job_reports(), k.job_step())
        pipe.execute()

    # -- the step in flight -------------------------------------------------------------------
    def set_inflight(self, job_id: str, partial: dict | None) -> None:
        """Remember (or forget) the step whose optimizer update applied but whose refit has not finished."""
        self.update(job_id, inflight=None if partial is None else json.dumps(partial))

    def inflight(self, job_id: str) -> dict | None:
        raw = self.client.hget(Keys(job_id).job_info(), "inflight")
        return None if raw is None else json.loads(_s(raw))
