"""The ``math_verify`` grader: symbolic equivalence of a response's answer and the reference.

Reward is binary, as in the reference recipe (REFERENCE.md, GRPO): the reference answer is
wrapped as ``\\boxed{answer}`` (unless it already holds a ``\\boxed{}``) and parsed as LaTeX; the
response is parsed with HuggingFace ``math_verify`` (its last ``\\boxed{}`` first, then LaTeX
and plain expressions), and :func:`math_verify.verify` decides equivalence, so ``\\frac{1}{2}``,
``1/2`` and ``0.5`` all match, as do ``\\{1,2\\}`` and ``\\{2,1\\}``. GSM8K's marker is understood on
both sides: a reference holding ``####`` is the text after the last one (``... #### 72`` is ``72``), and a
response with no ``\\boxed{}`` but a ``#### N`` is graded on ``N`` (:mod:`fp8rl.data.grading`).

Threads and time: ``math_verify`` bounds its own time with ``signal.alarm``, which only works in
the main thread, so this grader always passes ``parsing_timeout=None`` / ``timeout_seconds=None``
and leaves the wall-clock bound to its caller — :mod:`fp8rl.data.scoring` runs it on a pool with
a per-item timeout. Called directly (``get_grader("math_verify")(r, a)``) it has no time bound.

``math_verify`` (and sympy behind it) is imported on first use, not when :mod:`fp8rl.data` is
imported, so loading the package stays fast; when it is not installed every item scores 0 with
status ``"error"`` naming the missing package.
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
from typing import Any

from .grading import extract_boxed, extract_hash_answer, reference_answer, register_grader
from .scoring import GradeResult

__all__ = ["MathVerifyGrader", "math_verify_grader"]

_IMPORT_LOCK = threading.Lock()
_MV: Any = None


class _DropTimeoutDisabledWarning(logging.Filter):
    """math_verify warns once that its timeouts are off; they are off on purpose (module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


def _math_verify() -> Any:
    """The ``math_verify`` module, imported once (thread-safe)."""
    global _MV
    with _IMPORT_LOCK:
        if _MV is None:
            module = importlib.import_module("math_verify")
            for name in ("math_verify.parser", "math_verify.grader"):
                logging.getLogger(name).addFilter(_DropTimeoutDisabledWarning())
            _MV = module
        return _MV


@functools.lru_cache(maxsize=4096)
def _parse_reference(answer: str) -> tuple:
    """Parsed reference answer, cached: every sample of one prompt (G of them) shares it."""
    mv = _math_verify()
    text = reference_answer(answer).strip()
    if "\\boxed" not in text:
        text = "\\boxed{" + text + "}"
    return tuple(mv.parse(text, extraction_config=[mv.LatexExtractionConfig()], parsing_timeout=None))


def _parse_hash_answer(mv: Any, response: str) -> list:
    """The parsed ``#### N`` answer of a response without a ``\\boxed{}`` (GSM8K's format), else ``[]``."""
    if extract_boxed(response) is not None:
        return []
    hashed = extract_hash_answer(response)
    if hashed is None:
        return []
    return mv.parse("\\boxed{" + hashed + "}", extraction_config=[mv.LatexExtractionConfig()], parsing_timeout=None)


def _is_math(parsed: Any) -> bool:
    """True for a sympy object; False for the raw-string fallback math_verify adds when parsing fails."""
    return not isinstance(parsed, str)


class MathVerifyGrader:
    """Binary math-equivalence grader; callable as a plain grader, ``grade`` also gives the status.

    Statuses (see :class:`fp8rl.data.scoring.GradeResult`): ``"ok"`` with 1.0 (equivalent) or
    0.0 (a readable answer that is wrong); ``"unparsable"`` when the response holds no answer
    that parses as math; ``"error"`` when the reference itself cannot be parsed, the inputs are
    not strings where the reference is concerned, or ``math_verify`` fails. Never raises.
    """

    name = "math_verify"

    def __call__(self, response: str, answer: str) -> float:
        """Reward in {0.0, 1.0}; never raises."""
        return self.grade(response, answer).reward

    def grade(self, response: str, answer: str) -> GradeResult:
        """Grades ``response`` against the reference ``answer``; never raises."""
        try:
            if not isinstance(answer, str) or not answer.strip():
                return GradeResult(0.0, "error", f"reference answer must be a non-empty string, got {answer!r}")
            if not isinstance(response, str) or not response.strip():
                return GradeResult(0.0, "unparsable", "empty or non-string response")
            try:
                mv = _math_verify()
            except ImportError as e:
                return GradeResult(0.0, "error", f"math_verify grader needs the math-verify package: {e}")
            gold = _parse_reference(answer)
            if not gold:
                return GradeResult(0.0, "error", f"reference answer {answer!r} could not be parsed")
            pred = _parse_hash_answer(mv, response)
            if not any(_is_math(p) for p in pred):
                pred = mv.parse(
                    response,
                    extraction_config=[mv.LatexExtractionConfig(), mv.ExprExtractionConfig()],
                    parsing_timeout=None,
                )
            if not pred:
                return GradeResult(0.0, "unparsable", "no answer found in the response")
            if mv.verify(list(gold), pred, timeout_seconds=None):
                return GradeResult(1.0, "ok")
            if not any(_is_math(p) for p in pred):
                return GradeResult(0.0, "unparsable", f"answer {pred[-1]!r} does not parse as math")
            return GradeResult(0.0, "ok")
        except Exception as e:  # the grader contract: garbage in scores 0, it never crashes a step
            return GradeResult(0.0, "error", f"math_verify failed: {type(e).__name__}: {e}")

    def __repr__(self) -> str:
        return "MathVerifyGrader()"


math_verify_grader = MathVerifyGrader()
register_grader(MathVerifyGrader.name, math_verify_grader)
