"""The one record every task source produces: a prompt and its reference answer."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Problem"]


@dataclass(frozen=True)
class Problem:
    """One task instance.

    Attributes:
        prompt: the exact text fed to the policy; the response is generated right after it, so a
            prompt carries its own trailing separator (e.g. ``"Q: ...\\nA: "``).
        answer: the reference answer as a string; graders compare a response against it
            (:mod:`fp8rl.data.grading`). Never empty for problems built by this package.
    """

    prompt: str
    answer: str
