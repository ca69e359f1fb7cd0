"""The calculator's evaluator: right answers against Python's own arithmetic, and the refusals."""

from __future__ import annotations

from fractions import Fraction

import pytest

from fp8rl.envs.safe_arith import MAX_EXPRESSION_CHARS, ArithError, calculate, evaluate


@pytest.mark.parametrize("expr, value", [
    ("347*29", 10063),
    ("1 + 2 * 3", 7),
    ("(1 + 2) * 3", 9),
    ("-(4 - 10) * -2", -12),
    ("100 - 20 - 30", 50),
    ("2*3/4", Fraction(3, 2)),
    ("--5", 5),
    ("  12  ", 12),
])
def test_values(expr, value):
    assert evaluate(expr) == value


def test_formatting():
    assert calculate("347*29") == "10063"
    assert calculate("7/2") == "3.5"
    assert calculate("1/3") == "0.333333333333"


@pytest.mark.parametrize("expr, why", [
    ("__import__('os').system('x')", "unsupported character"),
    ("2**99999", "unsupported operator"),
    ("9" * 30, "number too large"),
    ("999999999*999999999*999", "result too large"),
    ("1" + "+1" * MAX_EXPRESSION_CHARS, "too long"),
    ("-" * 40 + "1", "nested deeper"),
    ("1/0", "division by zero"),
    ("(1+2", "missing"),
    ("1 2", "unexpected"),
    ("", "empty"),
    ("3+", "incomplete"),
])
def test_refusals_are_error_results(expr, why):
    with pytest.raises(ArithError, match=why):
        evaluate(expr)
    assert calculate(expr).startswith("error: ")


def test_non_string():
    assert calculate(12).startswith("error: ")  # type: ignore[arg-type]
