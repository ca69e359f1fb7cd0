"""ProcessGradingPool: the same results as the thread pool, and a hung or dying grader costs one item its
time bound and its worker, never the pool's width."""

from __future__ import annotations

import time

import pytest

from fp8rl.data.process_pool import ProcessGradingPool
from fp8rl.data.scoring import GradingPool, grade_many, is_graded

GRADERS_MODULE = """
import os
import time
from fp8rl.data import register_grader

def sleepy(response, answer):
    time.sleep(float(response))
    return 1.0

def dies(response, answer):
    os._exit(3)  # the worker process vanishes mid-item

register_grader("pp_sleepy", sleepy)
register_grader("pp_dies", dies)
"""
TIMEOUT_S = 1.5  # per-item bound; sleepy items below ask for 60 s


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("graders")
    (tmp / "pp_graders.py").write_text(GRADERS_MODULE)
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(tmp))  # spawned workers get the parent's sys.path
    import pp_graders  # noqa: F401 - registers the names here, where grade_many checks them

    p = ProcessGradingPool(2, modules=("pp_graders",), eager=True)
    yield p
    p.close()
    mp.undo()


ITEMS = [("exact_match", "the answer is 12", "12"), ("exact_match", "13", "12"), ("exact_match", "", "12"),
         ("math_verify", "\\boxed{\\frac{1}{2}}", "0.5")]


def test_same_results_as_the_thread_pool(pool):
    assert grade_many(ITEMS, 10.0, pool=pool) == grade_many(ITEMS, 10.0, pool=GradingPool(2))


def test_a_hung_grader_times_out_its_worker_is_replaced_and_the_pool_keeps_its_width(pool):
    before = pool.restarts
    items = [("pp_sleepy", "60", "1")] * 3 + [("exact_match", "7", "7")]
    t = time.monotonic()
    results = grade_many(items, TIMEOUT_S, pool=pool)
    took = time.monotonic() - t
    assert [r.status for r in results] == ["timeout", "timeout", "timeout", "ok"]
    assert not any(is_graded(r.status) for r in results[:3]) and results[3].reward == 1.0
    assert pool.restarts - before == 3
    assert took < 30, f"three hung items held the batch {took:.0f} s"
    again = grade_many([("exact_match", "5", "5")] * 4, TIMEOUT_S * 10, pool=pool)  # fresh workers grade
    assert [(r.reward, r.status) for r in again] == [(1.0, "ok")] * 4


def test_a_worker_that_dies_mid_item_is_an_error_and_the_next_item_is_graded(pool):
    results = grade_many([("pp_dies", "x", "1"), ("exact_match", "3", "3")], 10.0, pool=pool)
    assert results[0].status == "error" and "died" in results[0].detail
    assert (results[1].reward, results[1].status) == (1.0, "ok")


def test_unknown_grader_fails_the_batch_before_anything_runs(pool):
    with pytest.raises(ValueError, match="unknown grader"):
        grade_many([("exact_match", "1", "1"), ("nope", "1", "1")], 1.0, pool=pool)


def test_width_must_be_positive():
    with pytest.raises(ValueError, match="max_workers must be >= 1"):
        ProcessGradingPool(0)
