"""Every Redis key fp8rl uses, built in one place (DESIGN §3).

Invariant: no other module spells a Redis key. Every key of job ``J`` starts with ``fp8rl:J:``
(so one job never touches another's state and ``fp8rl:J:*`` lists all of it); the only key outside
a job's namespace is the global ``fp8rl:jobs`` index. Job ids, replica ids and versions are
validated here, so a key can never contain a glob character, a separator or a negative version.

Layout (``P = fp8rl:{job}:``):

======================  ===========  ======================================================
key                     type         meaning
======================  ===========  ======================================================
``P weights:latest``    int          newest published version (only increases)
``P weights:{v}:manifest``  bytes    manifest JSON of version v
``P weights:{v}:delta``  bytes       delta manifest JSON of v against an older base (optional)
``P weights:{v}:acks``  set          replica ids that applied v (weights and scales)
``P weights:{v}:trained_from``  int  the version whose optimizer step produced v
``P weights:{v}:restored_from``  int the checkpoint version v republishes (a trainer restart)
``P scales:{v}``        bytes        FP32 Q/K/V scales calibrated on version v
``P events``            stream       ``weights_published``, ``scales_published``, ``replica_fenced``
``P replicas:{id}``     hash + TTL   a replica's lease: endpoint, version, ttl
``P replicas``          set          index of replica ids that registered (lease may be gone)
``P agents:endpoints``  hash         replica id → base URL of its OpenAI-compatible endpoint (agent jobs' calls)
``P collective:members``  set        ids of replicas asking for the collective refit transport
``P collective:members:{id}``  bytes + TTL  a collective member's heartbeat (JSON; gone = left)
``P collective:epoch``  bytes        the current collective group (strict JSON: epoch, store, members)
``P job:state``         string       controller's job state (e.g. ``running``)
``P job:step``          int          last finished GRPO step
``P job:config``        bytes        the job's validated config (YAML/JSON bytes)
``P reward:graders``    set          grader names the job's reward service grades with (each ``--grader-module``
                                     included), written when it starts; SubmitJob checks ``reward.grader`` there
``P reward:envs``       set          environments the reward service's env workers run: registered names and
                                     ``module:`` entries for each ``--env-module``; SubmitJob checks ``env.name``
``fp8rl:jobs``          set          index of job ids
``fp8rl:jobs:created``  zset         every stored job id, scored by its submission time (ListJobs' order)
``fp8rl:jobs:state:{s}``  zset       the job ids in state ``s``, scored by submission time (the queue order)
``fp8rl:jobs:finished`` zset         terminal job ids, scored by when they ended (retention's order)
======================  ===========  ======================================================

The ``fp8rl:jobs*`` indexes are the controller's (:mod:`fp8rl.controller.jobstore`); they live outside any
job's namespace.
"""

from __future__ import annotations

import re

__all__ = ["Keys", "JOBS_INDEX", "validate_job_id", "validate_replica_id", "validate_version"]

ROOT = "fp8rl"
JOBS_INDEX = f"{ROOT}:jobs"

# Letters, digits, '_', '-', '.'; starts with a letter or digit. No ':' (our separator), no glob
# characters ('*', '?', '[') and no whitespace, so keys and SCAN patterns stay unambiguous.
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")


def _validate_id(kind: str, value: object) -> str:
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        raise ValueError(
            f"invalid {kind} {value!r}: expected 1-64 characters from [A-Za-z0-9_.-], starting with a letter or digit"
        )
    return value


def validate_job_id(job: object) -> str:
    """Return ``job`` if it is a valid job id, else raise ``ValueError`` naming it."""
    return _validate_id("job id", job)


def validate_replica_id(replica_id: object) -> str:
    """Return ``replica_id`` if it is a valid replica id, else raise ``ValueError`` naming it."""
    return _validate_id("replica id", replica_id)


