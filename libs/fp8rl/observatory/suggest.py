"""The bf16-layer suggestion: the fewest layers kept in bf16 whose *re-measured* mismatch meets a target.

Search: for ``k = 0, 1, ... max_bf16_layers`` (at most the model's layer count) the split ``first + last = k``
that leaves the smallest per-layer score in FP8 is chosen (the score of a layer is its
``alone_token_mult_prob_error - 1``, or its ``alone_rel_err`` when per-layer logprobs were not measured),
then that setting is measured for real: a rollout and a trainer recompute with its recipe (the
``total`` mismatch a training step would see). The first ``k`` within the target wins; when none is, the
lowest measured mismatch is suggested and marked as not meeting it. One measurement per ``k``, so the
budget is ``max_bf16_layers + 1`` rollouts.

Only the splits at the two ends are candidates because that is what the recipe can express
(``num_first_layers_in_bf16`` / ``num_last_layers_in_bf16``): a sensitive middle layer is reported in the
per-layer table, but no setting can keep it alone in bf16.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from .result import Candidate, LayerRow, SourceRow, Suggestion

__all__ = ["layer_scores", "best_split", "suggest", "unseparated"]


def layer_scores(layers: Sequence[LayerRow]) -> list[float]:
    """Per layer, what keeping it in FP8 costs: ``alone_token_mult_prob_error - 1`` when measured for every
    layer, else ``alone_rel_err``."""
    if all(math.isfinite(r.alone_token_mult_prob_error) for r in layers):
        return [r.alone_token_mult_prob_error - 1.0 for r in layers]
    return [r.alone_rel_err for r in layers]


def best_split(scores: Sequence[float], k: int) -> tuple[int, int, float]:
    """``(first, last, score)``: of the splits ``first + last = k``, the one whose layers left in FP8 (indices
    ``first .. L - last - 1``) sum to the smallest score; a tie goes to the split with fewer leading layers."""
    L = len(scores)
    if not 0 <= k <= L:
        raise ValueError(f"k must be in 0..{L} (the model's layers), got {k}")
    best = None
    for first in range(k + 1):
        last = k - first
        score = float(sum(scores[first:L - last]))
        if best is None or score < best[2]:
            best = (first, last, score)
    return best


def suggest(scores: Sequence[float], measure: Callable[[int, int], float | SourceRow], *, target: float,
            max_bf16_layers: int, say: Callable[[str], None] = lambda _m: None,
            on_candidate: Callable[[list[Candidate]], None] = lambda _c: None) -> Suggestion:
    """Search as the module docstring says; ``measure(first, last)`` returns the re-measured mismatch (a float, or
    the :class:`SourceRow` of its rollout: then with its standard error and sample). ``on_candidate(tried)`` after
    each measurement (the observatory writes its partial result there). The suggestion's warnings name what its
    sample could not separate: a candidate within two standard errors of the target, or of the chosen one."""
    budget = min(max_bf16_layers, len(scores))
    tried: list[Candidate] = []
    found = None
    for k in range(budget + 1):
        first, last, score = best_split(scores, k)
        got = measure(first, last)
        c = (Candidate(first, last, score, got.token_mult_prob_error, got.standard_error, got.num_sequences,
                       got.num_tokens) if isinstance(got, SourceRow) else Candidate(first, last, score, float(got)))
        tried.append(c)
        on_candidate(list(tried))  # written before it is said
        say(f"  candidate first={first} last={last}: token_mult_prob_error {_shown(c)} (target {target})")
        if c.token_mult_prob_error <= target:
            found = c
            break
    best = found or min(tried, key=lambda c: (c.token_mult_prob_error, c.first + c.last))
    warnings = unseparated(tried, best, target)
    for w in warnings:
        say(f"  warning: {w}")
    return Suggestion(best.first, best.last, best.token_mult_prob_error, target, found is not None, budget, tried,
                      warnings)


def _shown(c: Candidate) -> str:
    se = "" if math.isnan(c.standard_error) else f" ± {c.standard_error:.6f} (n = {c.num_sequences} sequences)"
    return f"{c.token_mult_prob_error:.6f}{se}"


def unseparated(tried: Sequence[Candidate], best: Candidate, target: float) -> list[str]:
    """What a sample this size cannot separate (two standard errors): candidates against the target, and the others
    against the chosen ``best``. Candidates without a standard error are not judged."""
    out = []
    more = "more prompts or samples per prompt (--prompts, --n) would separate them"
    for c in tried:
        if not math.isnan(c.standard_error) and abs(c.token_mult_prob_error - target) < 2 * c.standard_error:
            out.append(f"first={c.first} last={c.last} measured {_shown(c)}, within two standard errors of the "
                       f"target {target}: this sample cannot tell whether it meets it; {more}")
    for c in tried:
        if c is best or math.isnan(c.standard_error) or math.isnan(best.standard_error):
            continue
        if abs(c.token_mult_prob_error - best.token_mult_prob_error) < 2 * math.hypot(c.standard_error,
                                                                                   best.standard_error):
            out.append(f"first={c.first} last={c.last} ({_shown(c)}) and the chosen first={best.first} "
                       f"last={best.last} ({_shown(best)}) differ by less than two standard errors; {more}")
    return out
