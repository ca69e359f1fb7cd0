"""A safe arithmetic evaluator for the calculator tool: a recursive-descent parser, never ``eval``.

Grammar (integers only; whitespace ignored)::

    expr  := term  (("+" | "-") term)*
    term  := unary (("*" | "/") unary)*
    unary := ("-" | "+") unary | atom
    atom  := INTEGER | "(" expr ")"

Bounds, each refused with an :class:`ArithError` that names it: at most :data:`MAX_EXPRESSION_CHARS`
characters, nesting (parentheses and signs) at most :data:`MAX_DEPTH`, every literal and every
intermediate numerator and denominator at most :data:`MAX_MAGNITUDE` in magnitude. There is no power
operator, so no input can ask for a huge exponent. Division is exact (``fractions.Fraction``).
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["MAX_DEPTH", "MAX_EXPRESSION_CHARS", "MAX_MAGNITUDE", "ArithError", "calculate", "evaluate", "format_value"]

MAX_EXPRESSION_CHARS = 64
MAX_DEPTH = 32
MAX_MAGNITUDE = 10**18
_TOKEN_RE = re.compile(r"\s*(?:(\d+)|(\*\*|[-+*/()])|(\S))")


class ArithError(ValueError):
    """The expression is not one the calculator evaluates; the message is shown to the model."""


def _tokens(expression: str) -> list[str]:
    out = []
    for m in _TOKEN_RE.finditer(expression):
        number, op, other = m.groups()
        if other is not None:
            raise ArithError(f"unsupported character {other!r}: only integers, + - * / and parentheses")
        if op == "**":
            raise ArithError("unsupported operator '**': only + - * / and parentheses")
        if number is not None and len(number) > len(str(MAX_MAGNITUDE)):
            raise ArithError(f"number too large: {number[:20]}...")
        if number is not None or op is not None:
            out.append(number if number is not None else op)
    return out


def _bounded(x: Fraction) -> Fraction:
    if abs(x.numerator) > MAX_MAGNITUDE or x.denominator > MAX_MAGNITUDE:
        raise ArithError(f"result too large: magnitudes above {MAX_MAGNITUDE:.0e} are not supported")
    return x


class _Parser:
    def __init__(self, tokens: list[str]):
        self.tokens = tokens
        self.i = 0
        self.depth = 0

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str | None:
        tok = self.peek()
        self.i += 1
        return tok

    def expr(self) -> Fraction:
        x = self.term()
        while self.peek() in ("+", "-"):
            op, y = self.take(), self.term()
            x = _bounded(x + y if op == "+" else x - y)
        return x

    def term(self) -> Fraction:
        x = self.unary()
        while self.peek() in ("*", "/"):
            op, y = self.take(), self.unary()
            if op == "/" and y == 0:
                raise ArithError("division by zero")
            x = _bounded(x * y if op == "*" else x / y)
        return x

    def unary(self) -> Fraction:
        if self.peek() in ("-", "+"):
            op = self.take()
            with _Nested(self):
                x = self.unary()
            return -x if op == "-" else x
        return self.atom()

    def atom(self) -> Fraction:
        tok = self.take()
        if tok is None:
            raise ArithError("incomplete expression")
        if tok == "(":
            with _Nested(self):
                x = self.expr()
            if self.take() != ")":
                raise ArithError("missing ')'")
            return x
        if tok.isdigit():
            return _bounded(Fraction(int(tok)))
        raise ArithError(f"unexpected {tok!r}")


class _Nested:
    """Counts one level of recursion; refuses past MAX_DEPTH (the Python stack is never the limit)."""

    def __init__(self, parser: _Parser):
        self.parser = parser

    def __enter__(self) -> None:
        self.parser.depth += 1
        if self.parser.depth > MAX_DEPTH:
            raise ArithError(f"expression nested deeper than {MAX_DEPTH}")

    def __exit__(self, *exc: object) -> None:
        self.parser.depth -= 1


def evaluate(expression: str) -> Fraction:
    """The exact value of ``expression``.

    Raises:
        ArithError: not a str, empty, too long, a character or operator outside the grammar, a syntax error,
            division by zero, or a magnitude past the bounds (the message says which).
    """
    if not isinstance(expression, str):
        raise ArithError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ArithError(f"expression too long: {len(expression)} characters, at most {MAX_EXPRESSION_CHARS}")
    tokens = _tokens(expression)
    if not tokens:
        raise ArithError("empty expression")
    parser = _Parser(tokens)
    value = parser.expr()
    if parser.peek() is not None:
        raise ArithError(f"unexpected {parser.peek()!r}")
    return value


def format_value(value: Fraction) -> str:
    """An integer as its digits; a non-integer as a decimal with 12 significant digits."""
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.12g}"


def calculate(expression: str) -> str:
    """The tool's answer: the value's text, or ``"error: <why>"`` — never an exception."""
    try:
        return format_value(evaluate(expression))
    except ArithError as e:
        return f"error: {e}"
