"""Synthetic arithmetic word problems sized for the tiny character-level preset.

The task is what the embedded default (``make run``) trains on: a 4-layer, 256-wide character
model learns it from a few minutes of supervised training on two CPU cores and then improves under
GRPO. So prompts are short (about 60 characters at the defaults), the template set is small, and
everything is a pure function of a seed — no global random state anywhere.

Prompt format (a contract shared with the SFT and eval code)::

    Q: {question}\\nA: {answer}

``Problem.prompt`` is ``"Q: {question}\\nA: "`` and ``Problem.answer`` is ``str(int)``, e.g.::

    Q: Ann has 12 pens and gets 7 more. How many pens?
    A: 19

Operations are applied left to right, one clause at a time (``"has 3, gets 2 more, then has 4
times as many"`` is ``(3 + 2) * 4``); the bare form parenthesises to match (``"(3+2)*4="``).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from .problem import Problem

__all__ = [
    "PROMPT_TEMPLATE",
    "SUPPORTED_OPS",
    "ArithConfig",
    "ArithDataset",
    "format_sft_example",
    "generate_problems",
    "make_prompt",
]

PROMPT_TEMPLATE = "Q: {question}\nA: "
SUPPORTED_OPS = ("+", "-", "*")
_MAX_OPERAND_LIMIT = 10**6
# Re-draws allowed for one problem before giving up; only reachable with degenerate configs
# (or a held-out split that swallows the whole problem space).
_MAX_ATTEMPTS = 1000

# Word templates. Kept deliberately few: the model is small and learns them in minutes.
_NAMES = ("Ann", "Bob", "Eve", "Tom")
_ITEMS = (("pen", "pens"), ("cup", "cups"), ("egg", "eggs"), ("card", "cards"))
_PHRASES = {
    "+": ("gets {n} more", "finds {n} more"),
    "-": ("gives away {n}", "loses {n}"),
    "*": ("then has {n} times as many",),
}


@dataclass(frozen=True)
class ArithConfig:
    """Difficulty knobs of the arithmetic task; validated on construction.

    Attributes:
        max_operand: largest operand drawn, in ``[0, 1_000_000]``.
        min_operand: smallest operand drawn, in ``[0, max_operand]``. Defaults to 1 so word
            problems never say "gets 0 more".
        num_terms: operands per problem, in ``[2, 4]`` (2 means one operation).
        ops: operations to draw from, a non-empty subset of ``("+", "-", "*")`` without repeats
            (a list is accepted and stored as a tuple).
        allow_negative: when False every intermediate and the final result is ``>= 0`` (a
            subtraction never takes away more than is there).
        word_problems: True renders templated sentences; False renders bare ``"12+7="``.
    """

    max_operand: int = 20
    min_operand: int = 1
    num_terms: int = 2
    ops: tuple[str, ...] = ("+", "-")
    allow_negative: bool = False
    word_problems: bool = True

    def __post_init__(self) -> None:
        _check_int("max_operand", self.max_operand, 0, _MAX_OPERAND_LIMIT)
        _check_int("min_operand", self.min_operand, 0, self.max_operand)
        _check_int("num_terms", self.num_terms, 2, 4)
        for name in ("allow_negative", "word_problems"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ArithConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.ops, str) or not isinstance(self.ops, (tuple, list)):
            raise ValueError(f"ArithConfig.ops must be a tuple of operators, got {self.ops!r}")
        ops = tuple(self.ops)
        object.__setattr__(self, "ops", ops)  # frozen: normalise a YAML list to a tuple
        if not ops:
            raise ValueError(f"ArithConfig.ops must be non-empty; choose from {SUPPORTED_OPS}")
        bad = [op for op in ops if op not in SUPPORTED_OPS]
        if bad:
            raise ValueError(f"ArithConfig.ops has unsupported {bad!r}; choose from {SUPPORTED_OPS}")
        if len(set(ops)) != len(ops):
            raise ValueError(f"ArithConfig.ops has repeats: {ops!r}")
        # Subtraction only, never negative: the start must be able to cover every subtrahend.
        if ops == ("-",) and not self.allow_negative:
            need = self.min_operand * (self.num_terms - 1)
            if need > self.max_operand:
                raise ValueError(
                    f"ArithConfig: ops=('-',) with allow_negative=False needs "
                    f"min_operand * (num_terms - 1) = {need} <= max_operand = {self.max_operand}"
                )


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"ArithConfig.{name} must be an int in [{lo}, {hi}], got {value!r}")


def make_prompt(question: str) -> str:
    """Wraps a question in the task's prompt format, ``"Q: {question}\\nA: "``."""
    return PROMPT_TEMPLATE.format(question=question)


