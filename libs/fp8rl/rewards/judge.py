"""LLM-as-judge (GenRM) prompts and parse rules: how a judge reads an item and how its text becomes a score.

An item is the question, the policy's response and the reference answer (empty when the data has none), filled into
``reward.model.template`` and rendered as one user turn by the judge's chat template when it has one. The judge's
output becomes a score in [0, 1] by one rule (``reward.model.parse``):

- ``boxed``: the last ``\\boxed{x}`` it writes, ``x / max_score``;
- ``score``: the last ``score: x`` (any case, ``=`` or ``:``), ``x / max_score``;
- ``verdict``: the last of the verdict words it writes (whole words, any case), that word's score;
- ``verdict_prob``: no text at all: the probabilities the judge gives the verdict words' first tokens as its first
  output token, normalised over the verdicts, their scores weighted by them (P(yes) for yes 1 / no 0).

A value that does not parse (no match, not a number, outside ``[0, max_score]``) is None: the sample is left
unscored — never a silent 0, which would train the policy on the judge's failure as a verdict.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import torch

from fp8rl.model.tokenizer import Tokenizer, chat_template_of, render_chat_prompt

from .items import ModelScore

__all__ = ["PARSES", "parse_judge_output", "render_judge_prompt", "scores_of_outputs", "verdict_first_tokens",
           "verdict_prob_scores"]

PARSES = ("boxed", "score", "verdict", "verdict_prob")

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_SCORE = re.compile(r"score\s*[:=]\s*([-+]?\d+(?:\.\d+)?)", re.IGNORECASE)


def render_judge_prompt(tok: Tokenizer, template: str, *, question: str, response: str, answer: str,
                        other: str = "") -> list[int]:
    """The judge's prompt token ids for one item: ``template`` filled in (``other``: the response it is compared with,
    pairwise), then one user turn of the tokenizer's chat template (generation prompt added) when it has one, else
    the text after BOS."""
    text = template.format(question=question, response=response, answer=answer, other=other)
    if chat_template_of(tok) is not None:
        return tok.encode(render_chat_prompt(tok, text), add_bos=False)
    return tok.encode(text)


def _number(text: str, max_score: float) -> float | None:
    try:
        x = float(text.strip())
    except ValueError:
        return None
    return x / max_score if math.isfinite(x) and 0.0 <= x <= max_score else None


def parse_judge_output(text: str, parse: str, *, verdicts: Mapping[str, float], max_score: float = 1.0
                       ) -> float | None:
    """The score in [0, 1] that the judge's ``text`` gives by rule ``parse`` (not ``verdict_prob``, which reads no
    text), or None when it gives none."""
    if parse == "boxed":
        found = _BOXED.findall(text)
        return _number(found[-1], max_score) if found else None
    if parse == "score":
        found = _SCORE.findall(text)
        return _number(found[-1], max_score) if found else None
    if parse == "verdict":
        words = sorted(verdicts, key=len, reverse=True)  # "incorrect" before "correct"
        pattern = re.compile(r"\b(" + "|".join(re.escape(w) for w in words) + r")\b", re.IGNORECASE)
        found = pattern.findall(text)
        if not found:
            return None
        lower = {w.lower(): v for w, v in verdicts.items()}
        return float(lower[found[-1].lower()])
    texts = ", ".join(p for p in PARSES if p != "verdict_prob")
    raise ValueError(f"parse {parse!r} reads no judge text; one of {texts}")


def verdict_first_tokens(tok: Tokenizer, verdicts: Mapping[str, float]) -> dict[int, float]:
    """The first token id of each verdict word and its score (``verdict_prob``).

    Raises:
        ValueError: a word encodes to no token, or two words share their first token (their probabilities could
            not be told apart).
    """
    out: dict[int, float] = {}
    for word, value in verdicts.items():
        ids = tok.encode(word, add_bos=False)
        if not ids:
            raise ValueError(f"reward.model.verdicts: {word!r} encodes to no token")
        if ids[0] in out:
            raise ValueError(f"reward.model.verdicts: {word!r} starts with the same token ({ids[0]}) as another "
                             f"verdict word; verdict_prob needs words whose first tokens differ")
        out[ids[0]] = float(value)
    return out


def verdict_prob_scores(logits: torch.Tensor, tokens: Mapping[int, float]) -> list[float | None]:
    """``verdict_prob``: for ``(B, V)`` next-token logits, each row's verdict scores weighted by the verdict tokens'
    probabilities (renormalised over them); None for a row that puts no probability on any of them (underflow)."""
    ids = torch.tensor(list(tokens), dtype=torch.long)
    values = torch.tensor(list(tokens.values()), dtype=torch.float64)
    p = torch.softmax(logits.double(), dim=-1)[:, ids]  # (B, k)
    mass = p.sum(-1)
    out: Sequence[float] = ((p * values).sum(-1) / mass.clamp_min(1e-300)).tolist()
    return [float(x) if m > 0 else None for x, m in zip(out, mass.tolist(), strict=True)]


def scores_of_outputs(outputs: Sequence[Sequence[tuple[str, int]]], parse: str, *, verdicts: Mapping[str, float],
                      max_score: float) -> list[ModelScore]:
    """Each item's score from its judge samples ``(text, tokens written)``: the mean of the samples that parse,
    unscored (with the last sample's tail as the reason) when none does; ``tokens`` and ``unparsable`` counted."""
    out = []
    for samples in outputs:
        parsed = [parse_judge_output(t, parse, verdicts=verdicts, max_score=max_score) for t, _ in samples]
        good = [x for x in parsed if x is not None]
        tokens, bad = sum(n for _, n in samples), len(parsed) - len(good)
        if good:
            out.append(ModelScore(sum(good) / len(good), "", tokens, bad))
        else:
            tail = samples[-1][0][-120:] if samples else ""
            out.append(ModelScore(None, f"the judge's output did not parse ({parse}): {tail!r}", tokens, bad))
    return out
