"""JobService: the controller's gRPC face — proto ↔ :class:`~services.controller.runner.JobRunner`, nothing else.

The controller is started like every role (``services.common.runtime``) with the *deployment's* job file
(the one the trainer, calibrator and rollout replicas got) and the same ``--job-id`` namespace, so it
sees their refit state (leases, acks) in Redis. Submitted jobs are checked against that file:

* a YAML that does not validate is INVALID_ARGUMENT naming the key (``fp8rl.config``);
* a job whose model, precision recipe or another setting baked into the services differs from the
  deployment is FAILED_PRECONDITION naming the key (``fp8rl.controller.plan.DEPLOYMENT_KEYS``);
* a taken ``job_id`` is ALREADY_EXISTS, an unknown one NOT_FOUND; an empty or malformed one (``""``
  given explicitly included) INVALID_ARGUMENT;
* a ``jsonl`` job's ``data.path`` must be a regular file inside the data root (``--data-root``, env
  ``FP8RL_DATA_ROOT``; default: the directory of the controller's own ``--config`` job file), at most
  ``--max-data-bytes`` large — else INVALID_ARGUMENT. Its rows (at most ``--max-data-rows``) are read
  when the job starts; a file that fails then fails the job with the reason as its error.

WatchJob is an asyncio method: a stream waits on the server's I/O loop and holds no worker thread. At most
``--max-watch-streams`` run at once and ``--max-watch-streams-per-client`` per client connection
(RESOURCE_EXHAUSTED beyond), so one client cannot hold every stream.

The job store is bounded (``fp8rl.controller.jobstore``): ``--max-jobs`` stored and ``--max-queued-jobs``
pending (SubmitJob beyond: RESOURCE_EXHAUSTED), finished jobs deleted after ``--job-retention-s`` or beyond
``--max-finished-jobs``; ListJobs pages through an index (``page_token``). A job's ``reward.grader`` must be
one the reward service recorded (INVALID_ARGUMENT otherwise, at SubmitJob rather than at the first step).

Every service is found through its role lease in Redis (registered by the common skeleton), read
again at every call, so a service restarted on another port is reached at the next retry. Flags
beyond the common ones: ``--trainer``, ``--reward``, ``--calibrator`` (``host:port``; env
``FP8RL_TRAINER_ADDR`` ...: optional fallbacks used only while no lease of that role is live),
``--refit-timeout``, ``--replica-wait``, ``--cancel-wait``, ``--step-attempts``, the data and watch
flags above.
"""

from __future__ import annotations

import argparse
import base64
import threading
from dataclasses import replace
from pathlib import Path

import grpc
import redis

from fp8rl import limits
from fp8rl.config import ConfigError
from fp8rl.config.fields import short
from fp8rl.controller.jobstore import JOB_STATES, JobExistsError, JobLimitError, JobRecord, JobStore
from fp8rl.controller.plan import DeploymentMismatchError
from fp8rl.data import DataRoot
from fp8rl.refit.keys import validate_job_id
from fp8rl.rpc import (
    calibrator_pb2_grpc,
    common_pb2,
    controller_pb2,
    controller_pb2_grpc,
    env_pb2_grpc,
    reward_pb2_grpc,
    rollout_pb2_grpc,
    trainer_pb2_grpc,
)
from fp8rl.rpc.channel import make_channel
from fp8rl.rpc.server import SCOPE_CLIENT
from services.common.runtime import Abort, Context, Service, ServiceSpec, StartupError, env_default, rpc_method

from .runner import REPORT_TIMES, Backends, JobRunner, RunnerSettings

__all__ = ["ControllerService", "JobServicer", "SPEC"]

_STUBS = {"trainer": trainer_pb2_grpc.TrainerServiceStub, "reward": reward_pb2_grpc.RewardServiceStub,
          "calibrator": calibrator_pb2_grpc.CalibratorServiceStub, "rollout": rollout_pb2_grpc.RolloutServiceStub,
          "env": env_pb2_grpc.EnvServiceStub}  # the reward service's EnvService (multi-turn jobs' environments)