def format_sft_example(problem: Problem) -> str:
    """The supervised target text: prompt followed by the answer.

    The tokenizer side appends EOS, so the model learns to stop right after the answer.
    """
    return problem.prompt + problem.answer


@dataclass(frozen=True)
class _Draw:
    """One drawn problem before rendering: operands, operators and the result."""

    terms: tuple[int, ...]
    ops: tuple[str, ...]
    result: int

    def expression(self) -> str:
        """Bare left-to-right expression, parenthesised where precedence would disagree."""
        text = str(self.terms[0])
        additive = False  # an unparenthesised + or - that a following * would bind wrongly
        for op, term in zip(self.ops, self.terms[1:], strict=True):
            if op == "*" and additive:
                text = f"({text})"
                additive = False
            text = f"{text}{op}{term}"
            additive = additive or op != "*"
        return text


def _draw(rng: random.Random, config: ArithConfig) -> _Draw:
    """Draws operands and operators; with ``allow_negative=False`` every prefix stays >= 0."""
    lo, hi = config.min_operand, config.max_operand
    non_minus = tuple(op for op in config.ops if op != "-")
    for _ in range(_MAX_ATTEMPTS):
        value = rng.randint(lo, hi)
        terms, ops = [value], []
        for _ in range(config.num_terms - 1):
            op = rng.choice(config.ops)
            if op == "-" and not config.allow_negative and value < lo:
                if not non_minus:
                    break  # nothing left to subtract and no other op: start over
                op = rng.choice(non_minus)
            if op == "-" and not config.allow_negative:
                term = rng.randint(lo, min(hi, value))
            else:
                term = rng.randint(lo, hi)
            value = value + term if op == "+" else value - term if op == "-" else value * term
            terms.append(term)
            ops.append(op)
        else:
            return _Draw(tuple(terms), tuple(ops), value)
    raise RuntimeError(f"could not draw an arithmetic problem in {_MAX_ATTEMPTS} tries for {config}")


def _render(draw: _Draw, rng: random.Random, config: ArithConfig) -> Problem:
    if not config.word_problems:
        return Problem(make_prompt(draw.expression() + "="), str(draw.result))
    name = rng.choice(_NAMES)
    singular, plural = rng.choice(_ITEMS)
    first = f"{name} has {draw.terms[0]} {singular if draw.terms[0] == 1 else plural}"
    clauses = [
        rng.choice(_PHRASES[op]).format(n=term) for op, term in zip(draw.ops, draw.terms[1:], strict=True)
    ]
    if len(clauses) == 1:
        body = f"{first} and {clauses[0]}"
    else:
        body = f"{first}, {', '.join(clauses[:-1])} and {clauses[-1]}"
    return Problem(make_prompt(f"{body}. How many {plural}?"), str(draw.result))


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def generate_problems(n: int, *, seed: int, config: ArithConfig | None = None) -> list[Problem]:
    """Draws ``n`` problems; the same ``(n, seed, config)`` always gives the same list.

    Args:
        n: number of problems, ``>= 0``.
        seed: seed of a private ``random.Random`` (global random state is never touched); a
            prefix property holds: ``generate_problems(k, seed=s)`` is the first ``k`` of
            ``generate_problems(n, seed=s)`` for ``k <= n``.
        config: difficulty knobs; ``ArithConfig()`` when None.

    Raises:
        ValueError: ``n`` negative or not an int, or ``seed`` not an int.
    """
    _check_count("n", n)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    config = config or ArithConfig()
    rng = random.Random(seed)
    return [_render(_draw(rng, config), rng, config) for _ in range(n)]


