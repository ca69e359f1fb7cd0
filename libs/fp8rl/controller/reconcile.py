"""Where a job resumes: a pure function of its record and of what the trainer and Redis hold.

No version is inferred by arithmetic. The job record holds the version each finished step started
from (``started``: its reports' ``weight_version``) and the version the next step starts from
(``next_version``, written with each report). Redis holds each version's lineage, written by the
trainer before it publishes: ``trained_from`` (the version whose optimizer step produced it) and
``restored_from`` (the checkpoint version a restarted trainer republished). :func:`reconcile`
compares them with the version the trainer holds (``held``) and says what to do:

=================  ============================================================================  ==================
case               meaning                                                                        action
=================  ============================================================================  ==================
``fresh``          the job never ran a step (no ``next_version``)                                 run step 0 from held
``in_step``        ``held == next_version``: the half-done step never trained                     run step n again
``trained``        ``trained_from[held] == next_version``: step n trained, its report is missing  finish step n
``restored``       ``restored_from[held]`` is the version step k started from (or next_version)   drop steps >= k, run k
``restored_next``  ``restored_from[held]`` was trained from ``next_version`` (step n's update)    finish step n
``rolled_back``    ``held`` is the version step k < n started from                                drop steps >= k
``unknown``        anything else                                                                  fail the job
=================  ============================================================================  ==================
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Lineage", "Resume", "reconcile"]


@dataclass(frozen=True)
class Lineage:
    """What Redis says of versions: ``trained_from[v]`` and ``restored_from[v]`` (absent: no record)."""

    trained_from: Mapping[int, int] = field(default_factory=dict)
    restored_from: Mapping[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Resume:
    """What the runner does before the next step.

    Attributes:
        case: one of the cases above.
        step: the step to run next, or (``finish`` true) the trained step to finish.
        finish: step ``step`` was trained and only needs calibrate → refit → its report; its update is
            ``held`` and it started from the record's ``next_version``.
        next_version: the version the next step starts from, to record (None: the record's is right).
        truncate_to: drop the reports of steps >= this (None: keep all).
        drop_inflight: forget the saved half-done step.
        error: why the job cannot resume (``case == "unknown"``).
    """

    case: str
    step: int
    finish: bool = False
    next_version: int | None = None
    truncate_to: int | None = None
    drop_inflight: bool = False
    error: str = ""


def reconcile(started: Sequence[int], next_version: int | None, held: int, lineage: Lineage) -> Resume:
    """The :class:`Resume` of a job whose finished steps started from ``started`` (in step order) and whose
    next step starts from ``next_version`` (None before its first step), when the trainer holds ``held``."""
    n = len(started)
    if next_version is None:
        if n:
            return Resume("unknown", n, error=f"cannot resume: the job record has {n} finished steps but no "
                                              f"next_version (written by an older controller)")
        return Resume("fresh", 0, next_version=held)
    if held == next_version:
        return Resume("in_step", n)
    if lineage.trained_from.get(held) == next_version:
        return Resume("trained", n, finish=True)
    position = {v: k for k, v in enumerate(started)} | {next_version: n}  # version -> the step that starts there
    origin = lineage.restored_from.get(held)
    if origin is not None:
        if origin in position:  # the checkpoint taken before step k, republished as `held`
            k = position[origin]
            return Resume("restored", k, next_version=held, truncate_to=k, drop_inflight=True)
        if lineage.trained_from.get(origin) == next_version:  # checkpointed right after step n trained, unrecorded
            return Resume("restored_next", n, finish=True)
    if held in position:  # the trainer went back to the version step k started from
        k = position[held]
        return Resume("rolled_back", k, next_version=held, truncate_to=k, drop_inflight=True)
    return Resume("unknown", n, error=f"cannot resume: the trainer holds weight version {held} (trained from "
                                      f"{lineage.trained_from.get(held)}, restored from {origin}), but after {n} "
                                      f"finished steps the job's next step starts from version {next_version}")
