"""What the SDK hands back: frozen dataclasses and exceptions, no proto or gRPC types.

The client (:mod:`fp8rl.sdk.client`) converts wire messages into these at the boundary, so code
using the SDK never imports ``fp8rl.rpc`` and survives proto changes that keep the meaning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = [
    "JOB_STATES",
    "TERMINAL_STATES",
    "AlreadyExists",
    "DeadlineExceeded",
    "Fp8rlError",
    "InvalidArgument",
    "JobInfo",
    "NotFound",
    "PhaseTimes",
    "StepReport",
    "Unauthenticated",
    "Unavailable",
]

# Job states as the controller reports them (controller.proto); the last three never change again.
JOB_STATES = ("pending", "running", "succeeded", "failed", "cancelled")
TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})


@dataclass(frozen=True)
class PhaseTimes:
    """Wall-clock seconds per phase of one GRPO step (DESIGN §2); 0 for a phase that did not run."""

    rollout: float = 0.0
    reward: float = 0.0
    logprobs: float = 0.0
    train: float = 0.0
    publish: float = 0.0
    calibrate: float = 0.0
    refit: float = 0.0
    total: float = 0.0
    outage: float = 0.0  # lost to failed tries of the step and the back-off before retrying them

    @property
    def calibrate_share(self) -> float:
        """Calibration's fraction of the step (a headline figure; target <= 0.02); 0 when total is 0."""
        return self.calibrate / self.total if self.total > 0 else 0.0


@dataclass(frozen=True)
class StepReport:
    """One finished GRPO step of a job.

    Attributes:
        job_id: the job.
        step: 0-based index of the finished step.
        weight_version: the version the step's rollouts were generated with.
        reward_mean: mean reward over the step's samples.
        accuracy: fraction of samples graded correct.
        metrics: everything else by name (``token_mult_prob_error``, ``mismatch/max_abs_logprob_diff``, KL
            estimates, loss, ...), read-only.
        phase_times: time per phase.
        state: the job's state after this step.
        trajectories_md: multi-turn jobs: a few of the step's trajectories as Markdown (model and environment
            tokens told apart); "" otherwise.
        pictures: vision-language jobs: a few of the step's picture prompts with the first answer sampled for
            each, as ``(image files, prompt, reference, sampled, right)`` (what :func:`fp8rl.report.write_pictures`
            writes); empty otherwise.
    """

    job_id: str
    step: int
    weight_version: int
    reward_mean: float
    accuracy: float
    metrics: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    phase_times: PhaseTimes = field(default_factory=PhaseTimes)
    state: str = "running"
    trajectories_md: str = ""
    pictures: tuple[tuple[tuple[bytes, ...], str, str, str, bool], ...] = ()

    def __post_init__(self):
        if not isinstance(self.metrics, MappingProxyType):
            object.__setattr__(self, "metrics", MappingProxyType(dict(self.metrics)))

    @property
    def token_mult_prob_error(self) -> float | None:
        """``mean(exp(|prev - gen|))`` over generated tokens (1.0 = identical numerics); None if not reported."""
        return self.metrics.get("token_mult_prob_error")

    @property
    def max_abs_logprob_diff(self) -> float | None:
        """``max(|prev - gen|)`` over generated tokens on the raw logprobs: 0.0 iff the trainer's logprobs were
        bitwise the rollout's (the exactness verdict, ``mismatch/max_abs_logprob_diff``); None if not reported."""
        return self.metrics.get("mismatch/max_abs_logprob_diff")

    @property
    def is_terminal(self) -> bool:
        """True when the job ended with this step."""
        return self.state in TERMINAL_STATES


@dataclass(frozen=True)
class JobInfo:
    """One job's summary.

    Attributes:
        job_id: the job.
        state: ``pending``, ``running``, ``succeeded``, ``failed`` or ``cancelled``.
        step: steps finished so far.
        total_steps: steps the job will run.
        error: why it failed ("" unless ``state`` is ``failed``).
        created_unix: submission time, Unix seconds.
        updated_unix: time of the last state change, Unix seconds.
    """

    job_id: str
    state: str
    step: int = 0
    total_steps: int = 0
    error: str = ""
    created_unix: float = 0.0
    updated_unix: float = 0.0

    @property
    def is_terminal(self) -> bool:
        """True once the job can no longer change (succeeded, failed or cancelled)."""
        return self.state in TERMINAL_STATES


class Fp8rlError(Exception):
    """A call to an fp8rl service failed; ``str(e)`` is the server's message.

    Attributes:
        code: the gRPC status name (``"NOT_FOUND"``, ``"UNAVAILABLE"``, ...).
        details: the server's message.
        method: the RPC that failed (``"GetJob"``), or "" when not known.
    """

    def __init__(self, details: str, *, code: str = "UNKNOWN", method: str = ""):
        super().__init__(details)
        self.code, self.details, self.method = code, details, method

    def __str__(self) -> str:
        where = f"{self.method}: " if self.method else ""
        return f"{where}{self.details} ({self.code})"


class NotFound(Fp8rlError):
    """The job (or other named thing) does not exist."""


class InvalidArgument(Fp8rlError):
    """The server rejected the request's content (e.g. a job file it could not accept)."""


class AlreadyExists(Fp8rlError):
    """A job with the requested ``job_id`` already exists."""


class Unavailable(Fp8rlError):
    """The server could not be reached or did not answer in time (retries included)."""


class Unauthenticated(Fp8rlError):
    """The server wants a bearer token and none (or a wrong one) was sent."""


class PermissionDenied(Fp8rlError):
    """The token sent is valid but of the wrong scope (e.g. the service token on the JobService)."""


class DeadlineExceeded(Unavailable):
    """The server did not answer within the call's deadline (it may be overloaded or hung)."""
