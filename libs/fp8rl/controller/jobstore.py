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
    fp8rl:jobs      set     every job id

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
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import redis

from fp8rl.refit.keys import Keys, validate_job_id

__all__ = ["JOB_STATES", "TERMINAL_STATES", "JobExistsError", "JobRecord", "JobStore"]

JOB_STATES = ("pending", "running", "succeeded", "failed", "cancelled")
TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})


class JobExistsError(ValueError):
    """A job with this id was already submitted."""





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


# ARGV: to_state, now, error ("" sets none), from_state... — the error lands with the state, never after it
_TRANSITION = """
local cur = redis.call('GET', KEYS[1])
for i = 4, #ARGV do
  if cur == ARGV[i] then
    redis.call('SET', KEYS[1], ARGV[1])
    redis.call('HSET', KEYS[2], 'updated_unix', ARGV[2])
    if ARGV[3] ~= '' then
      redis.call('HSET', KEYS[2], 'error', ARGV[3])
    end
    return 1
  end
end
return 0
"""


class JobStore:
    """Jobs of one controller deployment, kept in Redis (thread-safe: one client, no local state).

    Args:
        client: a ``redis.Redis`` (either ``decode_responses`` setting works).
    """

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._transition = client.register_script(_TRANSITION)

    # -- create and read ----------------------------------------------------------------------
    def create(self, job_id: str, job_yaml: str, total_steps: int) -> JobRecord:
        """Record a new pending job.

        Raises:
            ValueError: ``job_id`` is not a valid id (the message says which characters are allowed).
            JobExistsError: the id is taken.
        """
        k = Keys(validate_job_id(job_id))
        if not self.client.sadd(k.jobs_index(), job_id):
            raise JobExistsError(f"job id {job_id!r} is already taken; pick another or leave it unset")
        now = time.time()
        pipe = self.client.pipeline(transaction=True)
        pipe.set(k.job_config(), job_yaml.encode())
        pipe.hset(k.job_info(), mapping={"created_unix": now, "updated_unix": now, "total_steps": total_steps,
                                         "error": "", "cancel_reason": ""})
        pipe.set(k.job_state(), "pending")
        pipe.execute()
        return self.get(job_id)

    def get(self, job_id: str) -> JobRecord | None:
        """The job, or None when no job has this id (an invalid id is simply unknown)."""
        try:
            k = Keys(job_id)
        except ValueError:
            return None
        pipe = self.client.pipeline(transaction=True)
        pipe.get(k.job_state())
        pipe.hgetall(k.job_info())
        pipe.llen(k.job_reports())
        state, info, n = pipe.execute()
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
        )

    def config_text(self, job_id: str) -> str:
        """The job YAML as submitted."""
        return _s(self.client.get(Keys(job_id).job_config()))

    def list(self, state: str = "", limit: int = 0) -> list[JobRecord]:
        """Jobs newest first, optionally only those in ``state``, at most ``limit`` (0: all)."""
        recs = [r for j in self.client.smembers(Keys.jobs_index()) if (r := self.get(_s(j))) is not None]
        recs = sorted((r for r in recs if not state or r.state == state), key=lambda r: (-r.created_unix, r.job_id))
        return recs[:limit] if limit > 0 else recs

    def in_state(self, state: str) -> list[JobRecord]:
        """Jobs in ``state``, oldest first (the queue order)."""
        return list(reversed(self.list(state)))

    # -- state changes ------------------------------------------------------------------------
    def transition(self, job_id: str, to_state: str, from_states: tuple[str, ...], error: str = "") -> bool:
        """Set the state to ``to_state`` (and ``error``, when given) only if it is one of ``from_states`` now, in one
        atomic step (a reader never sees ``failed`` without its error); returns whether it did."""
        if to_state not in JOB_STATES:
            raise ValueError(f"unknown job state {to_state!r}; expected one of {', '.join(JOB_STATES)}")
        k = Keys(job_id)
        args = [to_state, time.time(), error, *from_states]
        return bool(self._transition(keys=[k.job_state(), k.job_info()], args=args))

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
        pipe.set(k.job_state(), state)
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
