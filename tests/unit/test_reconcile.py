"""reconcile(): every resume case of a job, from its record and what the trainer and Redis hold."""

from __future__ import annotations

import pytest

from fp8rl.controller.reconcile import Resume, reconcile


@pytest.mark.parametrize(("args", "want"), [
    # (base, n finished, held, restored_from) -> what to do
    ((None, 0, 7, None), Resume("fresh", 0, base_version=7)),
    ((None, 3, 7, None), Resume("fresh", 3, base_version=4)),  # a record written before base_version existed
    ((10, 4, 14, None), Resume("in_step", 4)),  # the half-done step never trained: run it again
    ((10, 4, 15, None), Resume("trained", 4, finish=True)),  # trained, report missing: finish it
    ((10, 4, 12, None), Resume("rolled_back", 2, truncate_to=2)),  # trainer went back two versions
    ((10, 4, 10, None), Resume("rolled_back", 0, truncate_to=0)),
    # checkpoint of v12 (after step 1) republished as v16: drop steps >= 2, step 2 starts from v16
    ((10, 4, 16, 12), Resume("restored", 2, base_version=14, truncate_to=2, drop_inflight=True)),
    ((10, 4, 16, 14), Resume("restored", 4, base_version=12, truncate_to=4, drop_inflight=True)),
    # checkpoint of v15 (step 4 trained, not reported) republished as v16: finish step 4
    ((10, 4, 16, 15), Resume("restored_next", 4, finish=True, base_version=11)),
])
def test_each_case(args, want):
    assert reconcile(*args) == want


@pytest.mark.parametrize("args", [(10, 4, 9, None), (10, 4, 17, None), (10, 4, 20, 9), (10, 4, 20, 17)])
def test_anything_else_fails_naming_both_versions(args):
    r = reconcile(*args)
    assert r.case == "unknown" and f"holds weight version {args[2]}" in r.error and "expects 14" in r.error
