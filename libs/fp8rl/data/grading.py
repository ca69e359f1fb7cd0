"""Rule-based graders: a response and a reference answer in, a reward in ``[0, 1]`` out.

Contract of every grader (DESIGN §2, reward phase): ``grader(response, answer) -> float`` in
``[0, 1]`` and it never raises — a garbled, truncated or non-string response scores 0.0, so one
bad sample can never crash a step. Graders are looked up by name with :func:`get_grader`.

GSM8K's ``#### 42`` is understood on both sides: a reference answer holding ``####`` (GSM8K's published
answers are worked solutions ending in ``#### 72``) is the text after the last one
(:func:`reference_answer`), and a response's ``#### N`` is its answer when it has no ``\\boxed{}``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

__all__ = [
    "CORRECT_REWARD",
    "GRADERS",
    "Grader",
    "exact_match_grader",
    "extract_boxed",
    "extract_final_number",
    "extract_hash_answer",
    "get_grader",
    "normalize_answer",
    "reference_answer",
    "register_grader",
    "response_answer",
]

Grader = Callable[[str, str], float]

# A response counts as correct when its reward exceeds this (graders return 0/1; partial credit is < 1).
CORRECT_REWARD = 0.5

# A number: optional minus (not when it reads as a binary minus right after a digit, "10-3"),
# then either comma-grouped thousands ("1,234,567") or plain digits, then an optional fraction.
# A trailing period ("is 12.") is not a fraction because a digit must follow the dot.
_NUMBER = r"(?:(?<![\d)\]])-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_WHOLE_NUMBER_RE = re.compile(rf"\s*(?:{_NUMBER})\s*")
_BOXED_RE = re.compile(r"\\boxed\s*\{")
_HASH_MARK = "####"  # GSM8K's final-answer marker
# A number leading the text after ####, ended by the line, a space or punctuation ("42 apples", "$1,234.") —
# but not one that starts an expression ("3/4", "2^10").
_HASH_NUMBER_RE = re.compile(rf"\$?\s*({_NUMBER})\s*\$?(?=$|\s|[.,;:!?)](?:\s|$))")


def extract_final_number(text: str) -> str | None:
    """The last integer or decimal in ``text``, commas removed; None when there is none.

    ``"so 1,234.5 in total."`` gives ``"1234.5"``; ``"10-3=7"`` gives ``"7"``; ``"-4"`` keeps its
    sign. Non-string input gives None.
    """
    if not isinstance(text, str):
        return None
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text``, nested braces balanced.

    ``"\\boxed{\\frac{1}{2}}"`` gives ``"\\frac{1}{2}"``. Backslash-escaped braces (``\\{``) do
    not count toward the balance. Returns None when there is no ``\\boxed{`` or when the last one
    is never closed (a truncated response), and for non-string input.
    """
    if not isinstance(text, str):
        return None
    starts = [m.end() for m in _BOXED_RE.finditer(text)]
    if not starts:
        return None
    start = starts[-1]
    depth, i = 1, start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # skip the escaped character, whatever it is
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def extract_hash_answer(text: str) -> str | None:
    """The answer after the last ``####`` in ``text`` (GSM8K's marker): the number that leads the rest of that
    line, grouping commas removed (``"#### 1,234."`` and ``"#### $1,234 in total"`` give ``"1234"``), else
    that rest of the line, stripped (``"#### \\frac{3}{4}"``).

    None when there is no ``####``, nothing follows the last one on its line, or ``text`` is not a string.
    """
    if not isinstance(text, str):
        return None
    at = text.rfind(_HASH_MARK)
    if at < 0:
        return None
    line = text[at + len(_HASH_MARK):].split("\n", 1)[0].strip()
    number = _HASH_NUMBER_RE.match(line)
    if number:
        return number.group(1).replace(",", "")
    return line or None


