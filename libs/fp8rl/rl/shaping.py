"""DAPO's overlong handling: a soft length penalty on the reward, and which responses were cut off.

With a generation budget ``L_max`` (``policy.generation.max_new_tokens``) and a buffer ``L_buf``, a response
of ``n`` tokens gets (DAPO, eq. 13)::

    penalty(n) = 0                                   n <= L_max - L_buf
               = -(n - (L_max - L_buf)) / L_buf * p  L_max - L_buf < n <= L_max

added to its graded reward, so it reaches ``-p`` at the budget and responses that end well before it are
untouched. A response is *truncated* when it has ``L_max`` tokens and did not end on a stop token
(``finish_reason == "length"``); overlong filtering leaves those out of the loss.
"""

from __future__ import annotations

__all__ = ["overlong_penalty", "truncated"]


def overlong_penalty(length: int, max_new_tokens: int, buffer_length: int, penalty: float) -> float:
    """The (non-positive) reward added to a response of ``length`` generated tokens.

    Raises:
        ValueError: ``buffer_length`` not in ``[1, max_new_tokens)``, ``penalty < 0`` or ``length < 0``.
    """
    if not 0 < buffer_length < max_new_tokens:
        raise ValueError(f"overlong buffer_length must be in [1, max_new_tokens={max_new_tokens}), got {buffer_length}")
    if penalty < 0 or length < 0:
        raise ValueError(f"overlong penalty needs penalty >= 0 and length >= 0, got {penalty}, {length}")
    excess = min(length, max_new_tokens) - (max_new_tokens - buffer_length)
    return -penalty * excess / buffer_length if excess > 0 else 0.0


def truncated(finish_reason: str) -> bool:
    """Whether a sample was cut off by the token budget rather than ending on a stop token."""
    return finish_reason == "length"