class ArithDataset:
    """An endless, seekable stream of training batches plus a separate eval set.

    Every batch is a pure function of ``(seed, step, size)``, so a resumed job (DESIGN §3: the
    controller resumes from Redis state + the last checkpoint) sees exactly the batches it would
    have seen. The eval set comes from a seed stream that training never uses.

    With ``holdout_fraction > 0`` the split is also by *content*: each arithmetic expression (say
    ``"12+7"``, whatever words dress it) belongs to the eval split when a hash of it falls below
    the fraction, and training never draws it — eval then measures arithmetic the model has not
    seen, not just new phrasings. At 0 (the default) the space is small enough that eval prompts
    can coincide with training ones.
    """

    def __init__(self, config: ArithConfig | None = None, seed: int = 0, *, holdout_fraction: float = 0.0):
        """Builds the dataset.

        Args:
            config: difficulty knobs; ``ArithConfig()`` when None.
            seed: job seed, an int.
            holdout_fraction: share of expressions reserved for eval, in ``[0, 0.5]``.

        Raises:
            ValueError: a bad ``seed`` or ``holdout_fraction``.
        """
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"ArithDataset seed must be an int, got {seed!r}")
        if isinstance(holdout_fraction, bool) or not isinstance(holdout_fraction, (int, float)):
            raise ValueError(f"holdout_fraction must be a float in [0, 0.5], got {holdout_fraction!r}")
        if not 0.0 <= holdout_fraction <= 0.5:
            raise ValueError(f"holdout_fraction must be in [0, 0.5], got {holdout_fraction!r}")
        self.config = config or ArithConfig()
        self.seed = seed
        self.holdout_fraction = float(holdout_fraction)

    def batch(self, step: int, size: int) -> list[Problem]:
        """The training batch of ``step``: ``size`` problems, identical on every call.

        Raises:
            ValueError: ``step`` or ``size`` negative or not an int.
            RuntimeError: the held-out split leaves no expression to train on.
        """
        _check_count("step", step)
        _check_count("size", size)
        rng = random.Random(f"fp8rl.arith:train:{self.seed}:{step}")
        return [self._draw_in_split(rng, eval_split=False) for _ in range(size)]

    def eval_set(self, n: int) -> list[Problem]:
        """``n`` eval problems from the eval seed stream; the same list on every call.

        Raises:
            ValueError: ``n`` negative or not an int.
            RuntimeError: the held-out split is empty for this config.
        """
        _check_count("n", n)
        rng = random.Random(f"fp8rl.arith:eval:{self.seed}")
        return [self._draw_in_split(rng, eval_split=True) for _ in range(n)]

    def is_heldout(self, expression: str) -> bool:
        """Whether a bare expression (e.g. ``"12+7"``) belongs to the eval-only split."""
        if self.holdout_fraction == 0.0:
            return False
        digest = hashlib.sha256(f"{self.seed}:{expression}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2.0**64 < self.holdout_fraction

    def _draw_in_split(self, rng: random.Random, *, eval_split: bool) -> Problem:
        for _ in range(_MAX_ATTEMPTS):
            draw = _draw(rng, self.config)
            if self.holdout_fraction == 0.0 or self.is_heldout(draw.expression()) == eval_split:
                return _render(draw, rng, self.config)
        split = "eval" if eval_split else "train"
        raise RuntimeError(
            f"no {split} problem found in {_MAX_ATTEMPTS} draws: holdout_fraction="
            f"{self.holdout_fraction} splits a problem space too small for {self.config}"
        )
