"""The math_verify grader and the time-bounded scoring around every grader (fp8rl.data.scoring)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from fp8rl.data import GRADERS, get_grader, register_grader
from fp8rl.data.math_verify_grader import MathVerifyGrader, math_verify_grader
from fp8rl.data.scoring import GradeResult, GradingPool, grade_many, grade_with_status

# Slack on top of a timeout for thread scheduling on a loaded 2-core CI box.
TIMEOUT_SLACK_S = 1.0


@pytest.fixture
def blocking_grader():
    """Registers a grader that blocks until released (a hung sympy call); yields (name, release)."""
    release = threading.Event()
    name = f"test_blocking_{uuid.uuid4().hex[:8]}"

    def grader(response: str, answer: str) -> float:
        release.wait(30)
        return 1.0

    register_grader(name, grader)
    yield name, release
    release.set()
    GRADERS.pop(name, None)


@pytest.fixture
def temp_grader():
    """Registers graders under fresh names for one test; yields a ``register(fn) -> name`` helper."""
    names = []

    def register(fn):
        name = f"test_{uuid.uuid4().hex[:8]}"
        register_grader(name, fn)
        names.append(name)
        return name

    yield register
    for name in names:
        GRADERS.pop(name, None)


def test_registered_under_math_verify():
    assert get_grader("math_verify") is math_verify_grader
    assert isinstance(math_verify_grader, MathVerifyGrader)
    assert math_verify_grader("so \\boxed{4}", "4") == 1.0  # usable as a plain (response, answer) -> float


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("Adding gives \\boxed{12}.", "12"),
        ("The answer is $\\boxed{\\frac{1}{2}}$", "0.5"),
        ("\\boxed{0.5}", "\\frac{1}{2}"),
        ("\\boxed{1/2}", "\\dfrac{1}{2}"),
        ("\\boxed{\\frac12}", "1/2"),
        ("\\boxed{1,000}", "1000"),
        ("\\boxed{x+1}", "1+x"),
        ("\\boxed{\\{1,2\\}}", "\\{2,1\\}"),
        ("first 3 then 4, so \\boxed{10}", "\\boxed{10}"),  # an already-boxed reference
        ("The answer is 7", "7"),  # no box: math_verify falls back to the last expression
    ],
)
def test_equivalent_forms_score_one(response, answer):
    assert grade_with_status("math_verify", response, answer, 10.0) == (1.0, "ok")


@pytest.mark.parametrize(("response", "answer"), [("\\boxed{3}", "4"), ("\\boxed{0.51}", "1/2"), ("\\boxed{x}", "y")])
def test_wrong_answer_scores_zero_ok(response, answer):
    assert grade_with_status("math_verify", response, answer, 10.0) == (0.0, "ok")


@pytest.mark.parametrize("response", ["hello world", "", "   ", "\\boxed{", "\\boxed{}", "\\boxed{!!@#}", None, 42])
def test_garbage_is_unparsable(response):
    result = math_verify_grader.grade(response, "3")
    assert (result.reward, result.status) == (0.0, "unparsable")
    assert result.detail
    assert grade_with_status("math_verify", response, "3", 10.0) == (0.0, "unparsable")


@pytest.mark.parametrize("answer", ["", "  ", None])
def test_unusable_reference_is_an_error_not_a_crash(answer):
    result = math_verify_grader.grade("\\boxed{3}", answer)
    assert (result.reward, result.status) == (0.0, "error")
    assert "reference" in result.detail


def test_malformed_reference_scores_zero():
    assert math_verify_grader("\\boxed{3}", "\\frac{") == 0.0


def test_exact_match_statuses_via_scoring():
    assert grade_with_status("exact_match", "so 12", "12", 5.0) == (1.0, "ok")
    assert grade_with_status("exact_match", "so 13", "12", 5.0) == (0.0, "ok")
    assert grade_with_status("exact_match", "no idea", "12", 5.0) == (0.0, "unparsable")


def test_concurrent_batch_is_consistent():
    items = [("math_verify", f"\\boxed{{\\frac{{{i}}}{{4}}}}", str(i / 4)) for i in range(1, 25)]
    items += [("math_verify", f"\\boxed{{{i}}}", str(i + 1)) for i in range(8)]
    results = grade_many(items, 10.0, pool=GradingPool(max_workers=4))
    assert [r.reward for r in results] == [1.0] * 24 + [0.0] * 8
    assert {r.status for r in results} == {"ok"}


def test_timeout_scores_zero_without_blocking_the_batch(blocking_grader):
    name, _ = blocking_grader
    pool = GradingPool(max_workers=2)
    timeout_s = 0.3
    start = time.monotonic()
    results = grade_many([(name, "x", "y"), ("exact_match", "\\boxed{5}", "5"), (name, "x", "y")], timeout_s, pool=pool)
    elapsed = time.monotonic() - start
    assert [(r.reward, r.status) for r in results] == [(0.0, "timeout"), (1.0, "ok"), (0.0, "timeout")]
    assert "0.3" in results[0].detail
    assert elapsed < timeout_s + TIMEOUT_SLACK_S
    # The hung workers were replaced: the pool still grades at full speed.
    assert pool.stuck == 2
    assert grade_with_status("exact_match", "7", "7", timeout_s, pool=pool) == (1.0, "ok")


def test_saturated_pool_fails_fast_then_recovers(blocking_grader):
    name, release = blocking_grader
    pool = GradingPool(max_workers=1, max_stuck=0)  # no replacements: the one worker hangs
    assert grade_with_status(name, "x", "y", 0.2, pool=pool) == (0.0, "timeout")
    start = time.monotonic()
    assert grade_with_status("exact_match", "7", "7", 0.2, pool=pool) == (0.0, "error")  # no waiting forever
    assert time.monotonic() - start < 0.1
    release.set()  # the hung grader returns; its late result is dropped and the thread rejoins
    deadline = time.monotonic() + 5
    while pool.stuck and time.monotonic() < deadline:
        time.sleep(0.01)
    assert grade_with_status("exact_match", "7", "7", 1.0, pool=pool) == (1.0, "ok")


def test_contract_breaking_graders_score_zero_with_error(temp_grader):
    def raises(response, answer):
        raise RuntimeError("boom")

    raising, too_big, nan = temp_grader(raises), temp_grader(lambda r, a: 2.0), temp_grader(lambda r, a: float("nan"))
    results = grade_many([(raising, "1", "1"), (too_big, "1", "1"), (nan, "1", "1")], 5.0)
    assert [(r.reward, r.status) for r in results] == [(0.0, "error")] * 3
    assert "boom" in results[0].detail and "outside [0, 1]" in results[1].detail


def test_detailed_grader_status_is_used(temp_grader):
    class Picky:
        def __call__(self, response, answer):
            return self.grade(response, answer).reward

        def grade(self, response, answer):
            return GradeResult(0.0, "unparsable", "picky") if response == "?" else GradeResult(0.5, "ok")

    name = temp_grader(Picky())
    assert grade_with_status(name, "?", "a", 5.0) == (0.0, "unparsable")
    assert grade_with_status(name, "fine", "a", 5.0) == (0.5, "ok")


def test_unknown_grader_and_bad_timeout_raise():
    with pytest.raises(ValueError, match="known graders: .*exact_match.*math_verify"):
        grade_with_status("nope", "1", "1", 5.0)
    with pytest.raises(ValueError, match="timeout_s"):
        grade_with_status("exact_match", "1", "1", 0)
    assert grade_many([], 5.0) == []


GSM8K_ANSWER = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nSo 48+24 = <<48+24=72>>72 in all.\n#### 72"


@pytest.mark.parametrize(("response", "answer", "reward"), [
    ("#### 72", GSM8K_ANSWER, 1.0),  # the reference's worked solution is read after its last ####
    ("\\boxed{72}", GSM8K_ANSWER, 1.0),
    ("\\boxed{71}", GSM8K_ANSWER, 0.0),
    ("so 3 + 4 = 7\n#### 7\nand 9 more words", "7", 1.0),  # the #### answer, not the last number
    ("#### 1,234", "1234", 1.0),  # grouping commas are not a tuple
    ("#### 3/4", "0.75", 1.0),
    ("#### The answer is 42.", "42", 1.0),  # not math after ####: the whole response is parsed as before
    ("#### 41", "#### 42", 0.0),
])
def test_gsm8k_hash_answers(response, answer, reward):
    assert grade_with_status("math_verify", response, answer, 10.0) == (reward, "ok")
