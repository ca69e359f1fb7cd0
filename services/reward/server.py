"""RewardServicer: proto ↔ :mod:`fp8rl.data.scoring`, nothing else.

Every item is graded by the grader it names (``""`` = the service's default) with a per-item
wall-clock bound; a wrong, unparsable, hung or crashing answer scores 0 and never fails the
call. The only failure is a caller's mistake: an unknown grader name is INVALID_ARGUMENT,
naming the item and the known graders, and nothing in that batch is graded. So is a batch over the
size limits (more than ``max_items`` items, or a response or answer longer than ``max_response_chars``;
defaults in :mod:`fp8rl.limits`), refused before anything is graded.
"""

from __future__ import annotations

import grpc

from fp8rl import limits
from fp8rl.data import GRADERS
from fp8rl.data.scoring import DEFAULT_TIMEOUT_S, GradingPool, grade_many
from fp8rl.rpc import reward_pb2, reward_pb2_grpc

__all__ = ["RewardServicer"]


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    """Scores batches of responses.

    Args:
        default_grader: grader for items whose ``grader`` is ``""``; must be registered.
        timeout_s: per-item wall-clock bound in seconds; an item past it scores 0 with error
            ``"timeout: ..."``.
        pool: grading pool; None uses the process-wide :func:`fp8rl.data.scoring.default_pool`.
        max_items: most items in one Score call.
        max_response_chars: most characters in one item's response (and in its answer).

    Raises:
        ValueError: ``default_grader`` is not registered, or ``timeout_s`` / a limit is not > 0.
    """

    def __init__(self, default_grader: str = "math_verify", timeout_s: float = DEFAULT_TIMEOUT_S,
                 pool: GradingPool | None = None, *, max_items: int = limits.MAX_SCORE_ITEMS,
                 max_response_chars: int = limits.MAX_RESPONSE_CHARS):
        if default_grader not in GRADERS:
            raise ValueError(f"unknown default grader {default_grader!r}; known graders: {', '.join(sorted(GRADERS))}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_items < 1 or max_response_chars < 1:
            raise ValueError(f"max_items and max_response_chars must be >= 1, got {max_items}, {max_response_chars}")
        self.default_grader, self.timeout_s, self._pool = default_grader, timeout_s, pool
        self.max_items, self.max_response_chars = max_items, max_response_chars

    def _check_size(self, request: reward_pb2.ScoreRequest, context: grpc.ServicerContext) -> None:
        if len(request.items) > self.max_items:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"items: {len(request.items)} items; the limit is "
                                                            f"{self.max_items} (--max-items)")
        for i, item in enumerate(request.items):
            for field in ("response", "answer"):
                n = len(getattr(item, field))
                if n > self.max_response_chars:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"items[{i}].{field}: {n} characters; the limit is {self.max_response_chars} "
                                  f"(--max-response-chars)")

    def Score(self, request: reward_pb2.ScoreRequest, context: grpc.ServicerContext) -> reward_pb2.ScoreResponse:
        self._check_size(request, context)
        items = [(item.grader or self.default_grader, item.response, item.answer) for item in request.items]
        for i, (name, _, _) in enumerate(items):
            if name not in GRADERS:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"items[{i}].grader: unknown grader {name[:80]!r}; known graders: {', '.join(sorted(GRADERS))}",
                )
        results = grade_many(items, self.timeout_s, pool=self._pool)
        return reward_pb2.ScoreResponse(
            rewards=[r.reward for r in results],
            num_unparsable=sum(r.status == "unparsable" for r in results),
            errors=["" if r.status == "ok" else f"{r.status}: {r.detail}" for r in results],
        )
