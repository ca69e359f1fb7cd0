"""Typed gRPC client SDK and the ``fp8rl`` CLI; speaks only the wire (DESIGN §6).

::

    from fp8rl.sdk import Fp8rlClient

    with Fp8rlClient("controller:50050", token="...") as client:
        job_id = client.submit_job("job.yaml")          # validated locally first (ConfigError)
        for report in client.watch(job_id):             # StepReport per finished step
            print(report.step, report.reward_mean, report.token_mult_prob_error)

* :mod:`.client` — :class:`Fp8rlClient` (deadlines, retries of idempotent calls, resumable watch).
* :mod:`.types` — frozen dataclasses (:class:`JobInfo`, :class:`StepReport`, :class:`PhaseTimes`)
  and the exceptions (:class:`Fp8rlError` and its subclasses).
* :mod:`.cli` — the ``fp8rl`` command (``fp8rl.sdk.cli:main``).

Invariant: the SDK speaks only the controller's JobService with the client token; it imports no engine, and
it validates a job file locally with the same schema the controller uses.
"""

from fp8rl.config import ConfigError

from .client import DEFAULT_TARGET, ENV_TARGET, Fp8rlClient, load_job_text, resolve_target
from .types import (
    JOB_STATES,
    TERMINAL_STATES,
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

__all__ = [
    "DEFAULT_TARGET",
    "ENV_TARGET",
    "JOB_STATES",
    "TERMINAL_STATES",
    "AlreadyExists",
    "ConfigError",
    "DeadlineExceeded",
    "Fp8rlClient",
    "Fp8rlError",
    "InvalidArgument",
    "JobInfo",
    "NotFound",
    "PermissionDenied",
    "PhaseTimes",
    "StepReport",
    "Unauthenticated",
    "Unavailable",
    "load_job_text",
    "resolve_target",
]