def _info(rec: JobRecord) -> controller_pb2.JobInfo:
    # total_steps is bounded on submit (fp8rl.limits.MAX_JOB_STEPS); saturate anyway so a record written
    # before that bound can never make GetJob / ListJobs / CancelJob fail with "Value out of range".
    return controller_pb2.JobInfo(job_id=rec.job_id, state=rec.state, step=rec.steps_done,
                                  total_steps=max(-limits.INT64_MAX, min(rec.total_steps, limits.INT64_MAX)),
                                  error=rec.error, created_unix=rec.created_unix, updated_unix=rec.updated_unix)


def _job_id(value: str) -> str:
    """A request's ``job_id``: INVALID_ARGUMENT when empty or malformed (never treated as "unset")."""
    if not value:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "job_id is empty: name a job")
    if len(value) > 64:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"job_id is {len(value)} characters; the limit is 64")
    try:
        return validate_job_id(value)
    except ValueError as exc:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"job_id: {exc}") from None


def _report(r: dict) -> controller_pb2.StepReport:
    pt = r.get("phase_times", {})
    return controller_pb2.StepReport(
        job_id=r["job_id"], step=r["step"], weight_version=r["weight_version"], reward_mean=r["reward_mean"],
        accuracy=r["accuracy"], metrics=r.get("metrics", {}), state=r["state"],
        trajectories_md=r.get("trajectories_md", ""),
        pictures=[controller_pb2.ReportPicture(images=[base64.b64decode(b) for b in p["images"]], prompt=p["prompt"],
                                               reference=p["reference"], sampled=p["sampled"], right=p["right"])
                  for p in r.get("report_pictures", ())],
        phase_times=common_pb2.PhaseTimes(**{p: pt.get(p, 0.0) for p in REPORT_TIMES}))


def _not_found(exc: KeyError) -> Abort:
    return Abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]) if exc.args else "no such job")


