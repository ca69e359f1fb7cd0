"""Tests for fp8rl.data.grading: extraction, normalisation, the never-raise contract, the registry."""

from __future__ import annotations

from decimal import Decimal

import pytest

from fp8rl.data import (
    GRADERS,
    exact_match_grader,
    extract_boxed,
    extract_final_number,
    extract_hash_answer,
    get_grader,
    reference_answer,
)
from fp8rl.data.grading import normalize_answer, register_grader


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("19", "19"),
        ("The answer is 12.", "12"),
        ("first 3 then 4", "4"),
        ("total: 1,234,567 pens", "1234567"),
        ("costs 1,234.50 dollars.", "1234.50"),
        ("it is -4", "-4"),
        ("10-3=7", "7"),
        ("10-3", "3"),
        ("values 1,2,3", "3"),
        ("12,3456", "3456"),
        ("3.14159", "3.14159"),
        ("no digits here", None),
        ("", None),
        (None, None),
        (12, None),
    ],
)
def test_extract_final_number(text, expected):
    assert extract_final_number(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed {7}", "7"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed{a\\}b}", "a\\}b"),  # an escaped brace does not close the box
        ("\\boxed{\\{}", "\\{"),
        ("\\boxed{}", ""),
        ("\\boxed{12", None),
        ("\\boxed{1} and \\boxed{\\frac{3}{4}", None),  # the last box is truncated
        ("boxed{3}", None),
        ("nothing", None),
        (None, None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("12", Decimal(12)),
        (" 12.0 ", Decimal(12)),
        ("12.", Decimal(12)),
        ("$1,000$", Decimal(1000)),
        ("-0.50", Decimal("-0.5")),
        ("\\frac{1}{2}", "\\frac{1}{2}"),
        ("x = 3", "x=3"),
        ("   ", None),
        (None, None),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("19", "19", 1.0),
        ("19", "20", 0.0),
        ("Ann has 19 pens.", "19", 1.0),
        ("12.0", "12", 1.0),
        ("12", "12.0", 1.0),
        ("1,234", "1234", 1.0),
        ("The total is 1,234.", "1,234", 1.0),
        ("-3", "-3", 1.0),
        ("-3", "3", 0.0),
        ("I think 12 but finally 13", "12", 0.0),
        # A boxed answer wins over later numbers.
        ("\\boxed{12} (checked with 3 methods)", "12", 1.0),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\frac{1}{2}}", "2", 0.0),
        ("\\boxed{12 pens}", "12", 0.0),
        (" 19\n", " 19 ", 1.0),
        ("", "19", 0.0),
        ("no number", "19", 0.0),
        ("19", "", 0.0),
        ("\\boxed{", "1", 0.0),
    ],
)
def test_exact_match_grader(response, answer, reward):
    assert exact_match_grader(response, answer) == reward


@pytest.mark.parametrize(
    ("response", "answer"),
    [(None, "1"), ("1", None), (b"1", "1"), (1, 1), (["1"], "1"), ("9" * 10_000, "9"), ("\\" * 50, "1")],
)
def test_exact_match_never_raises_on_garbage(response, answer):
    assert exact_match_grader(response, answer) == 0.0


def test_registry_lookup_and_errors():
    assert get_grader("exact_match") is exact_match_grader
    assert GRADERS["exact_match"] is exact_match_grader
    with pytest.raises(ValueError, match="known graders: exact_match"):
        get_grader("math_verify_typo")
    with pytest.raises(ValueError, match="known graders"):
        get_grader(None)


def test_register_grader_adds_and_refuses_clashes():
    def always_half(response: str, answer: str) -> float:
        return 0.5

    try:
        register_grader("test_half", always_half)
        register_grader("test_half", always_half)  # same object again is fine
        assert get_grader("test_half")("x", "y") == 0.5
        with pytest.raises(ValueError, match="already registered"):
            register_grader("test_half", exact_match_grader)
        with pytest.raises(ValueError, match="callable"):
            register_grader("test_bad", 3)
        with pytest.raises(ValueError, match="non-empty"):
            register_grader("", always_half)
    finally:
        GRADERS.pop("test_half", None)
    assert "test_half" not in GRADERS


# -- GSM8K's "#### N" -------------------------------------------------------------------------------------------

GSM8K_ANSWER = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


@pytest.mark.parametrize(("text", "expected"), [
    ("#### 72", "72"),
    ("####72", "72"),
    ("so #### 1,234.", "1234"),
    ("#### $1,234 in total", "1234"),
    ("#### -5\nThat is all, 17 ways.", "-5"),  # the marker's own line only
    ("#### 42 then 7", "42"),  # the leading number
    ("#### 3/4", "3/4"),  # an expression stays whole
    ("#### \\frac{3}{4}", "\\frac{3}{4}"),
    ("#### 1 #### 2", "2"),  # the last marker
    ("the answer is ####", None),
    ("no marker 5", None),
    (None, None),
])
def test_extract_hash_answer(text, expected):
    assert extract_hash_answer(text) == expected


@pytest.mark.parametrize(("response", "answer", "reward"), [
    ("#### 72", GSM8K_ANSWER, 1.0),  # the reference is the text after its last ####
    ("She sold 72 clips.", GSM8K_ANSWER, 1.0),
    ("She sold 71 clips.", GSM8K_ANSWER, 0.0),
    ("48 + 24 = 72\n#### 72", "72", 1.0),
    ("#### 1,234", "1234", 1.0),
    ("#### 72\nchecked 3 times", "72", 1.0),  # #### wins over a later number
    ("#### 71\nor 72", "72", 0.0),
    ("#### The answer is 72.", "#### 72", 1.0),  # text after ####: its last number
    ("\\boxed{5} #### 72", "5", 1.0),  # a boxed answer wins over ####
    ("#### ", "0", 0.0),
])
def test_exact_match_understands_gsm8k_hashes(response, answer, reward):
    assert exact_match_grader(response, answer) == reward


def test_reference_answer_without_hash_is_unchanged():
    assert reference_answer(GSM8K_ANSWER) == "72"
    assert reference_answer(" 1,234 ") == " 1,234 "
    assert reference_answer("####") == "####"  # nothing after it: kept, and grades nothing
