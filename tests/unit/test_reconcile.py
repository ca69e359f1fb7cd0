"""reconcile(): every resume case of a job, from its record and what the trainer and Redis hold."""

from __future__ import annotations

import pytest

from fp8rl.controller.reconcile import Lineage, Resume, reconcile

STARTED = [10, 11, 12, 13]  # steps 0..3 started from these versions; step 4 starts from NEXT
NEXT = 14


@pytest.mark.parametrize(("args", "want"), [
    # (started, next_version, held, lineage) -> what to do
    (([], None, 7, Lineage()), Resume("fresh", 0, next_version=7)),
    ((STARTED, NEXT, 14, Lineage()), Resume("in_step", 4)),  # the half-done step never trained: run it again
    ((STARTED, NEXT, 15, Lineage({15: 14})), Resume("trained", 4, finish=True)),  # trained, report missing
    # the trainer went back to where step 2 started
    ((STARTED, NEXT, 12, Lineage()), Resume("rolled_back", 2, next_version=12, truncate_to=2, drop_inflight=True)),
    ((STARTED, NEXT, 10, Lineage()), Resume("rolled_back", 0, next_version=10, truncate_to=0, drop_inflight=True)),
    # checkpoint of v12 (before step 2) republished as v16: drop steps >= 2, step 2 starts from v16
    ((STARTED, NEXT, 16, Lineage({}, {16: 12})),
     Resume("restored", 2, next_version=16, truncate_to=2, drop_inflight=True)),
    ((STARTED, NEXT, 16, Lineage({}, {16: 14})),
     Resume("restored", 4, next_version=16, truncate_to=4, drop_inflight=True)),
    # checkpoint of v15 (step 4 trained from v14, not reported) republished as v16: finish step 4
    ((STARTED, NEXT, 16, Lineage({15: 14}, {16: 15})), Resume("restored_next", 4, finish=True)),
    # versions need not be consecutive: a job that resumed once started steps 2, 3 from republished versions
    (([10, 11, 20, 21], 22, 23, Lineage({23: 22})), Resume("trained", 4, finish=True)),
    (([10, 11, 20, 21], 22, 30, Lineage({}, {30: 20})),
     Resume("restored", 2, next_version=30, truncate_to=2, drop_inflight=True)),
])
def test_each_case(args, want):
    assert reconcile(*args) == want


def test_no_case_is_decided_by_arithmetic():
    """held == next + 1 is not "trained" unless Redis says v15 was trained from v14 (e.g. another job's trainer)."""
    r = reconcile(STARTED, NEXT, 15, Lineage({15: 9}))
    assert r.case == "unknown" and "holds weight version 15 (trained from 9" in r.error


@pytest.mark.parametrize("args", [
    (STARTED, NEXT, 9, Lineage()), (STARTED, NEXT, 17, Lineage()), (STARTED, NEXT, 20, Lineage({}, {20: 9})),
    (STARTED, NEXT, 20, Lineage({17: 3}, {20: 17})),
])
def test_anything_else_fails_naming_the_versions(args):
    r = reconcile(*args)
    assert r.case == "unknown" and f"holds weight version {args[2]}" in r.error
    assert "next step starts from version 14" in r.error


def test_a_record_with_steps_but_no_next_version_is_refused():
    r = reconcile(STARTED, None, 14, Lineage())
    assert r.case == "unknown" and "no next_version" in r.error
