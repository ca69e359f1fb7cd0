"""JobService: the controller's gRPC face — proto ↔ :class:`~services.controller.runner.JobRunner`, nothing else.

The controller is started like every role (``services.common.runtime``) with the *deployment's* job file
(the one the trainer, calibrator and rollout replicas got) and the same ``--job-id`` namespace, so it
sees their refit state (leases, acks) in Redis. Submitted jobs are checked against that file:

* a YAML that does not validate is INVALID_ARGUMENT naming the key (``fp8rl.config``);
* a job whose model, precision recipe or another setting baked into the services differs from the
  deployment is FAILED_PRECONDITION naming the key (``fp8rl.controller_lib.DEPLOYMENT_KEYS``);
* a taken ``job_id`` is ALREADY_EXISTS, an unknown one NOT_FOUND.

Flags beyond the common ones: ``--trainer``, ``--reward``, ``--calibrator`` (``host:port``; env
``FP8RL_TRAINER_ADDR`` ...), ``--refit-timeout``, ``--replica-wait``, ``--cancel-wait``. Rollout
replicas need no flag: they are found through their leases.
"""

from __future__ import annotations

import argparse
import threading

import grpc

from fp8rl.config import ConfigError
from fp8rl.controller_lib import DeploymentMismatchError
from fp8rl.jobstore import JOB_STATES, JobExistsError, JobRecord, JobStore
from fp8rl.rpc import (
    calibrator_pb2_grpc,
    common_pb2,
    controller_pb2,
    controller_pb2_grpc,
    reward_pb2_grpc,
    rollout_pb2_grpc,
    trainer_pb2_grpc,
)
from fp8rl.rpc.channel import make_channel
from services.common.runtime import Abort, Context, Service, ServiceSpec, StartupError, env_default, rpc_method

from .runner import PHASES, Backends, JobRunner, RunnerSettings

__all__ = ["ControllerService", "JobServicer", "SPEC"]

DEFAULT_LIST_LIMIT = 100


def _info(rec: JobRecord) -> controller_pb2.JobInfo:
    return controller_pb2.JobInfo(job_id=rec.job_id, state=rec.state, step=rec.steps_done, total_steps=rec.total_steps,
                                  error=rec.error, created_unix=rec.created_unix, updated_unix=rec.updated_unix)


def _report(r: dict) -> controller_pb2.StepReport:
    pt = r.get("phase_times", {})
    return controller_pb2.StepReport(
        job_id=r["job_id"], step=r["step"], weight_version=r["weight_version"], reward_mean=r["reward_mean"],
        accuracy=r["accuracy"], metrics=r.get("metrics", {}), state=r["state"],
        phase_times=common_pb2.PhaseTimes(**{p: pt.get(p, 0.0) for p in (*PHASES, "total")}))


def _not_found(exc: KeyError) -> Abort:
    return Abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]) if exc.args else "no such job")


class JobServicer(controller_pb2_grpc.JobServiceServicer):
    """proto ↔ runner; status codes, nothing else."""

    def __init__(self, runner: JobRunner, cancel_wait_s: float) -> None:
        self.r, self.cancel_wait_s = runner, cancel_wait_s

    @rpc_method
    def SubmitJob(self, request, context):
        try:
            rec = self.r.submit(request.job_yaml, request.job_id if request.HasField("job_id") else None)
        except ConfigError as exc:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid job file: {exc}") from None
        except DeploymentMismatchError as exc:
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION, f"the job does not match the deployment: {exc}") from None
        except JobExistsError as exc:
            raise Abort(grpc.StatusCode.ALREADY_EXISTS, str(exc)) from None
        except ValueError as exc:  # a malformed job_id
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"job_id: {exc}") from None
        return controller_pb2.SubmitJobResponse(job_id=rec.job_id)

    @rpc_method
    def WatchJob(self, request, context):
        try:
            for r in self.r.watch(request.job_id, request.from_step, context.is_active):
                yield _report(r)
        except KeyError as exc:
            raise _not_found(exc) from None

    @rpc_method
    def GetJob(self, request, context):
        try:
            return controller_pb2.GetJobResponse(job=_info(self.r.get(request.job_id)))
        except KeyError as exc:
            raise _not_found(exc) from None

    @rpc_method
    def ListJobs(self, request, context):
        if request.state and request.state not in JOB_STATES:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"state: {request.state!r} is not one of {', '.join(JOB_STATES)} (or '' for all)")
        if request.limit < 0:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"limit must be >= 0, got {request.limit}")
        recs = self.r.jobs.list(request.state, request.limit or DEFAULT_LIST_LIMIT)
        return controller_pb2.ListJobsResponse(jobs=[_info(r) for r in recs])

    @rpc_method
    def CancelJob(self, request, context):
        try:
            rec = self.r.cancel(request.job_id, request.reason or "cancelled by request", self.cancel_wait_s)
        except KeyError as exc:
            raise _not_found(exc) from None
        return controller_pb2.CancelJobResponse(job=_info(rec))


class ControllerService(Service):
    """Channels to the other services, the job store and the runner thread."""

    def __init__(self, ctx: Context) -> None:
        a = ctx.args
        for flag in ("trainer", "reward", "calibrator"):
            if not getattr(a, flag):
                raise StartupError(f"--{flag} HOST:PORT (or $FP8RL_{flag.upper()}_ADDR) is required: the controller "
                                   f"calls the {flag} service every step")
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        backends = Backends(
            trainer=trainer_pb2_grpc.TrainerServiceStub(self._channel(a.trainer)),
            reward=reward_pb2_grpc.RewardServiceStub(self._channel(a.reward)),
            calibrator=calibrator_pb2_grpc.CalibratorServiceStub(self._channel(a.calibrator)),
            rollout=lambda endpoint: rollout_pb2_grpc.RolloutServiceStub(self._channel(endpoint)),
        )
        settings = RunnerSettings(refit_timeout_s=a.refit_timeout, replica_wait_s=a.replica_wait)
        self.runner = JobRunner(JobStore(ctx.store.client), ctx.store, backends, ctx.job, settings)
        self.cancel_wait_s = a.cancel_wait

    def _channel(self, target: str) -> grpc.Channel:
        with self._lock:
            if target not in self._channels:
                self._channels[target] = make_channel(target)
            return self._channels[target]

    def servicers(self):
        return [(controller_pb2_grpc.add_JobServiceServicer_to_server, JobServicer(self.runner, self.cancel_wait_s))]

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
        p.add_argument(f"--{flag}", default=env_default(f"{flag}_addr"), help=f"host:port of the {flag} service")
    p.add_argument("--refit-timeout", type=float, default=float(env_default("refit_timeout_s", 60.0)),
                   help="seconds to wait for every live replica's ack of a new version before fencing the late ones")
    p.add_argument("--replica-wait", type=float, default=float(env_default("replica_wait_s", 120.0)),
                   help="seconds a step waits for a rollout replica holding its version")
    p.add_argument("--cancel-wait", type=float, default=float(env_default("cancel_wait_s", 20.0)),
                   help="seconds CancelJob waits for a running job to stop before answering")


SPEC = ServiceSpec(name="controller", default_port=50050, build=ControllerService, add_args=_add_args)