class JobServicer(controller_pb2_grpc.JobServiceServicer):
    """proto ↔ runner; status codes, nothing else."""

    def __init__(self, runner: JobRunner, cancel_wait_s: float, max_watch_streams: int = limits.MAX_WATCH_STREAMS,
                 max_watch_per_client: int = limits.MAX_WATCH_STREAMS_PER_CLIENT):
        self.r, self.cancel_wait_s = runner, cancel_wait_s
        self.max_watch_streams, self.max_watch_per_client = max_watch_streams, max_watch_per_client
        self._watchers: dict[str, int] = {}  # client connection -> its open WatchJob streams

    @rpc_method
    def SubmitJob(self, request, context):
        if request.HasField("job_id"):
            _job_id(request.job_id)  # "" given explicitly is refused, not taken as unset
        try:
            rec = self.r.submit(request.job_yaml, request.job_id if request.HasField("job_id") else None)
        except ConfigError as exc:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid job file: {exc}") from None
        except DeploymentMismatchError as exc:
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION, f"the job does not match the deployment: {exc}") from None
        except JobExistsError as exc:
            raise Abort(grpc.StatusCode.ALREADY_EXISTS, str(exc)) from None
        except JobLimitError as exc:
            raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        except ValueError as exc:  # a malformed job_id
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"job_id: {exc}") from None
        return controller_pb2.SubmitJobResponse(job_id=rec.job_id)

    async def WatchJob(self, request, context):
        """An asyncio method: a stream waits on the I/O loop and holds no worker, so watchers never take the
        workers SubmitJob / CancelJob need; its own limits are per client connection and in all."""
        try:
            job_id = _job_id(request.job_id)
        except Abort as exc:
            await context.abort(exc.code, exc.message)
        client = context.peer()  # one client connection (a process's channels to us share one): counted together
        mine = self._watchers.get(client, 0)
        if mine >= self.max_watch_per_client:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this client already has {mine} WatchJob streams open (the limit per client, "
                                f"--max-watch-streams-per-client); close one or poll GetJob")
        if sum(self._watchers.values()) >= self.max_watch_streams:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.max_watch_streams} WatchJob streams are open (the limit, --max-watch-streams); "
                                f"retry with back-off or poll GetJob")
        self._watchers[client] = mine + 1  # touched on the I/O loop only: no lock
        try:
            async for r in self.r.watch(job_id, request.from_step):
                yield _report(r)
        except KeyError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, _not_found(exc).message)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"WatchJob: the job state in Redis is unreachable "
                                                             f"({exc}); retry")
        finally:
            self._watchers[client] -= 1
            if not self._watchers[client]:
                del self._watchers[client]

    @rpc_method
    def GetJob(self, request, context):
        try:
            return controller_pb2.GetJobResponse(job=_info(self.r.get(_job_id(request.job_id))))
        except KeyError as exc:
            raise _not_found(exc) from None

    @rpc_method
    def ListJobs(self, request, context):
        if request.state and request.state not in JOB_STATES:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"state: {short(request.state)} is not one of {', '.join(JOB_STATES)} (or '' for all)")
        if not 0 <= request.limit <= limits.MAX_LIST_JOBS:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"limit must be in [0, {limits.MAX_LIST_JOBS}] (0: {limits.DEFAULT_LIST_JOBS}), got "
                        f"{request.limit}")
        try:
            recs, token = self.r.jobs.page(request.state, request.limit or limits.DEFAULT_LIST_JOBS,
                                           request.page_token)
        except ValueError as exc:  # a page_token ListJobs did not hand out
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        return controller_pb2.ListJobsResponse(jobs=[_info(r) for r in recs], next_page_token=token)

    @rpc_method
    def CancelJob(self, request, context):
        try:
            rec = self.r.cancel(_job_id(request.job_id), request.reason[:1000] or "cancelled by request",
                                self.cancel_wait_s)
        except KeyError as exc:
            raise _not_found(exc) from None
        return controller_pb2.CancelJobResponse(job=_info(rec))


class ControllerService(Service):
    """Channels to the other services, the job store and the runner thread."""

    def __init__(self, ctx: Context) -> None:
        a = ctx.args
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        backends = Backends(stub=lambda role, endpoint: _STUBS[role](self._channel(endpoint)),
                            fallback={f: getattr(a, f) for f in ("trainer", "reward", "calibrator") if getattr(a, f)})
        root = Path(a.data_root) if a.data_root else Path(a.config).resolve().parent
        data = DataRoot(root, max_bytes=a.max_data_bytes, max_rows=a.max_data_rows)
        if a.step_attempts < 1:
            raise StartupError(f"--step-attempts must be >= 1, got {a.step_attempts}")
        settings = RunnerSettings(refit_timeout_s=a.refit_timeout, replica_wait_s=a.replica_wait, data=data,
                                  step_attempts=a.step_attempts)
        for flag in ("max_jobs", "max_queued_jobs", "max_finished_jobs", "max_watch_streams_per_client"):
            if getattr(a, flag) < 1:
                raise StartupError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
        if not a.job_retention_s > 0:
            raise StartupError(f"--job-retention-s must be > 0, got {a.job_retention_s}")
        jobs = JobStore(ctx.store.client, max_jobs=a.max_jobs, max_queued=a.max_queued_jobs)
        settings = replace(settings, retention_s=a.job_retention_s, max_finished=a.max_finished_jobs)
        self.runner = JobRunner(jobs, ctx.store, backends, ctx.job, settings)
        self.runner.on_report = ctx.metrics.observe_report
        self.cancel_wait_s, self.max_watch_streams = a.cancel_wait, a.max_watch_streams
        self.max_watch_per_client = a.max_watch_streams_per_client
        if self.max_watch_streams < 1:
            raise StartupError(f"--max-watch-streams must be >= 1, got {self.max_watch_streams}")

    def _channel(self, target: str) -> grpc.Channel:
        with self._lock:
            if target not in self._channels:
                self._channels[target] = make_channel(target)
            return self._channels[target]

    def servicers(self):
        return [(controller_pb2_grpc.add_JobServiceServicer_to_server,
                 JobServicer(self.runner, self.cancel_wait_s, self.max_watch_streams, self.max_watch_per_client))]

    def start(self, ctx: Context) -> None:
        self.runner.start()  # resumes a job left running by a previous controller, then serves the queue
        ctx.set_serving(True)

    def stop(self) -> None:
        self.runner.stop()
        with self._lock:
            for ch in self._channels.values():
                ch.close()


