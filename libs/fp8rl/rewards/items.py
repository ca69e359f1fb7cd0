"""What a reward model reads and returns, item by item (typed records shared by the model, the reward service's
``ScoreModel`` and the callers that mix its scores with the rule grader's)."""

from __future__ import annotations

from dataclasses import dataclass

from fp8rl.data import Problem

__all__ = ["ModelItem", "ModelScore", "item_of"]


@dataclass(frozen=True)
class ModelItem:
    """What the reward model reads of one sample: the task's question, the policy's response, the reference answer
    ("" when there is none), and for a pairwise judge another response of its group to compare it with."""

    question: str
    response: str
    answer: str = ""
    other: str = ""


@dataclass(frozen=True)
class ModelScore:
    """The model's score of one item in [0, 1], or None (unscored) with ``error`` saying why; ``tokens``: what the
    judge wrote for it, ``unparsable``: its judge samples whose text did not parse; ``reference``: with
    ``reward.model.agreement``, the same model's score in bf16 (None: unscored there, or not measured — see
    ``compared``)."""

    score: float | None
    error: str = ""
    tokens: int = 0
    unparsable: int = 0
    compared: bool = False
    reference: float | None = None


def item_of(problem: Problem, response: str) -> ModelItem:
    """The item of ``response`` to ``problem``: its question is the prompt's text (a chat's last user turn)."""
    if problem.is_chat:
        users = [content for role, content in problem.prompt if role == "user"]
        question = users[-1] if users else problem.prompt[-1][1]
    else:
        question = problem.prompt
    return ModelItem(question, response, problem.answer)
