"""Where a job resumes: a pure function of its record and of what the trainer and Redis hold.

A job records ``base_version`` (the trainer's version at its step 0, moved when a checkpoint is
republished) and ``n`` finished steps, so the trainer should hold ``base + n``. :func:`reconcile`
compares that with the version the trainer holds (``held``) and, when Redis marks ``held`` as a
republished checkpoint, the version it was restored from (``restored_from``), and says what to do:

=================  =======================================================================  =====================
case               meaning                                                                   action
=================  =======================================================================  =====================
``fresh``          the job never ran a step: ``base = held - n``                             run step ``n``
``in_step``        ``held == base + n``: the half-done step never trained                    run step ``n`` again
``restored``       ``held`` republishes the checkpoint of ``base + k``, ``k <= n``           drop steps >= k, run k
``restored_next``  ``held`` republishes the checkpoint of ``base + n + 1`` (step n trained)  finish step n
``trained``        ``held == base + n + 1``: step n trained, its report is missing            finish step n
``rolled_back``    ``base <= held < base + n``: the trainer went back to an older version    drop steps >= held-base
``unknown``        anything else                                                             fail the job
=================  =======================================================================  =====================
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Resume", "reconcile"]


@dataclass(frozen=True)
class Resume:
    """What the runner does before the next step.

    Attributes:
        case: one of the cases above.
        step: the step to run next, or (``finish`` true) the trained step to finish.
        finish: step ``step`` was trained and only needs calibrate → refit → its report.
        base_version: the job's base version from now on (None: unchanged).
        truncate_to: drop the reports of steps >= this (None: keep all).
        drop_inflight: forget the saved half-done step.
        error: why the job cannot resume (``case == "unknown"``).
    """

    case: str
    step: int
    finish: bool = False
    base_version: int | None = None
    truncate_to: int | None = None
    drop_inflight: bool = False
    error: str = ""


def reconcile(base: int | None, n: int, held: int, restored_from: int | None) -> Resume:
    """The :class:`Resume` of a job with ``n`` finished steps from ``base`` when the trainer holds ``held``
    (``restored_from``: the checkpoint version Redis marks ``held`` as republished from, or None)."""
    if base is None:
        return Resume("fresh", n, base_version=held - n)
    expected = base + n
    if held == expected:
        return Resume("in_step", n)
    origin = restored_from
    if origin is not None and base <= origin <= expected:
        k = origin - base  # the checkpoint taken after step k-1, republished as `held`
        return Resume("restored", k, base_version=held - k, truncate_to=k, drop_inflight=True)
    if origin == expected + 1:  # checkpointed right after step n trained, before its report
        return Resume("restored_next", n, finish=True, base_version=held - n - 1)
    if held == expected + 1:
        return Resume("trained", n, finish=True)
    if base <= held < expected:
        return Resume("rolled_back", held - base, truncate_to=held - base)
    return Resume("unknown", n, error=f"cannot resume: the trainer holds weight version {held}, but after {n} "
                                      f"finished steps from version {base} the job expects {expected}")