def reference_answer(answer: str) -> str:
    """The part of a reference answer graders compare against: the text after its last ``####``
    (:func:`extract_hash_answer`) when it holds one — GSM8K's worked solutions — else ``answer`` itself."""
    if isinstance(answer, str) and _HASH_MARK in answer:
        return extract_hash_answer(answer) or answer
    return answer


def response_answer(response: str) -> str | None:
    """The answer a response gives, for :func:`exact_match_grader`: its last ``\\boxed{}``'s content; else the
    text after its last ``####`` (the last number in it when that text is not itself a number); else its last
    number. None when it has none of them."""
    boxed = extract_boxed(response)
    if boxed is not None:
        return boxed
    hashed = extract_hash_answer(response)
    if hashed is not None:
        if isinstance(normalize_answer(hashed), Decimal):
            return hashed
        return extract_final_number(hashed) or hashed
    return extract_final_number(response)


def normalize_answer(text: str) -> Decimal | str | None:
    """Canonical form of an answer for comparison.

    Numbers become :class:`~decimal.Decimal`, so ``"12"``, ``"12.0"``, ``"12."`` and ``"$12$"``
    compare equal and ``"1,234"`` equals ``"1234"`` (surrounding whitespace and ``$`` and one
    trailing period are dropped, grouping commas removed). Anything else becomes the string with
    all whitespace removed.
    Returns None for non-strings and for text that is empty after stripping.
    """
    if not isinstance(text, str):
        return None
    s = text.strip().strip("$").strip()
    if s.endswith(".") and not s.endswith(".."):
        s = s[:-1].rstrip()
    if not s:
        return None
    if _WHOLE_NUMBER_RE.fullmatch(s):
        try:
            return Decimal(s.replace(",", ""))
        except InvalidOperation:  # unreachable for regex-checked text; be safe anyway
            return None
    return "".join(s.split())


def exact_match_grader(response: str, answer: str) -> float:
    """1.0 when the response's answer equals the reference after normalisation, else 0.0.

    The response's answer is the content of its last ``\\boxed{}`` when it has one, otherwise what follows
    its last ``####``, otherwise its last number (:func:`response_answer`); the reference is
    :func:`reference_answer` of ``answer`` (GSM8K's ``... #### 72`` is ``72``). Both sides go through
    :func:`normalize_answer`; numbers compare by value, other text by its whitespace-free form. Never raises.
    """
    try:
        if not isinstance(response, str) or not isinstance(answer, str):
            return 0.0
        reference = normalize_answer(reference_answer(answer))
        if reference is None:
            return 0.0
        candidate = response_answer(response)
        if candidate is None:
            return 0.0
        return 1.0 if normalize_answer(candidate) == reference else 0.0
    except Exception:  # the grader contract: garbage in scores 0, it never crashes a step
        return 0.0


# Name -> grader. The math-verify grader (symbolic equivalence of LaTeX answers) registers
# itself here as "math_verify" from its own module via register_grader; keep this module free of
# that optional dependency.
GRADERS: dict[str, Grader] = {
    "exact_match": exact_match_grader,
}


def register_grader(name: str, grader: Grader) -> None:
    """Adds a grader under ``name``.

    Raises:
        ValueError: ``name`` is empty or already taken by a different grader, or ``grader`` is
            not callable.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"grader name must be a non-empty string, got {name!r}")
    if not callable(grader):
        raise ValueError(f"grader {name!r} must be callable, got {type(grader).__name__}")
    existing = GRADERS.get(name)
    if existing is not None and existing is not grader:
        raise ValueError(f"grader {name!r} is already registered ({existing!r})")
    GRADERS[name] = grader


def get_grader(name: str) -> Grader:
    """The grader registered as ``name``.

    Raises:
        ValueError: unknown name; the message lists the known ones.
    """
    grader = GRADERS.get(name) if isinstance(name, str) else None
    if grader is None:
        raise ValueError(f"unknown grader {name!r}; known graders: {', '.join(sorted(GRADERS))}")
    return grader
