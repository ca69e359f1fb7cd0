"""Tests for fp8rl.data.arith: format contract, arithmetic correctness, determinism, validation."""

from __future__ import annotations

import random
import re

import pytest

from fp8rl.data import ArithConfig, ArithDataset, Problem, format_sft_example, generate_problems
from fp8rl.data.arith import make_prompt

_PROMPT_RE = re.compile(r"Q: (?P<question>[^\n]+)\nA: ")


def _solve_words(question: str) -> int:
    """Independent reading of a word problem: apply each clause left to right."""
    m = re.fullmatch(r"\w+ has (\d+) \w+(.*)\. How many \w+\?", question)
    assert m, question
    value = int(m.group(1))
    for clause in re.split(r", | and ", m.group(2).lstrip(", ").removeprefix("and ")):
        if not clause:
            continue
        n = int(re.search(r"\d+", clause).group(0))
        if "more" in clause:
            value += n
        elif "times as many" in clause:
            value *= n
        elif clause.startswith(("gives away", "loses")):
            value -= n
        else:
            raise AssertionError(f"unknown clause {clause!r} in {question!r}")
    return value


def _question(problem: Problem) -> str:
    m = _PROMPT_RE.fullmatch(problem.prompt)
    assert m, f"prompt breaks the format contract: {problem.prompt!r}"
    return m.group("question")


def test_prompt_format_and_first_samples_are_pinned():
    problems = generate_problems(5, seed=0)
    assert problems[0] == Problem("Q: Eve has 13 cards and loses 1. How many cards?\nA: ", "12")
    for p in problems:
        question = _question(p)
        assert p.prompt == f"Q: {question}\nA: " == make_prompt(question)
        assert p.answer == str(int(p.answer))
        assert len(p.prompt) <= 64


@pytest.mark.parametrize("num_terms", [2, 3, 4])
@pytest.mark.parametrize("ops", [("+", "-"), ("-",), ("+", "-", "*")])
def test_word_answers_match_independent_reading(num_terms, ops):
    config = ArithConfig(num_terms=num_terms, ops=ops, max_operand=12)
    for p in generate_problems(200, seed=num_terms, config=config):
        assert _solve_words(_question(p)) == int(p.answer), p


@pytest.mark.parametrize("ops", [("+", "-"), ("+", "-", "*"), ("*",)])
def test_bare_answers_equal_python_evaluation(ops):
    config = ArithConfig(num_terms=4, ops=ops, word_problems=False, allow_negative=True)
    problems = generate_problems(300, seed=7, config=config)
    for p in problems:
        question = _question(p)
        assert question.endswith("=") and re.fullmatch(r"[\d+\-*()]+=", question), question
        # The parenthesised bare form must mean what left-to-right clauses mean.
        assert eval(question[:-1]) == int(p.answer), p  # noqa: S307 - digits and operators only
    if "-" in ops:
        assert any(int(p.answer) < 0 for p in problems), "allow_negative=True never went negative"


def test_non_negative_intermediates_by_default():
    config = ArithConfig(num_terms=4, ops=("-",), max_operand=30, word_problems=False)
    for p in generate_problems(300, seed=3, config=config):
        terms = [int(t) for t in re.findall(r"\d+", _question(p))]
        value = terms[0]
        for t in terms[1:]:
            value -= t
            assert value >= 0, p
        assert int(p.answer) == value


def test_operands_respect_bounds():
    config = ArithConfig(max_operand=9, min_operand=3, num_terms=3, word_problems=False)
    seen = set()
    for p in generate_problems(300, seed=1, config=config):
        terms = [int(t) for t in re.findall(r"\d+", _question(p))]
        assert all(3 <= t <= 9 for t in terms), p
        seen.update(terms)
    assert seen == set(range(3, 10))


def test_determinism_and_seed_sensitivity():
    state = random.getstate()
    a = generate_problems(50, seed=11)
    random.seed(999)  # global state must not matter
    assert generate_problems(50, seed=11) == a
    assert generate_problems(20, seed=11) == a[:20]
    assert generate_problems(50, seed=12) != a
    random.setstate(state)


def test_sft_example_is_prompt_plus_answer():
    p = Problem("Q: 2+3=\nA: ", "5")
    assert format_sft_example(p) == "Q: 2+3=\nA: 5"


def test_dataset_batches_are_deterministic_per_step():
    ds = ArithDataset(ArithConfig(), seed=5)
    b3 = ds.batch(3, 16)
    assert len(b3) == 16
    assert ArithDataset(ArithConfig(), seed=5).batch(3, 16) == b3
    assert ds.batch(4, 16) != b3
    assert ArithDataset(ArithConfig(), seed=6).batch(3, 16) != b3
    assert ds.eval_set(32) == ds.eval_set(32)
    assert ds.eval_set(32) != ds.batch(0, 32)
    assert ds.batch(0, 0) == []


def test_holdout_split_is_disjoint_by_expression():
    config = ArithConfig(word_problems=False)
    ds = ArithDataset(config, seed=0, holdout_fraction=0.2)
    train = {_question(p) for step in range(20) for p in ds.batch(step, 32)}
    evals = {_question(p) for p in ds.eval_set(200)}
    assert train and evals
    assert not train & evals
    assert all(ds.is_heldout(q[:-1]) for q in evals)
    assert not any(ds.is_heldout(q[:-1]) for q in train)


def test_holdout_too_large_for_tiny_space_fails_clearly():
    config = ArithConfig(max_operand=1, min_operand=1, ops=("+",))  # only "1+1" exists
    ds = ArithDataset(config, seed=0, holdout_fraction=0.5)
    split = "train" if ds.is_heldout("1+1") else "eval"
    with pytest.raises(RuntimeError, match=f"no {split} problem"):
        ds.eval_set(1) if split == "eval" else ds.batch(0, 1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_operand": -1}, "max_operand"),
        ({"max_operand": 10**7}, "max_operand"),
        ({"max_operand": 5, "min_operand": 6}, "min_operand"),
        ({"num_terms": 1}, "num_terms"),
        ({"num_terms": 5}, "num_terms"),
        ({"num_terms": 2.0}, "num_terms"),
        ({"ops": ()}, "ops"),
        ({"ops": ("/",)}, "ops"),
        ({"ops": "+-"}, "ops"),
        ({"ops": ("+", "+")}, "ops"),
        ({"allow_negative": 1}, "allow_negative"),
        ({"word_problems": "no"}, "word_problems"),
        ({"ops": ("-",), "num_terms": 4, "min_operand": 5, "max_operand": 10}, "min_operand"),
    ],
)
def test_config_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ArithConfig(**kwargs)


def test_config_accepts_list_ops_as_tuple():
    assert ArithConfig(ops=["+", "*"]).ops == ("+", "*")


@pytest.mark.parametrize("bad", [-1, 2.5, True, "3"])
def test_counts_and_seeds_are_validated(bad):
    with pytest.raises(ValueError):
        generate_problems(bad, seed=0)
    with pytest.raises(ValueError):
        ArithDataset(seed=0).batch(bad, 4)
    with pytest.raises(ValueError):
        ArithDataset(seed=0).eval_set(bad)
    if not isinstance(bad, int) or isinstance(bad, bool):
        with pytest.raises(ValueError):
            generate_problems(1, seed=bad)


@pytest.mark.parametrize("fraction", [-0.1, 0.6, "0.1", True])
def test_dataset_rejects_bad_holdout(fraction):
    with pytest.raises(ValueError, match="holdout_fraction"):
        ArithDataset(seed=0, holdout_fraction=fraction)
