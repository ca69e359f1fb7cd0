"""The environment worker pool (fp8rl.envs.worker_pool): real worker processes running the bundled calculator and
environments that crash, hang, exit, hog memory or answer malformed — each ends only its own call, with a status,
and the pool keeps its width."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fp8rl.envs import CalculatorEnv, format_tool_call
from fp8rl.envs.worker_pool import EnvWorkerPool, Rlimits

TIMEOUT_S = 2.0  # the per-call bound these tests run under


@pytest.fixture(scope="module")
def pool():
    with pytest.MonkeyPatch.context() as mp:  # spawned workers inherit sys.path: they import pool_envs from here
        mp.syspath_prepend(str(Path(__file__).resolve().parent))
        p = EnvWorkerPool(2, modules=("pool_envs",), rlimits=Rlimits(memory_mb=1024), timeout_s=TIMEOUT_S)
        yield p
        p.close_all()


def test_calculator_runs_in_a_worker_as_in_process(pool):
    task = {"question": "What is 347*29?", "answer": "10063"}
    r = pool.reset("calc-1", "calculator", {}, task)
    local = CalculatorEnv()
    assert r.status == "ok" and r.messages == local.reset(task) and r.tools == local.tools()
    call = format_tool_call("calculator", {"expression": "347*29"})
    s = pool.step("calc-1", call)
    assert s.status == "ok" and not s.done and s.messages == local.step(call).messages
    s = pool.step("calc-1", "Answer: 10063")
    assert s.status == "ok" and s.done and s.reward == 1.0 and s.info["tool_calls"] == 1
    assert pool.close(["calc-1"]) == 1 and pool.step("calc-1", "x").status == "lost"


@pytest.mark.parametrize("cmd, status", [("raise", "error"), ("nan", "error"), ("bad", "error")])
def test_a_failing_or_malformed_step_is_an_error_and_the_worker_lives(pool, cmd, status):
    pool.reset(f"m-{cmd}", "pool_envs:Misbehave", {}, {"question": "q"})
    pool.reset(f"n-{cmd}", "pool_envs:Misbehave", {}, {"question": "q"})
    restarts = pool.counts["restarts"]
    r = pool.step(f"m-{cmd}", cmd)
    assert r.status == status and r.error
    assert pool.counts["restarts"] == restarts
    assert pool.step(f"n-{cmd}", "fine").status == "ok"  # its neighbours are untouched
    pool.close([f"m-{cmd}", f"n-{cmd}"])


@pytest.mark.parametrize("cmd, status", [("sleep", "timeout"), ("exit", "error"), ("hog", "error")])
def test_a_hung_or_dead_worker_is_replaced_and_its_other_trajectories_replayed(pool, cmd, status):
    ids = [f"{cmd}-{i}" for i in range(4)]  # least-loaded placement: two per worker
    for i in ids:
        assert pool.reset(i, "pool_envs:Misbehave", {}, {"question": "q"}).status == "ok"
        assert pool.step(i, "again").messages == [{"role": "user", "content": "go on"}]  # a history to replay
    restarts, replays = pool.counts["restarts"], pool.counts["replays"]
    t = time.monotonic()
    r = pool.step(ids[0], cmd)
    assert r.status == status and r.error, r
    if cmd == "hog":  # the 1 GiB address-space limit: the allocation fails inside the worker, which lives
        assert "MemoryError" in r.error and pool.counts["restarts"] == restarts
        pool.close(ids)
        return
    assert time.monotonic() - t < TIMEOUT_S + 5
    assert pool.counts["restarts"] == restarts + 1
    # its neighbour on the killed worker is re-created elsewhere by replaying its reset and step: it goes on
    assert [pool.step(i, "again").status for i in ids[1:]] == ["ok", "ok", "ok"]
    assert pool.counts["replays"] == replays + 1
    assert pool.step(ids[0], "again").status == "lost"  # the culprit's own environment is gone
    assert pool.reset(f"{cmd}-new", "pool_envs:Misbehave", {}, {"question": "q"}).status == "ok"
    assert pool.step(f"{cmd}-new", "done").reward == 1.0
    pool.close([*ids, f"{cmd}-new"])


def test_an_environment_that_replays_differently_is_lost_naming_why(pool):
    ids = [f"fickle-{i}" for i in range(4)]
    for i in ids:
        pool.reset(i, "pool_envs:Fickle", {}, {"question": "q"})
        assert pool.step(i, "again").status == "ok"
    assert pool.step(ids[0], "exit").status == "error"
    outcomes = [pool.step(i, "done") for i in ids[1:]]
    lost = [r for r in outcomes if r.status == "lost"]
    assert len(lost) == 1 and "not deterministic" in lost[0].error  # the one beside it on the dead worker
    assert sorted(r.status for r in outcomes) == ["lost", "ok", "ok"]
    pool.close(ids)


def test_reset_errors_and_refusals(pool):
    r = pool.reset("bad-task", "calculator", {}, {"question": "no answer key"})
    assert r.status == "error" and "answer" in r.error
    assert pool.step("bad-task", "x").status == "lost"
    r = pool.reset("bad-kw", "calculator", {"nope": 1}, {"question": "1*2", "answer": "2"})
    assert r.status == "error" and "nope" in r.error
    pool.reset("dup", "calculator", {}, {"question": "What is 1*2?", "answer": "2"})
    with pytest.raises(ValueError, match="open already"):
        pool.reset("dup", "calculator", {}, {"question": "What is 1*2?", "answer": "2"})
    pool.close(["dup"])


def test_a_module_that_does_not_import_is_a_clear_start_error():
    with pytest.raises(RuntimeError, match="env-module"):
        EnvWorkerPool(1, modules=("no_such_module_for_fp8rl",), start_timeout_s=60)
