"""The controller's outage accounting: a failed try's work that the next try keeps is not counted as lost."""

from __future__ import annotations

from services.controller.runner import kept_seconds

PHASES = {"rollout": 3.0, "reward": 0.5, "logprobs": 0.25, "train": 2.0}


def test_a_record_made_during_the_failed_try_keeps_its_phases():
    # the try began at t=100 and trained (its record started at t=101) before its calibrate call failed: the
    # report will count these 5.75 s as phases, so the outage must not count them again
    assert kept_seconds({"started_unix": 101.0, "phase_times": PHASES}, since_unix=100.0) == 5.75


def test_an_older_record_or_none_keeps_nothing():
    # a record left by an earlier try (already subtracted then) or no record at all: the whole try was lost
    assert kept_seconds({"started_unix": 99.0, "phase_times": PHASES}, since_unix=100.0) == 0.0
    assert kept_seconds(None, since_unix=100.0) == 0.0
    assert kept_seconds({"phase_times": PHASES}, since_unix=100.0) == 0.0  # a recovered record has no start
