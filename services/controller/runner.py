"""The controller's job runner: a queue of GRPO jobs and the step state machine, driven over gRPC.

One job runs at a time; the others wait as ``pending``, oldest first. One step, weight version
v → v+1 (DESIGN §2), runs these phases in order, and is recorded only when all of them finished:

    rollout    Generate pinned to v on every live rollout replica, the prompts split between them
    reward     RewardService.Score of the decoded responses
    train      TrainerService.TrainStep(expected_version=v): prev logprobs + mismatch metrics, loss,
               optimizer → v+1, publish (the trainer reports the logprobs / train / publish times)
    calibrate  CalibratorService.Calibrate(v+1, this step's sequences) → v+1's QKV scales (FP8 KV only)
    refit      wait until every live replica acked v+1; fence the ones that did not in time

Before a job's first step: Calibrate(v, the first step's prompts) when v has no scales yet (FP8-KV
replicas do not serve v without them), then wait for a rollout replica holding v. Every
``job.checkpoint_every`` steps, and when the job ends, TrainerService.SaveCheckpoint.

Restart. The controller keeps nothing that matters in memory (see :mod:`fp8rl.controller.jobstore`); a job
found ``running`` is resumed. No version is computed: the record holds the version each step started
from and ``next_version``; Redis holds each version's lineage (``trained_from``, ``restored_from``, written
by the trainer before it publishes). :func:`fp8rl.controller.reconcile.reconcile` matches them with the
version the trainer holds:

* it holds ``next_version`` → the half-done step never reached TrainStep (or TrainStep failed): it is run
  again from its rollout. Batches and sampling seeds are functions of the step index: the same prompts.
* it holds a version trained from ``next_version`` → the half-done step's optimizer update applied. Its
  data was saved (``inflight``) right after TrainStep, so it is finished from its calibration + refit and
  recorded with its real metrics. (Without that record — a crash in the instant between TrainStep
  returning and the save — it is calibrated on its prompts and recorded with NaN reward/accuracy and
  ``recovered_without_rollout: 1``.)
* it holds a version restored from the checkpoint of the version step k started from → the trainer
  crashed and republished that checkpoint under the next free version (versions only increase): reports
  of steps >= k are dropped and step k continues from the republished version. A checkpoint of step n's
  update (taken after it trained, before its report) finishes step n first.
* it holds the version step k < n started from → reports of steps >= k are dropped, the job continues at k.
* anything else fails the job, naming the versions.

Cancellation is read from Redis between phases: before TrainStep the half-done step is dropped;
after it the step is finished (so replicas end on one consistent version) and recorded as the last.

Faults. Services are found through their role leases in Redis at every call (:class:`Backends`), so one
restarted on another port is reached at the next try. A step whose call fails transiently
(UNAVAILABLE / DEADLINE_EXCEEDED) is retried from the reconcile above, after a back-off that doubles
from ``retry_pause_s``; the budget (``step_attempts``) is per step and starts afresh once a step is
recorded. The report shows ``metrics["retries"]`` and, in ``phase_times.outage``, the time lost to
failed tries and back-off. A rollout replica that fails UNAVAILABLE is marked suspect and its chunk
re-issued to the others (:class:`fp8rl.controller.pool.RolloutPool`). Leases fenced during a step (late
acks, expired leases) are counted in ``metrics["replica_fenced"]``.

Rewards. Only graded items (status GRADED / UNPARSABLE) are trained on: TIMEOUT / ERROR items are
re-scored up to ``score_attempts`` times in all, and if any is still ungraded the job fails naming it —
a placeholder 0 never reaches TrainStep.

Multi-turn jobs (``env.name``). The rollout phase runs every trajectory's turns
(:mod:`services.controller.trajectories`): the environments in the reward service's env workers, the turns on
sticky rollout replicas; the reward is the environment's. A trajectory whose environment crashed, hung or was
lost is ungraded: left out of the loss and of its group's advantages and counted (``env/ungraded``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import redis

from fp8rl import limits
from fp8rl.config import ConfigError, JobConfig, parse_job_config
from fp8rl.config.fields import short
from fp8rl.controller.jobstore import JobLimitError, JobRecord, JobStore
from fp8rl.controller.pictures import step_pictures
from fp8rl.controller.pipeline import Pipeline
from fp8rl.controller.plan import (
    JobPlan,
    check_data,
    check_deployment,
    model_config_of,
    new_job_id,
)
from fp8rl.controller.pool import RolloutPool
from fp8rl.controller.reconcile import Lineage, reconcile
from fp8rl.controller.step import PHASES, finish, first_half
from fp8rl.controller.validation import validate
from fp8rl.data import GRADERS, DataFileError, DataRoot
from fp8rl.envs import env_names, import_paths
from fp8rl.refit import RefitStore
from fp8rl.rpc import trainer_pb2
from fp8rl.rpc.channel import DEFAULT_DEADLINE_S as DL

from .backends import (
    TRANSIENT,
    Backends,
    GrpcStep,
    JobCancelled,
    JobFailed,
    RpcFailed,
    Stopping,
    calibrate_request,
    call,
)

log = logging.getLogger("fp8rl.controller")

__all__ = ["PHASES", "Backends", "JobRunner", "RunnerSettings"]

REPORT_TIMES = (*PHASES, "outage", "total")  # the keys of a report's phase_times


@dataclass(frozen=True)
class RunnerSettings:
    """Timeouts and retries of the runner.

    Attributes:
        refit_timeout_s: how long to wait for every live replica's ack of v+1 before fencing.
        replica_wait_s: how long a step waits for some rollout replica to hold its version.
        generate_attempts: tries of one prompt chunk (each on the next replica) before the step fails.
        step_attempts: tries of one step whose RPC failed transiently (UNAVAILABLE / DEADLINE_EXCEEDED);
            counted afresh for every step.
        retry_pause_s: pause before the first retry of such a step; doubles per retry (at most 30 s).
        score_attempts: Score calls for an item the reward service could not grade (timeout / error)
            before the job fails.
        data: the data root ``data.path`` must lie under, and the byte / row limits of a data file.
        retention_s: seconds a finished job is kept (then deleted, with its reports).
        max_finished: finished jobs kept at most (the oldest beyond are deleted).
    """

    refit_timeout_s: float = 60.0
    replica_wait_s: float = 120.0
    generate_attempts: int = 3
    step_attempts: int = 5
    retry_pause_s: float = 2.0
    score_attempts: int = 3
    data: DataRoot = DataRoot()
    retention_s: float = limits.JOB_RETENTION_S
    max_finished: int = limits.MAX_FINISHED_JOBS


def kept_seconds(partial: dict | None, since_unix: float) -> float:
    """Phase seconds of the in-flight step record ``partial`` when it was made since ``since_unix`` (during a try
    that then failed): that try's rollout / reward / train work is not lost — the next try finishes the step from
    the record and its report counts those seconds as phases, so they are no part of the outage."""
    if partial is None or partial.get("started_unix", -math.inf) < since_unix:
        return 0.0
    return sum(v for v in partial.get("phase_times", {}).values() if isinstance(v, int | float))


_PRUNE_EVERY_S = 60.0  # the idle runner applies the retention this often (and after every job it finishes)
_WATCH_POLL_S = 0.5  # how often a WatchJob stream looks for new reports


class JobRunner:
    """Queue, state machine and watch streams of the controller's jobs (the servicer is a thin shell)."""

    def __init__(self, jobs: JobStore, refit: RefitStore, backends: Backends, deployed: JobConfig,
                 settings: RunnerSettings | None = None) -> None:
        self.jobs, self.refit, self.b, self.deployed = jobs, refit, backends, deployed
        self.settings = settings or RunnerSettings()
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self.pool = RolloutPool(refit, backends.rollout, self.settings.generate_attempts)
        self._thread: threading.Thread | None = None
        self._faults = {"retries": 0, "outage": 0.0}  # of the step in flight; reset when a step is recorded
        self._events_after = "0-0"  # events stream position at the start of the step in flight
        self._step_t0 = 0.0  # perf_counter when the step in flight began (the last report, or the job's start)
        self.on_report: Callable[[dict], None] | None = None  # e.g. the Prometheus metrics (fp8rl.metrics)
        self._begun: dict[str, int] = {}  # job -> the newest step whose rollout this controller recorded as begun
        self._begun_before: int | None = None  # the record's rollouts_begun when this controller took the job

    # -- the servicer's API --------------------------------------------------------------------
    def submit(self, job_yaml: str, job_id: str | None = None) -> JobRecord:
        """Validate and enqueue. Raises ConfigError, DeploymentMismatchError, ValueError (bad id), JobExistsError,
        JobLimitError (the store is full even after applying the retention, or the queue is).

        ``job_id`` None picks a fresh id; any string given, ``""`` included, must be a valid id. A ``jsonl``
        job's data file is checked here (location, kind, size); its rows are read when the job starts.
        """
        job = parse_job_config(job_yaml)
        job.check_services()  # keys only the in-process loop runs
        check_deployment(job, self.deployed)
        self._check_grader(job)
        self._check_env(job)
        self._check_vision(job)
        try:
            check_data(job, self.settings.data)
        except DataFileError as exc:
            raise ConfigError(str(exc)) from None
        job_id = new_job_id(job.job.name) if job_id is None else job_id
        try:
            rec = self.jobs.create(job_id, job_yaml, job.job.steps)
        except JobLimitError:
            if not self._prune():  # the store is full: apply the retention now, not at the next minute
                raise
            rec = self.jobs.create(job_id, job_yaml, job.job.steps)
        log.info("job %s submitted (%d steps)", rec.job_id, rec.total_steps)
        self._notify()
        return rec

    def _check_grader(self, job: JobConfig) -> None:
        """``reward.grader`` must be one the reward service grades with (what it recorded in Redis when it started,
        each ``--grader-module`` included; the built-in graders while it has recorded none)."""
        known = self.refit.graders() or set(GRADERS)
        if job.reward.grader not in known:
            raise ConfigError(f"reward.grader: unknown grader {short(job.reward.grader)}; the reward service grades "
                              f"with {', '.join(sorted(known))} (more with its --grader-module)")

    def _check_vision(self, job: JobConfig) -> None:
        """A vision-language policy trains single-turn, on the torch engines, with a one-process trainer: its
        pictures ride with the Generate, TrainStep and Calibrate calls (a multi-turn trajectory, the Megatron
        trainer and a trainer's ranks take none)."""
        try:
            vision = model_config_of(job).family.vision
        except (OSError, ValueError) as exc:
            raise ConfigError(f"policy.model: {exc}") from None
        if not vision:
            return
        name = short(job.policy.model)
        why = ("policy.training.backend must be torch" if job.policy.training.backend != "torch" else
               f"policy.training.dp_size must be 1 (the trainer's ranks take no images; {job.trainer_ranks} asked)"
               if job.trainer_ranks > 1 else
               "env / agent jobs train text trajectories" if job.env.name or job.agent.entrypoint else None)
        if why:
            raise ConfigError(f"policy.model: {name} is a vision-language model, which the stack trains single-turn "
                              f"on its torch engines with a one-process trainer: {why}")

    def _check_env(self, job: JobConfig) -> None:
        """``env.name`` must be an environment the reward service's env workers run (what it recorded in Redis when
        it started: the registered ones and its ``--env-module`` modules; the registered ones while it has recorded
        nothing). So must an agent job's ``agent.entrypoint`` module (its agents run in the reward service's
        sandbox). No environment or agent code is imported here."""
        name = job.env.name
        recorded = self.refit.envs()
        names, modules = recorded if recorded is not None else (set(env_names()), set())
        if (entry := job.agent.entrypoint) is not None and entry.partition(":")[0] not in modules:
            raise ConfigError(f"agent.entrypoint: {short(entry)} does not run on this stack: the reward service runs "
                              f"agents of its --env-module modules only ({', '.join(sorted(modules)) or 'none'}); "
                              f"start it with --env-module {short(entry.partition(':')[0])}")
        if name is None:
            return
        if not (name in names or name.partition(":")[0] in modules):
            raise ConfigError(f"env.name: {short(name)} does not run on this stack; the reward service's environment "
                              f"workers run {', '.join(sorted(names))}"
                              + "".join(f", {m}:<Class>" for m in sorted(modules))
                              + " (start it with --env-module MODULE for a user environment)")
        for path in import_paths(name, job.env.kwargs):  # an adapter's own import (skyrl entry_point, trl factory)
            if path.partition(":")[0] not in modules:
                raise ConfigError(f"env.kwargs: {short(path)} is not a module the reward service's environment "
                                  f"workers were started with ({', '.join(sorted(modules)) or 'none'}); start it "
                                  f"with --env-module {short(path.partition(':')[0])}")

    def get(self, job_id: str) -> JobRecord:
        rec = self.jobs.get(job_id)
        if rec is None:
            raise KeyError(f"no job {job_id!r}")
        return rec

    def cancel(self, job_id: str, reason: str, wait_s: float = 20.0) -> JobRecord:
        """Cancel a pending job at once, a running one after its current step (waits up to ``wait_s``)."""
        rec = self.get(job_id)
        if rec.terminal:
            return rec
        self.jobs.request_cancel(job_id, reason)
        if self.jobs.transition(job_id, "cancelled", ("pending",)):
            log.info("job %s cancelled while pending: %s", job_id, reason)
        deadline = time.monotonic() + wait_s
        while not (rec := self.get(job_id)).terminal and time.monotonic() < deadline:
            with self._cond:
                self._cond.wait(0.2)
        return rec

    async def watch(self, job_id: str, from_step: int) -> AsyncIterator[dict]:
        """Reports from ``from_step`` (finished ones first, then live) until the job is terminal.

        An asyncio generator: a watcher waits on the server's I/O loop, holding no worker thread (each poll's
        Redis reads, a few milliseconds, run on the loop's executor). Raises KeyError for an unknown job."""
        await asyncio.to_thread(self.get, job_id)
        nxt = max(0, from_step)
        while not self._stop.is_set():
            terminal = (await asyncio.to_thread(self.get, job_id)).terminal  # before the reports: then seen
            for r in await asyncio.to_thread(self.jobs.reports, job_id, nxt):
                nxt = r["step"] + 1
                yield r
            if terminal:
                return
            await asyncio.sleep(_WATCH_POLL_S)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="controller-runner", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _loop(self) -> None:
        indexed, pruned_at = False, -math.inf
        while not self._stop.is_set():
            try:
                if not indexed:  # jobs an older controller recorded before the indexes existed
                    if n := self.jobs.ensure_indexes():
                        log.info("indexed %d jobs recorded by an older controller", n)
                    indexed = True
                if time.monotonic() - pruned_at >= _PRUNE_EVERY_S:
                    self._prune()
                    pruned_at = time.monotonic()
                # the heads of two indexes: the idle runner's cost does not grow with the jobs stored
                rec = self.jobs.first_in_state("running") or self.jobs.first_in_state("pending")  # resume first
                if rec is None:
                    with self._cond:
                        self._cond.wait(1.0)
                    continue
                if rec.state == "pending" and not self.jobs.transition(rec.job_id, "running", ("pending",)):
                    continue  # cancelled meanwhile
                self._run(rec.job_id)
                pruned_at = -math.inf
            except Exception as exc:  # noqa: BLE001 - Redis down: the job stays running and is resumed
                log.warning("runner: %s; retrying in 1 s", exc)
                self._stop.wait(1.0)

    def _prune(self) -> int:
        """Apply the retention: finished jobs past ``retention_s`` or beyond ``max_finished`` are deleted; returns
        how many."""
        s = self.settings
        n = self.jobs.prune(s.retention_s, s.max_finished)
        if n:
            log.info("deleted %d finished jobs (kept for %g s, at most %d)", n, s.retention_s, s.max_finished)
        return n

    def rollout_begun(self, job_id: str, step: int) -> None:
        """Record that step ``step``'s rollout begins (before it does): a controller that resumes the job counts the
        begun steps it runs again (``resume/rollouts_restarted``)."""
        if step > self._begun.get(job_id, -1):
            self.jobs.update(job_id, rollouts_begun=step)
            self._begun[job_id] = step

    def _run(self, job_id: str) -> None:
        self._faults, self._step_t0 = {"retries": 0, "outage": 0.0}, time.perf_counter()
        self._begun_before = self.get(job_id).rollouts_begun  # begun by an earlier controller (a resume)
        self._events_after = self.refit.last_event_id()
        try:
            plan = JobPlan(job_id, parse_job_config(self.jobs.config_text(job_id)), self.settings.data)
            while True:
                t_try, t_try_unix = time.perf_counter(), time.time()
                try:
                    return self._advance(plan)
                except RpcFailed as exc:
                    f = self._faults  # reset by _finish whenever a step was recorded meanwhile
                    f["retries"] += 1
                    if exc.code not in TRANSIENT or f["retries"] >= self.settings.step_attempts:
                        raise JobFailed(str(exc) if exc.code not in TRANSIENT else
                                      f"{exc} (after {f['retries']} tries of step {self.get(job_id).steps_done})"
                                      ) from None
                    pause = min(30.0, self.settings.retry_pause_s * 2 ** (f["retries"] - 1))
                    log.warning("job %s: %s; retrying the step in %.1f s (%d/%d)", job_id, exc, pause, f["retries"],
                                self.settings.step_attempts)
                    self._stop.wait(pause)
                    # this step's failed try + pause, less the phases of it the next try keeps (a failure after
                    # TrainStep: the in-flight record's rollout/reward/train times go into the report as phases)
                    lost = time.perf_counter() - max(t_try, self._step_t0) - self._kept_seconds(job_id, t_try_unix)
                    f["outage"] += max(0.0, lost)
        except Stopping:
            log.info("job %s left running for the next controller", job_id)
        except JobCancelled:
            self.jobs.transition(job_id, "cancelled", ("running",))
            log.info("job %s cancelled", job_id)
        except redis.RedisError:
            raise
        except Exception as exc:  # noqa: BLE001 - anything else ends the job with a message for people
            msg = str(exc) if isinstance(exc, JobFailed) else f"{type(exc).__name__}: {exc}"
            log.exception("job %s failed: %s", job_id, msg)
            self.jobs.transition(job_id, "failed", ("running",), error=msg)
        finally:
            self._notify()

    def _kept_seconds(self, job_id: str, since_unix: float) -> float:
        try:
            partial = self.jobs.inflight(job_id)
        except redis.RedisError:
            return 0.0
        return kept_seconds(partial, since_unix)

    # -- one job -------------------------------------------------------------------------------
    def _advance(self, plan: JobPlan) -> None:
        step = self._reconcile(plan)
        rec = self.get(plan.job_id)
        if rec.terminal:
            return
        if self._begun_before is not None:  # the steps an earlier controller began and this one runs again
            redone = max(0, self._begun_before - step + 1)
            self._faults["rollouts_restarted"] = redone * plan.job.grpo.num_prompts_per_step * plan.group
            self._begun_before = None
        v = rec.next_version  # recorded, never computed (see the module docstring)
        if plan.fp8_kv and self.refit.get_scales(v) is None:  # e.g. v0 of a fresh deployment
            problems = plan.batch(step)
            seqs = GrpcStep(self, plan).prompts_of(problems)
            files = [p.images for p in problems] if plan.images is not None else None
            self._rpc("calibrate", "calibrator", "Calibrate", calibrate_request(v, seqs, files), DL.calibrate)
        self._refit_wait(v)
        if plan.async_grpo and step < plan.total:
            pipe = Pipeline(plan, GrpcStep(self, plan), first_step=step, total=plan.total, version=v,
                            calibrate_inline=False, check=lambda: self._check(plan.job_id))
            # the record is saved right after TrainStep, as in a synchronous step; calibrate and refit of the new
            # version run on the pipeline's refit thread, overlapping the next step's training
            # the last step's report leaves the job running: it succeeds only once pipe.run returns, i.e. once
            # the last version is calibrated and every replica holds it (as a synchronous step's record waits)
            pipe.run(lambda partial, times, metrics: self._record(plan, partial, times, metrics,
                                                                  final=False) == "running",
                     on_trained=lambda partial: self.jobs.set_inflight(plan.job_id, partial))
        else:
            while step < plan.total:
                if self._finish(plan, self._first_half(plan, step, v)) != "running":
                    return
                step, v = step + 1, self.get(plan.job_id).next_version
        # every step is recorded and its version held; a job cancelled meanwhile stays cancelled
        self.jobs.transition(plan.job_id, "succeeded", ("running",))

    def _reconcile(self, plan: JobPlan) -> int:
        """The next step to run, after matching the job's record with the version the trainer holds."""
        rec = self.get(plan.job_id)
        status = self._rpc("status", "trainer", "Status", trainer_pb2.TrainerStatusRequest(), DL.status)
        if status.recipe != self.deployed.recipe:
            raise JobFailed(f"the trainer runs recipe {status.recipe}, but the controller was deployed for "
                          f"{self.deployed.recipe}: the services were started with different job files")
        held, n = status.version, rec.steps_done
        started = [r["weight_version"] for r in self.jobs.reports(plan.job_id)]
        lineage = self._lineage(held)
        r = reconcile(started, rec.next_version, held, lineage)
        if r.case == "unknown":
            raise JobFailed(r.error)
        if r.case != "fresh" and r.case != "in_step":
            log.warning("job %s: resuming (%s): the trainer holds weight version %d (trained from %s, restored from "
                        "%s) after %d finished steps, the next from version %s; %s step %d", plan.job_id, r.case,
                        held, lineage.trained_from.get(held), lineage.restored_from.get(held), n, rec.next_version,
                        "finishing" if r.finish else "continuing at", r.step)
        if r.truncate_to is not None:
            self.jobs.truncate_reports(plan.job_id, r.truncate_to)
        if r.drop_inflight:
            self.jobs.set_inflight(plan.job_id, None)
        if r.case == "fresh":
            self.jobs.update(plan.job_id, start_version=r.next_version, next_version=r.next_version)
        elif r.next_version is not None:
            self.jobs.update(plan.job_id, next_version=r.next_version)
        if r.finish:  # step n started from the recorded next_version; its update is what the trainer holds
            return self._finish_trained(plan, n, rec.next_version, held)
        return r.step

    def _lineage(self, held: int) -> Lineage:
        """Redis's record of where ``held`` came from (and, for a republished checkpoint, where that came from)."""
        trained, restored = {}, {}
        v: int | None = held
        for _ in range(2):  # held, then the checkpoint it republished (if any)
            if (t := self.refit.trained_from(v)) is not None:
                trained[v] = t
            if (o := self.refit.restored_from(v)) is None:
                break
            restored[v], v = o, o
        return Lineage(trained, restored)

    def _finish_trained(self, plan: JobPlan, n: int, started: int, held: int) -> int:
        """Step ``n`` (from version ``started``) was trained, the trainer holds its update as ``held``, but it was
        not recorded: finish it from its calibration + refit."""
        partial = self.jobs.inflight(plan.job_id)
        if partial is None or partial["step"] != n:
            log.warning("job %s: step %d trained but its rollout data is lost; recording it without", plan.job_id, n)
            problems = plan.batch(n)
            partial = {"step": n, "weight_version": started, "new_version": held, "reward_mean": math.nan,
                       "accuracy": math.nan, "metrics": {"recovered_without_rollout": 1.0}, "phase_times": {},
                       "sequences": GrpcStep(self, plan).prompts_of(problems)}
            if pictures := step_pictures(problems, list(enumerate(problems))):  # the prompts with their pictures
                partial["pictures"] = pictures
        partial["new_version"] = held  # a republished checkpoint carries step n's update under a newer version
        partial["resumed"] = True
        log.info("job %s: finishing step %d (already trained) after a restart", plan.job_id, n)
        self._finish(plan, partial)
        return n + 1

    def _check(self, job_id: str, cancel: bool = True) -> None:
        if self._stop.is_set():
            raise Stopping
        if cancel and self.get(job_id).cancel_requested:
            raise JobCancelled

    def _rpc(self, phase: str, role: str, method: str, request, timeout: float | None):
        return call(self, phase, role, method, request, timeout)

    # -- one step ------------------------------------------------------------------------------
    def _first_half(self, plan: JobPlan, step: int, v: int) -> dict:
        """rollout → reward → TrainStep (:func:`fp8rl.controller.step.first_half`); the record is saved as
        ``inflight`` before anything else."""
        b = GrpcStep(self, plan)
        partial = first_half(plan, b, step, v, check=lambda: self._check(plan.job_id))
        if md := b.markdown():  # a few trajectories for the report (model and environment tokens told apart)
            partial["trajectories_md"] = md
        if b.last_pictures:  # a vision-language job: a few pictures with their sampled answers, for the report
            partial["report_pictures"] = b.last_pictures  # (the record's "pictures" are its calibration's)
        self.jobs.set_inflight(plan.job_id, partial)
        return partial

    def _finish(self, plan: JobPlan, partial: dict) -> str:
        """calibrate → refit (:func:`fp8rl.controller.step.finish`) → (eval, checkpoint) → record the report;
        returns the job's state after it."""
        times, refit_metrics = finish(plan, GrpcStep(self, plan), partial,
                                      check=lambda: self._check(plan.job_id, cancel=False))
        return self._record(plan, partial, times, refit_metrics)

    def _record(self, plan: JobPlan, partial: dict, times: dict, extra: dict, *, final: bool = True) -> str:
        """(eval, checkpoint) → record the report of a trained step whose calibrate/refit finished (synchronous)
        or were handed to the pipeline's refit thread (asynchronous); returns the job's state after it.

        ``final=False`` (asynchronous): the last step's report leaves the job ``running``; the caller marks it
        succeeded once the last version's calibrate and refit are done."""
        step, v1 = partial["step"], partial["new_version"]
        if plan.async_grpo:  # the rollout overlapped the step before: the wall time is the time since that one
            wall = time.perf_counter() - self._step_t0
        else:
            wall = time.time() - partial["started_unix"] if "started_unix" in partial and not partial.get("resumed") \
                else 0
        times["outage"] = self._faults["outage"]
        times["total"] = max(wall, sum(times.get(p, 0.0) for p in PHASES) + times["outage"])
        metrics = {**partial["metrics"], **extra, "retries": float(self._faults["retries"])}
        if "rollouts_restarted" in self._faults:  # the first step recorded after a resume
            metrics["resume/rollouts_restarted"] = float(self._faults["rollouts_restarted"])
        if plan.eval_every and ((step + 1) % plan.eval_every == 0 or step + 1 >= plan.total):
            metrics.update(self._evaluate(plan, v1))
        rec = self.get(plan.job_id)
        state = ("succeeded" if step + 1 >= plan.total and final else "cancelled" if rec.cancel_requested
                 else "running")
        every = plan.job.job.checkpoint_every
        if every and ((step + 1) % every == 0 or state != "running"):
            t = time.perf_counter()
            ck = self._rpc("checkpoint", "trainer", "SaveCheckpoint", trainer_pb2.SaveCheckpointRequest(),
                           DL.save_checkpoint)
            metrics["time/checkpoint"] = time.perf_counter() - t
            self.jobs.update(plan.job_id, checkpoint_path=ck.path, checkpoint_version=ck.version)
        after, fenced_events = self._events_after, 0
        for e in self.refit.events(self._events_after, count=10_000):
            after, fenced_events = e.id, fenced_events + (e.type == "replica_fenced")
        metrics["replica_fenced"] = float(fenced_events)  # refit timeouts and expired leases, during this step
        report = {"job_id": plan.job_id, "step": step, "weight_version": partial["weight_version"],
                  "reward_mean": partial["reward_mean"], "accuracy": partial["accuracy"], "metrics": metrics,
                  "phase_times": {p: times.get(p, 0.0) for p in REPORT_TIMES}}
        for key in ("trajectories_md", "report_pictures"):
            if partial.get(key):
                report[key] = partial[key]
        self.jobs.append_report(plan.job_id, report, state, next_version=v1)
        if self.on_report is not None:
            try:
                self.on_report(report)
            except Exception:  # noqa: BLE001 - metrics never fail a step
                log.exception("job %s step %d: recording the report's metrics failed", plan.job_id, step)
        self._faults, self._events_after = {"retries": 0, "outage": 0.0}, after  # the next step's budget
        self._step_t0 = time.perf_counter()
        self._notify()
        log.info("job %s step %d/%d: v%d -> v%d reward %.3f accuracy %.3f token_mult_prob_error %.4f "
                 "max |dlogprob| %.1e (%.2f s)", plan.job_id, step + 1, plan.total, partial["weight_version"], v1,
                 report["reward_mean"], report["accuracy"], metrics.get("token_mult_prob_error", math.nan),
                 metrics.get("mismatch/max_abs_logprob_diff", math.nan), times["total"])
        return state

    def _refit_wait(self, version: int) -> list[str]:
        """Wait for every live replica's ack of ``version``; fence the late ones. Returns the fenced ids."""
        _, missing = self.refit.wait_for_acks(version, self.settings.refit_timeout_s)
        for rid in missing:
            log.warning("replica %s did not ack weight version %d within %.0f s: fencing it", rid, version,
                        self.settings.refit_timeout_s)
            self.refit.fence(rid, version)
        return missing

    def _evaluate(self, plan: JobPlan, v: int) -> dict[str, float]:
        """Validation of the deployed rollout numerics at ``v`` on the job's validation set: greedy accuracy, pass@j
        and mean@k (:func:`fp8rl.controller.validation.validate`) as report metrics."""
        e, b = plan.job.eval, GrpcStep(self, plan)
        return validate(b, plan.eval_set, b.prompts_of(plan.eval_set), v, k=e.k, temperature=e.temperature).metrics()

