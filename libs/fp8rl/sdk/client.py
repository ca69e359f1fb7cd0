"""Fp8rlClient: the typed client of the controller's JobService.

Contract:

* **Local validation first.** :meth:`Fp8rlClient.submit_job` parses the job file with
  :func:`fp8rl.config.parse_job_config` before any RPC, so a bad key fails fast with a
  :class:`~fp8rl.config.ConfigError` naming it; the server validates again.
* **A deadline on every call.** Unary calls use ``timeout_s`` when given, else the per-RPC
  default of :data:`fp8rl.rpc.channel.DEFAULT_DEADLINE_S`. A watch stream runs in segments of
  at most ``watch_segment_s`` and silently reopens from the next step when a segment's
  deadline passes, so even a days-long watch never holds a call without a deadline.
* **Retries only where repeating is harmless.** GetJob, ListJobs, CancelJob (cancelling twice
  is the same as once; a terminal job is left as is) and WatchJob (``from_step`` makes a replay
  exact) are retried with exponential backoff on UNAVAILABLE / DEADLINE_EXCEEDED. SubmitJob is
  not — a retry could start the job twice — *unless* the caller picks ``job_id``: then the id
  is an idempotency key, the submit is retried, and an ALREADY_EXISTS answered to a *retry* is
  taken as the earlier attempt having landed (so pick ids unique to one submission, e.g. a
  uuid). ALREADY_EXISTS on the first attempt is a real clash and raises :class:`AlreadyExists`.
* **Errors are typed.** Every gRPC failure becomes an :class:`~fp8rl.sdk.types.Fp8rlError`
  subclass carrying the server's message; no proto or gRPC type crosses the SDK's boundary.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from fp8rl.config import load_job_config, parse_job_config
from fp8rl.rpc import controller_pb2, controller_pb2_grpc
from fp8rl.rpc.channel import DEFAULT_DEADLINE_S, make_channel

from .types import (
    AlreadyExists,
    DeadlineExceeded,
    Fp8rlError,
    InvalidArgument,
    JobInfo,
    NotFound,
    PermissionDenied,
    PhaseTimes,
    StepReport,
    Unauthenticated,
    Unavailable,
)

__all__ = ["DEFAULT_TARGET", "ENV_TARGET", "Fp8rlClient", "load_job_text", "resolve_target"]

ENV_TARGET = "FP8RL_TARGET"
DEFAULT_TARGET = "localhost:50050"

_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
_ERRORS: dict[grpc.StatusCode, type[Fp8rlError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


def resolve_target(target: str | None) -> str:
    """``target`` if given, else ``$FP8RL_TARGET``, else ``localhost:50050``."""
    return target or os.environ.get(ENV_TARGET) or DEFAULT_TARGET


def _error(e: grpc.RpcError, method: str, target: str) -> Fp8rlError:
    """The SDK exception for a failed call, with the server's message."""
    code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
    details = (e.details() if callable(getattr(e, "details", None)) else None) or str(e)
    if code == grpc.StatusCode.UNAVAILABLE:
        details = f"controller at {target} is unavailable: {details}"
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        details = f"controller at {target} did not answer in time: {details}"
    return _ERRORS.get(code, Fp8rlError)(details, code=code.name, method=method)


def _job_info(m: controller_pb2.JobInfo) -> JobInfo:
    return JobInfo(job_id=m.job_id, state=m.state, step=m.step, total_steps=m.total_steps, error=m.error,
                   created_unix=m.created_unix, updated_unix=m.updated_unix)


def _step_report(m: controller_pb2.StepReport) -> StepReport:
    t = m.phase_times
    return StepReport(
        job_id=m.job_id, step=m.step, weight_version=m.weight_version, reward_mean=m.reward_mean,
        accuracy=m.accuracy, metrics=dict(m.metrics), state=m.state, trajectories_md=m.trajectories_md,
        pictures=tuple((tuple(p.images), p.prompt, p.reference, p.sampled, p.right) for p in m.pictures),
        phase_times=PhaseTimes(rollout=t.rollout, reward=t.reward, logprobs=t.logprobs, train=t.train,
                               publish=t.publish, calibrate=t.calibrate, refit=t.refit, total=t.total,
                               outage=t.outage),
    )


def load_job_text(job: str | os.PathLike) -> str:
    """The job YAML text, validated locally; ``job`` is YAML text or a path to a file.

    A ``Path`` (or a one-line string naming an existing file, or ending in .yaml/.yml) is a path.

    Raises:
        ConfigError: the file is missing or invalid; the message names the bad key.
    """
    if isinstance(job, os.PathLike) or ("\n" not in job and (os.path.isfile(job) or job.endswith((".yaml", ".yml")))):
        load_job_config(job)  # names the file in its message
        return Path(job).read_text()
    parse_job_config(job)
    return job


