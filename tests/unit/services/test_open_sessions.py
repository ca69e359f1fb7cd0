"""The rollout replica's hold on refits while multi-turn trajectories are in flight (env.partial finish):
bounded by the job's max_weight_lag and by how long a session has been idle."""

from __future__ import annotations

import time

from services.rollout.server import OpenSessions


def test_a_newer_version_waits_for_the_trajectories_of_the_held_one():
    s = OpenSessions(idle_s=60.0)
    assert s.hold(3, 4) is None  # nothing in flight
    s.used(["a", "b", None], 3, max_lag=1)
    assert "2 multi-turn trajectories of version 3" in s.hold(3, 4)
    assert s.hold(3, 5) is None  # never past max_weight_lag: the trainer would refuse those rows anyway
    s.release(["a"])
    assert "1 multi-turn" in s.hold(3, 4)
    s.release(["b", "never-opened"])
    assert s.hold(3, 4) is None


def test_a_synchronous_job_and_idle_or_other_version_sessions_never_hold():
    sync = OpenSessions(idle_s=60.0)
    sync.used(["a"], 3, max_lag=0)
    assert sync.hold(3, 4) is None  # synchronous GRPO: refits come between steps
    s = OpenSessions(idle_s=0.05)
    s.used(["old"], 2, max_lag=1)  # served by an older version: not this version's trajectory
    assert s.hold(3, 4) is None
    s.used(["idle"], 3, max_lag=1)
    time.sleep(0.1)
    assert s.hold(3, 4) is None  # a controller that went away stops holding the replica back
    assert s.hold(None, 0) is None  # holding nothing yet: the first version is always applied
