"""The controller's routing of reward calls over the replicas (issue 52), with stubs standing in for the replicas
(the real path — two reward services, one killed mid-job — is ``tests/integration/controller/
test_reward_model_stack.py``): the least loaded replica first, concurrent chunks spread, a gone replica failed over
and passed over for the rest of the step, a replica's unscored items sent again elsewhere, a replica without a
reward model a clear error."""

from __future__ import annotations

import threading

import grpc
import pytest

from fp8rl.rewards.items import ModelItem
from fp8rl.rpc import reward_pb2
from services.controller.reward_router import NoReplica, RewardRouter


class _Err(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return f"{self._code.name} here"


class _Replica:
    """A reward replica's stub: scores each item 0.5 (or leaves them unscored), or fails every call with ``error``."""

    def __init__(self, error=None, unscored=False, barrier=None):
        self.error, self.unscored, self.barrier, self.items = error, unscored, barrier, []

    def Score(self, req, timeout=None):
        if self.error:
            raise _Err(self.error)
        return reward_pb2.ScoreResponse(rewards=[1.0] * len(req.items))

    def ScoreModel(self, req, timeout=None):
        if self.barrier is not None:
            self.barrier.wait(10)  # both chunks in flight at once
        if self.error:
            raise _Err(self.error)
        self.items += [i.response for i in req.items]
        return reward_pb2.ScoreModelResponse(scores=[
            reward_pb2.ModelScore(scored=False, error="did not parse") if self.unscored else
            reward_pb2.ModelScore(scored=True, score=0.5) for _ in req.items])


def _router(replicas: dict) -> RewardRouter:
    return RewardRouter(lambda: sorted(replicas), lambda ep: replicas[ep])


ITEMS = [ModelItem("q", str(k)) for k in range(8)]


def test_concurrent_chunks_go_to_the_least_loaded_replicas():
    barrier = threading.Barrier(2)
    reps = {"a:1": _Replica(barrier=barrier), "b:1": _Replica(barrier=barrier)}
    r = _router(reps)
    got = r.score_model(ITEMS, chunk=4, attempts=2, timeout_s=5)
    assert all(s.score == 0.5 for s in got)
    assert sorted(reps["a:1"].items + reps["b:1"].items) == sorted(i.response for i in ITEMS)
    assert len(reps["a:1"].items) == len(reps["b:1"].items) == 4 and r.in_flight == {"a:1": 0, "b:1": 0}


def test_a_gone_replica_is_failed_over_and_its_items_scored_elsewhere():
    reps = {"a:1": _Replica(grpc.StatusCode.UNAVAILABLE), "b:1": _Replica()}
    r = _router(reps)
    assert len(r.call("Score", reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem()]), 5, items=1).rewards) == 1
    assert r.failed == {"a:1"} and r.calls == {"a:1": 1, "b:1": 1}  # a was tried first (its name), then b
    got = r.score_model(ITEMS, chunk=4, attempts=2, timeout_s=5)
    assert all(s.score == 0.5 for s in got) and r.calls["a:1"] == 1  # passed over for the rest of the step
    r.reset()
    got = r.score_model(ITEMS[:4], chunk=4, attempts=2, timeout_s=5)  # a new step tries it again, then b
    assert all(s.score == 0.5 for s in got) and r.calls["a:1"] == 2
    with pytest.raises(NoReplica, match="UNAVAILABLE"):
        _router({"a:1": _Replica(grpc.StatusCode.UNAVAILABLE)}).call("Score", reward_pb2.ScoreRequest(), 5, items=0)
    with pytest.raises(NoReplica, match="no live reward lease"):
        _router({}).score_model(ITEMS, chunk=4, attempts=1, timeout_s=5)


def test_unscored_items_come_back_unscored_after_their_attempts_and_no_model_is_an_error():
    reps = {"a:1": _Replica(unscored=True)}
    got = _router(reps).score_model(ITEMS[:3], chunk=2, attempts=3, timeout_s=5)
    assert all(s.score is None and s.error == "did not parse" for s in got)
    assert len(reps["a:1"].items) == 9  # three attempts of three items
    with pytest.raises(NoReplica, match="FAILED_PRECONDITION"):
        _router({"a:1": _Replica(grpc.StatusCode.FAILED_PRECONDITION)}).score_model(ITEMS, chunk=4, attempts=3,
                                                                                     timeout_s=5)