class Fp8rlClient:
    """Typed client of the controller's JobService (thread-safe; one channel per client).

    Args:
        target: controller address ``host:port``; None reads ``$FP8RL_TARGET``, else
            ``localhost:50050``.
        token: the client token (JobService scope); "" sends none; None reads ``token_file``, else
            ``$FP8RL_AUTH_TOKEN``, else the file ``$FP8RL_TOKEN_FILE`` (``deploy.launcher up`` writes it as
            ``RUN/secrets/client.token``).
        token_file: file holding the client token (used when ``token`` is None).
        tls_ca: PEM CA file to verify the controller with (TLS); None reads ``$FP8RL_TLS_CA``.
        timeout_s: deadline of every unary call; None uses each RPC's default
            (:data:`fp8rl.rpc.channel.DEFAULT_DEADLINE_S`).
        retries: retries of an idempotent unary call after the first attempt.
        backoff_s: first retry delay; doubles per retry (with jitter) up to ``max_backoff_s``.
        max_backoff_s: cap on one retry delay.
        watch_reconnect_s: how long :meth:`watch` keeps reconnecting without receiving anything
            before it gives up with :class:`Unavailable`.
        watch_segment_s: deadline of one WatchJob stream; it is reopened from the next step when
            it passes.
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        token_file: str | os.PathLike | None = None,
        timeout_s: float | None = None,
        retries: int = 4,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        watch_reconnect_s: float = 60.0,
        watch_segment_s: float = 300.0,
    ):
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        if not watch_segment_s > 0:
            raise ValueError(f"watch_segment_s must be > 0, got {watch_segment_s}")
        self.target = resolve_target(target)
        self.timeout_s, self.retries = timeout_s, retries
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.watch_reconnect_s, self.watch_segment_s = watch_reconnect_s, watch_segment_s
        self._channel = make_channel(self.target, token=token, tls_ca=tls_ca, token_file=token_file)
        self._stub = controller_pb2_grpc.JobServiceStub(self._channel)

    def close(self) -> None:
        """Closes the channel; the client is unusable afterwards."""
        self._channel.close()

    def __enter__(self) -> Fp8rlClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- unary calls ---------------------------------------------------------------------------

    def _delay(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2**attempt) * random.uniform(0.5, 1.0)

    def _call(self, method: str, rpc: Callable[..., Any], request: Any, default_timeout: float, *,
              idempotent: bool, on_retry_error: Callable[[Fp8rlError], Any] | None = None) -> Any:
        """One unary RPC with a deadline, retried (only when ``idempotent``) on transient failures."""
        timeout = self.timeout_s if self.timeout_s is not None else default_timeout
        attempt = 0
        while True:
            try:
                return rpc(request, timeout=timeout)
            except grpc.RpcError as e:
                if idempotent and e.code() in _RETRYABLE and attempt < self.retries:
                    time.sleep(self._delay(attempt))
                    attempt += 1
                    continue
                err = _error(e, method, self.target)
                if attempt > 0 and on_retry_error is not None:
                    return on_retry_error(err)
                raise err from None

    def submit_job(self, job: str | os.PathLike, job_id: str | None = None) -> str:
        """Validates a job locally, then submits it.

        Args:
            job: the job YAML text, or a path to the job file.
            job_id: caller-chosen id. When set the submit is retried on transient failures (the
                id makes it idempotent; see the module docstring); when None it is tried once and
                the controller picks the id.

        Returns:
            The accepted job's id.

        Raises:
            ConfigError: the job file is missing or invalid (no RPC was made); names the key.
            InvalidArgument: the controller rejected the job.
            AlreadyExists: ``job_id`` is taken (on the first attempt).
            Unavailable: the controller could not be reached.
            Unauthenticated: a token is required and missing or wrong.
        """
        text = load_job_text(job)
        request = controller_pb2.SubmitJobRequest(job_yaml=text, job_id=job_id)

        def landed_earlier(err: Fp8rlError) -> Any:
            if isinstance(err, AlreadyExists):
                return controller_pb2.SubmitJobResponse(job_id=job_id)  # our lost first attempt landed
            raise err

        response = self._call("SubmitJob", self._stub.SubmitJob, request, DEFAULT_DEADLINE_S.submit_job,
                              idempotent=job_id is not None, on_retry_error=landed_earlier)
        return response.job_id

    def get_job(self, job_id: str) -> JobInfo:
        """The job's current summary. Raises :class:`NotFound` for an unknown id."""
        response = self._call("GetJob", self._stub.GetJob, controller_pb2.GetJobRequest(job_id=job_id),
                              DEFAULT_DEADLINE_S.get_job, idempotent=True)
        return _job_info(response.job)

    def list_jobs(self, state: str = "", limit: int = 0) -> list[JobInfo]:
        """The first page of jobs, newest first; ``state`` filters ("" = all), ``limit`` is the page size
        (0 = the server's default, 100; at most 1000). :meth:`list_jobs_page` goes on to the next pages."""
        return self.list_jobs_page(state, limit)[0]

    def list_jobs_page(self, state: str = "", limit: int = 0, page_token: str = "") -> tuple[list[JobInfo], str]:
        """One page of jobs, newest first, after ``page_token`` ("" = the first page); returns the jobs and the
        token of the next page ("" after the last)."""
        request = controller_pb2.ListJobsRequest(state=state, limit=limit, page_token=page_token)
        response = self._call("ListJobs", self._stub.ListJobs, request, DEFAULT_DEADLINE_S.list_jobs, idempotent=True)
        return [_job_info(j) for j in response.jobs], response.next_page_token

    def cancel_job(self, job_id: str, reason: str = "") -> JobInfo:
        """Stops a job after its current step; a terminal job is returned unchanged. Raises NotFound."""
        request = controller_pb2.CancelJobRequest(job_id=job_id, reason=reason)
        response = self._call("CancelJob", self._stub.CancelJob, request, DEFAULT_DEADLINE_S.cancel_job,
                              idempotent=True)
        return _job_info(response.job)

    # -- streaming -----------------------------------------------------------------------------

    def watch(self, job_id: str, from_step: int = 0, *, timeout_s: float | None = None) -> Iterator[StepReport]:
        """Yields one report per finished step from ``from_step`` on, until the job ends.

        Finished steps are replayed first. When the stream breaks (UNAVAILABLE: controller
        restarted, network blip) it reopens from the step after the last one yielded, so no step
        is lost or repeated; so does it, with back-off, while the controller's stream limits are full
        (RESOURCE_EXHAUSTED); it gives up after ``watch_reconnect_s`` without receiving anything.
        One exception: when the trainer crashes and resumes from an older checkpoint, the job rewinds
        to the step after it and runs the later steps again, so this stream goes on from where it was
        while the job's record holds only the re-run reports (a new watch from step 0 reads that record).

        Args:
            job_id: the job.
            from_step: first step to report.
            timeout_s: bound on the whole watch; None watches until the job ends.

        Raises:
            NotFound: unknown job.
            Unavailable: the controller stayed unreachable for ``watch_reconnect_s``.
            DeadlineExceeded: ``timeout_s`` passed before the job ended.
        """
        end = None if timeout_s is None else time.monotonic() + timeout_s
        next_step, failures, last_contact = from_step, 0, time.monotonic()
        while True:
            segment = self.watch_segment_s
            if end is not None:
                segment = min(segment, end - time.monotonic())
                if segment <= 0:
                    raise DeadlineExceeded(f"job {job_id} did not end within {timeout_s:g} s",
                                           code="DEADLINE_EXCEEDED", method="WatchJob")
            call = self._stub.WatchJob(controller_pb2.WatchJobRequest(job_id=job_id, from_step=next_step),
                                       timeout=segment)
            try:
                ended = False
                for message in call:
                    report = _step_report(message)
                    last_contact, failures = time.monotonic(), 0
                    if report.step < next_step:  # a server replaying more than asked: skip, never repeat
                        continue
                    next_step = report.step + 1
                    yield report
                    ended = ended or report.is_terminal
                if ended or self.get_job(job_id).is_terminal:
                    return
                # a clean end without a terminal state (a server draining on shutdown): reopen
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    last_contact = time.monotonic()  # the segment ran out while connected: reopen at once
                    continue
                # UNAVAILABLE / CANCELLED: the controller restarted or the network blinked; RESOURCE_EXHAUSTED: the
                # controller's stream limits were full. Each is retried with back-off for watch_reconnect_s.
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                                grpc.StatusCode.RESOURCE_EXHAUSTED):
                    raise _error(e, "WatchJob", self.target) from None
                if time.monotonic() - last_contact > self.watch_reconnect_s:
                    raise _error(e, "WatchJob", self.target) from None
            finally:
                call.cancel()  # no-op once the stream ended; frees it when the caller stops early
            time.sleep(self._delay(min(failures, 8)))
            failures += 1
