"""The controller's calls to the reward replicas: every live ``reward`` lease serves, each call goes to the one with
the fewest items in flight from this controller, and a replica that fails a call (gone, past its deadline) is
passed over for the rest of the step's scoring.

- ``Score`` (the rule graders) is one call, failed over to the next live replica on UNAVAILABLE or
  DEADLINE_EXCEEDED — a killed replica whose lease has not expired yet costs one refused connection, not a step.
- ``ScoreModel`` (the reward model) is sent in chunks of ``reward.model.max_batch`` items, concurrently, each to the
  least loaded replica; items a replica could not score (its judge's output did not parse, it timed out, the replica
  died mid-call) are sent again — to another replica where there is one — up to the job's attempts. Whatever is
  still unscored then comes back unscored with its last reason: the caller leaves it out of the step and counts it,
  never a placeholder 0.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc

from fp8rl.rewards.items import ModelItem, ModelScore
from fp8rl.rpc import reward_pb2

__all__ = ["NoReplica", "RewardRouter"]

log = logging.getLogger("fp8rl.controller")

_DEADLINE_MARGIN_S = 30.0  # a ScoreModel call's deadline past the service's own bound (the service answers first)
_FAIL_OVER = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class NoReplica(Exception):
    """No reward replica could take the call: ``code`` and ``detail`` of the last failure (UNAVAILABLE when none is
    live), or a replica's refusal that no other would answer differently (FAILED_PRECONDITION: no reward model)."""

    def __init__(self, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(f"{code.name}: {detail}")
        self.code, self.detail = code, detail


def _score(s: reward_pb2.ModelScore, ep: str) -> ModelScore:
    ref = float(s.reference) if s.reference_scored and 0.0 <= s.reference <= 1.0 else None
    if not s.scored:
        return ModelScore(None, s.error or "unscored", s.tokens, s.unparsable, s.compared, ref)
    if not 0.0 <= s.score <= 1.0:  # NaN fails this too
        return ModelScore(None, f"reward replica {ep} answered score {s.score}, outside [0, 1]", s.tokens,
                          s.unparsable)
    return ModelScore(float(s.score), "", s.tokens, s.unparsable, s.compared, ref)


class RewardRouter:
    """Calls to the reward replicas ``endpoints()`` lists (re-read at every call).

    Args:
        endpoints: the live reward replicas' ``host:port``s.
        stub: an endpoint's ``RewardService`` stub.
    """

    def __init__(self, endpoints: Callable[[], list[str]], stub: Callable[[str], object]) -> None:
        self.endpoints, self.stub = endpoints, stub
        self._lock = threading.Lock()
        self.in_flight: dict[str, int] = {}  # endpoint -> items sent to it and not yet answered
        self.calls: dict[str, int] = {}  # endpoint -> calls made to it (the routing, as the tests read it)
        self.failed: set[str] = set()  # replicas that failed a call of the current scoring (reset per step)

    def reset(self) -> None:
        """A new step: every live replica may be tried again."""
        with self._lock:
            self.failed.clear()

    def _live(self) -> list[str]:
        live = self.endpoints()
        if not live:
            raise NoReplica(grpc.StatusCode.UNAVAILABLE, "no live reward lease in Redis (is the reward service "
                                                         "running?) and no --reward address")
        return live

    def _pick(self, live: Sequence[str], items: int, exclude: set[str] = frozenset()) -> str | None:
        """The live replica with the fewest items in flight — one that has not failed where possible — its count
        raised by ``items`` under the same lock (two concurrent chunks never both see it idle); None when every
        live replica is in ``exclude``."""
        with self._lock:
            left = [e for e in live if e not in exclude]
            if not left:
                return None
            pool = [e for e in left if e not in self.failed] or left
            ep = min(pool, key=lambda e: (self.in_flight.get(e, 0), self.calls.get(e, 0), e))
            self.in_flight[ep] = self.in_flight.get(ep, 0) + items
            self.calls[ep] = self.calls.get(ep, 0) + 1
            return ep

    def _done(self, ep: str, items: int, failed: bool = False) -> None:
        with self._lock:
            self.in_flight[ep] -= items
            if failed:
                self.failed.add(ep)

    def call(self, method: str, request, timeout: float | None, *, items: int):
        """``method`` on the least loaded live replica, failed over to the others on UNAVAILABLE / DEADLINE_EXCEEDED.

        Raises:
            NoReplica: none is live, every live one failed so, or one answered another error (its code).
        """
        live, tried, last = self._live(), set(), None
        while (ep := self._pick(live, items, tried)) is not None:
            tried.add(ep)
            try:
                resp = getattr(self.stub(ep), method)(request, timeout=timeout)
            except grpc.RpcError as err:
                over = err.code() in _FAIL_OVER
                self._done(ep, items, failed=over)
                if not over:
                    raise NoReplica(err.code(), f"reward at {ep}: {err.details()}") from None
                last = err
                log.warning("reward replica %s failed %s (%s); trying another", ep, method, err.code().name)
                continue
            self._done(ep, items)
            return resp
        raise NoReplica(last.code(), f"reward at {', '.join(sorted(tried))}: {last.details()}")

    def _send(self, live: Sequence[str], items: list[ModelItem], timeout_s: float) -> list[ModelScore]:
        ep = self._pick(live, len(items))
        req = reward_pb2.ScoreModelRequest(items=[reward_pb2.ModelItem(question=i.question, response=i.response,
                                                                       answer=i.answer, other=i.other)
                                                  for i in items],
                                           timeout_s=timeout_s)
        try:
            resp = self.stub(ep).ScoreModel(req, timeout=timeout_s + _DEADLINE_MARGIN_S)
        except grpc.RpcError as err:
            self._done(ep, len(items), failed=err.code() != grpc.StatusCode.FAILED_PRECONDITION)
            if err.code() == grpc.StatusCode.FAILED_PRECONDITION:  # holds no reward model: retrying cannot help
                raise NoReplica(err.code(), f"reward at {ep}: {err.details()}") from None
            return [ModelScore(None, f"reward replica {ep}: {err.code().name}: {err.details()}")] * len(items)
        self._done(ep, len(items))
        if len(resp.scores) != len(items):
            return [ModelScore(None, f"reward replica {ep} answered {len(resp.scores)} scores for {len(items)} "
                                     f"items")] * len(items)
        return [_score(s, ep) for s in resp.scores]

    def score_model(self, items: Sequence[ModelItem], *, chunk: int, attempts: int, timeout_s: float
                    ) -> list[ModelScore]:
        """One :class:`ModelScore` per item, in order (module docstring): chunks of ``chunk`` items, ``attempts``
        calls per item at most, ``timeout_s`` the service's bound on a call.

        Raises:
            NoReplica: no reward replica is live, or one holds no reward model (FAILED_PRECONDITION).
        """
        out: list[ModelScore] = [ModelScore(None, "not sent")] * len(items)
        todo = list(range(len(items)))
        for attempt in range(max(1, attempts)):
            live = self._live()
            chunks = [todo[k:k + max(1, chunk)] for k in range(0, len(todo), max(1, chunk))]
            with ThreadPoolExecutor(max_workers=min(len(chunks), 2 * len(live)),
                                    thread_name_prefix="score-model") as pool:
                answers = list(pool.map(lambda c, live=live: self._send(live, [items[i] for i in c], timeout_s),
                                        chunks))
            for c, got in zip(chunks, answers, strict=True):
                for i, s in zip(c, got, strict=True):
                    out[i] = s
            todo = [i for i in todo if out[i].score is None]
            if not todo:
                break
            if attempt + 1 < attempts:
                log.warning("%d of %d items were not scored by the reward model (items[%d]: %s); sending them again "
                            "(%d/%d)", len(todo), len(items), todo[0], out[todo[0]].error, attempt + 1, attempts)
        return out