def validate_version(version: object) -> int:
    """Return ``version`` if it is a non-negative int (bools refused), else raise ``ValueError``."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"weight version must be an int >= 0, got {version!r}")
    return version


class Keys:
    """Key builder for one job.

    Args:
        job: the job id; 1-64 characters from ``[A-Za-z0-9_.-]``.

    Example:
        >>> Keys("demo").manifest(3)
        'fp8rl:demo:weights:3:manifest'
    """

    def __init__(self, job: str) -> None:
        self.job = validate_job_id(job)
        self.prefix = f"{ROOT}:{job}:"

    def __repr__(self) -> str:
        return f"Keys({self.job!r})"

    # -- weights and scales -------------------------------------------------------------------
    def latest(self) -> str:
        """``weights:latest`` — the newest published version."""
        return f"{self.prefix}weights:latest"

    def manifest(self, version: int) -> str:
        """``weights:{v}:manifest`` — version v's manifest JSON."""
        return f"{self.prefix}weights:{validate_version(version)}:manifest"

    def delta(self, version: int) -> str:
        """``weights:{v}:delta`` — version v's delta manifest JSON (its ``base`` names the version it patches)."""
        return f"{self.prefix}weights:{validate_version(version)}:delta"

    def acks(self, version: int) -> str:
        """``weights:{v}:acks`` — set of replica ids that applied v."""
        return f"{self.prefix}weights:{validate_version(version)}:acks"

    def restored_from(self, version: int) -> str:
        """``weights:{v}:restored_from`` — set when v republishes an older checkpoint's weights (its version)."""
        return f"{self.prefix}weights:{validate_version(version)}:restored_from"

    def trained_from(self, version: int) -> str:
        """``weights:{v}:trained_from`` — set when an optimizer step from version u produced v (its value: u)."""
        return f"{self.prefix}weights:{validate_version(version)}:trained_from"

    def scales(self, version: int) -> str:
        """``scales:{v}`` — the Q/K/V scales calibrated on version v."""
        return f"{self.prefix}scales:{validate_version(version)}"

    def events(self) -> str:
        """``events`` — the job's event stream."""
        return f"{self.prefix}events"

    # -- replicas ------------------------------------------------------------------------------
    def replica(self, replica_id: str) -> str:
        """``replicas:{id}`` — one replica's lease hash (expires unless heartbeated)."""
        return f"{self.prefix}replicas:{validate_replica_id(replica_id)}"

    def replica_index(self) -> str:
        """``replicas`` — set of replica ids that registered (their leases may have expired)."""
        return f"{self.prefix}replicas"

    def agent_endpoints(self) -> str:
        """``agents:endpoints`` — hash replica id → the base URL of its OpenAI-compatible endpoint (agent jobs)."""
        return f"{self.prefix}agents:endpoints"

    # -- collective refit transport (transport/collective.py) ------------------------------------
    def collective_members(self) -> str:
        """``collective:members`` — set of replica ids that registered for collective refits."""
        return f"{self.prefix}collective:members"

    def collective_member(self, replica_id: str) -> str:
        """``collective:members:{id}`` — one member's heartbeat (expires unless renewed: then it left)."""
        return f"{self.prefix}collective:members:{validate_replica_id(replica_id)}"

    def collective_epoch(self) -> str:
        """``collective:epoch`` — the trainer's current collective group: epoch, store endpoint, ranks."""
        return f"{self.prefix}collective:epoch"

    # -- job state (controller) ----------------------------------------------------------------
    def job_state(self) -> str:
        """``job:state`` — the controller's state string for this job."""
        return f"{self.prefix}job:state"

    def job_step(self) -> str:
        """``job:step`` — the last finished GRPO step."""
        return f"{self.prefix}job:step"

    def job_config(self) -> str:
        """``job:config`` — the job's validated config bytes."""
        return f"{self.prefix}job:config"

    def job_info(self) -> str:
        """``job:info`` — hash of the controller's bookkeeping fields for this job."""
        return f"{self.prefix}job:info"

    def job_reports(self) -> str:
        """``job:reports`` — list of JSON step reports, index == step."""
        return f"{self.prefix}job:reports"

    # -- reward service -----------------------------------------------------------------------
    def graders(self) -> str:
        """``reward:graders`` — the grader names the job's reward service knows."""
        return f"{self.prefix}reward:graders"

    def envs(self) -> str:
        """``reward:envs`` — the environments the reward service's env workers run (names, ``module:`` entries)."""
        return f"{self.prefix}reward:envs"

    # -- the controller's job indexes (outside any job's namespace) ----------------------------
    @staticmethod
    def jobs_index() -> str:
        """``fp8rl:jobs`` — the global set of job ids (outside any job's namespace)."""
        return JOBS_INDEX

    @staticmethod
    def jobs_created() -> str:
        """``fp8rl:jobs:created`` — every stored job id, scored by submission time."""
        return f"{JOBS_INDEX}:created"

    @staticmethod
    def jobs_in_state(state: str) -> str:
        """``fp8rl:jobs:state:{state}`` — the job ids in ``state``, scored by submission time."""
        if not re.fullmatch(r"[a-z]{1,16}", state):
            raise ValueError(f"job state {state[:40]!r} is not a state name")
        return f"{JOBS_INDEX}:state:{state}"

    @staticmethod
    def jobs_finished() -> str:
        """``fp8rl:jobs:finished`` — terminal job ids, scored by when they ended."""
        return f"{JOBS_INDEX}:finished"

    def pattern(self) -> str:
        """SCAN pattern matching every key of this job (``fp8rl:{job}:*``)."""
        return f"{self.prefix}*"