def _add_args(p: argparse.ArgumentParser) -> None:
    for flag in ("trainer", "reward", "calibrator"):
        p.add_argument(f"--{flag}", default=env_default(f"{flag}_addr"),
                       help=f"host:port of the {flag} service while none holds a live lease in Redis (default: none)")
    p.add_argument("--step-attempts", type=int, default=int(env_default("step_attempts", 5)),
                   help="tries of one step whose calls fail transiently (UNAVAILABLE / DEADLINE_EXCEEDED), counted "
                        "afresh for every step")
    p.add_argument("--refit-timeout", type=float, default=float(env_default("refit_timeout_s", 60.0)),
                   help="seconds to wait for every live replica's ack of a new version before fencing the late ones")
    p.add_argument("--replica-wait", type=float, default=float(env_default("replica_wait_s", 120.0)),
                   help="seconds a step waits for a rollout replica holding its version")
    p.add_argument("--cancel-wait", type=float, default=float(env_default("cancel_wait_s", 20.0)),
                   help="seconds CancelJob waits for a running job to stop before answering")
    p.add_argument("--data-root", default=env_default("data_root"),
                   help="directory a job's data.path must lie in; relative paths are relative to it (default: the "
                        "directory of --config)")
    p.add_argument("--max-data-bytes", type=int, default=int(env_default("max_data_bytes", limits.MAX_DATA_BYTES)),
                   help="largest data.path file read, in bytes")
    p.add_argument("--max-data-rows", type=int, default=int(env_default("max_data_rows", limits.MAX_DATA_ROWS)),
                   help="most problems a data.path file may hold")
    p.add_argument("--max-watch-streams", type=int,
                   default=int(env_default("max_watch_streams", limits.MAX_WATCH_STREAMS)),
                   help="concurrent WatchJob streams; more get RESOURCE_EXHAUSTED")
    p.add_argument("--max-watch-streams-per-client", type=int,
                   default=int(env_default("max_watch_streams_per_client", limits.MAX_WATCH_STREAMS_PER_CLIENT)),
                   help="concurrent WatchJob streams of one client connection")
    p.add_argument("--max-jobs", type=int, default=int(env_default("max_jobs", limits.MAX_JOBS)),
                   help="jobs stored at once, any state; SubmitJob beyond is RESOURCE_EXHAUSTED")
    p.add_argument("--max-queued-jobs", type=int, default=int(env_default("max_queued_jobs", limits.MAX_QUEUED_JOBS)),
                   help="pending jobs at once; SubmitJob beyond is RESOURCE_EXHAUSTED")
    p.add_argument("--job-retention-s", type=float,
                   default=float(env_default("job_retention_s", limits.JOB_RETENTION_S)),
                   help="seconds a finished job (and its reports) is kept before it is deleted")
    p.add_argument("--max-finished-jobs", type=int,
                   default=int(env_default("max_finished_jobs", limits.MAX_FINISHED_JOBS)),
                   help="finished jobs kept at most; the oldest beyond are deleted")


SPEC = ServiceSpec(name="controller", default_port=50050, build=ControllerService, add_args=_add_args,
                   scopes=(SCOPE_CLIENT,))  # JobService: the client token; its own calls carry the service token
