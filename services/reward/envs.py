"""``EnvService`` on the reward service: multi-turn trajectories' environment steps in bounded worker processes.

Wiring only — proto ↔ :class:`fp8rl.envs.worker_pool.EnvWorkerPool`. The controller drives the turns (it renders,
samples and trains); every ``reset`` / ``step`` of an environment runs here, in a worker process with rlimits and a
per-call wall-clock bound, never in the controller. Only environments the workers were started with run: the
registered built-ins and import paths of the service's ``--env-module`` modules (recorded in Redis with the graders,
what SubmitJob checks ``env.name`` against); any other is INVALID_ARGUMENT naming what runs here.

An environment's own failure is a status on an OK reply (``ERROR`` / ``TIMEOUT`` / ``LOST``) — the caller ends that
trajectory ungraded, counts it, and goes on — while RPC errors are the caller's mistakes (INVALID_ARGUMENT: a bad
id, JSON that is not an object, an environment not run here, sizes past :mod:`fp8rl.limits`) or a reset that
failed (FAILED_PRECONDITION naming the environment's error: the task cannot start).
"""

from __future__ import annotations

import json
import math

import grpc

from fp8rl import limits
from fp8rl.envs import allowed, env_names, import_paths
from fp8rl.envs.worker_pool import EnvWorkerPool
from fp8rl.rpc import env_pb2, env_pb2_grpc
from services.common.runtime import Abort, require, rpc_method

__all__ = ["EnvServicer", "STATUS_CODES"]

STATUS_CODES = {"ok": env_pb2.ENV_STATUS_OK, "error": env_pb2.ENV_STATUS_ERROR,
                "timeout": env_pb2.ENV_STATUS_TIMEOUT, "lost": env_pb2.ENV_STATUS_LOST}


def _check_id(tid: str, what: str = "trajectory_id") -> None:
    require(tid, f"{what} is empty")
    require(len(tid) <= limits.MAX_ENV_ID_CHARS, f"{what}: {len(tid)} characters; the limit is "
                                                 f"{limits.MAX_ENV_ID_CHARS}")


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _object(text: str, what: str) -> dict:
    """A JSON object from the wire (``""`` = {}), bounded; INVALID_ARGUMENT naming ``what`` otherwise."""
    require(len(text) <= limits.MAX_ENV_TASK_BYTES, f"{what}: {len(text)} bytes; the limit is "
                                                    f"{limits.MAX_ENV_TASK_BYTES}")
    if not text:
        return {}
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{what} is not JSON: {str(exc)[:200]}") from None
    require(isinstance(value, dict), f"{what} must be a JSON object, got {type(value).__name__}")
    return value


class EnvServicer(env_pb2_grpc.EnvServiceServicer):
    """proto ↔ the env worker pool; validation and status codes, nothing else.

    Args:
        pool: the worker pool (its modules say which import paths may run).
        max_timeout_s: the largest per-step bound a caller may ask for (EnvStepRequest.timeout_s).
    """

    def __init__(self, pool: EnvWorkerPool, max_timeout_s: float = 3600.0, agents=None) -> None:
        self.pool, self.max_timeout_s = pool, max_timeout_s
        self.agents = agents  # services.reward.agents.AgentRunner (RunAgents); None: not served

    @rpc_method
    def Reset(self, request, context):
        _check_id(request.trajectory_id)
        kwargs, task = _object(request.kwargs_json, "kwargs_json"), _object(request.task_json, "task_json")
        require(allowed(request.env, self.pool.modules, kwargs),
                f"env: {request.env[:200]!r} (with the import paths {import_paths(request.env, kwargs)}) does not "
                f"run here; the environment workers run {', '.join(env_names())}"
                + "".join(f", {m}:<Class>" for m in self.pool.modules) + " (more with the reward service's "
                "--env-module; an adapter's entry_point / factory module must be one of them)")
        try:
            r = self.pool.reset(request.trajectory_id, request.env, kwargs, task)
        except ValueError as exc:  # an id open already, or the pool is full
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT if "open already" in str(exc)
                        else grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        if r.status != "ok":
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION,
                        f"environment {request.env[:200]!r} could not start its task ({r.status}): {r.error}")
        return env_pb2.EnvResetResponse(messages_json=json.dumps(r.messages), tools_json=json.dumps(r.tools))

    @rpc_method
    def Step(self, request, context):
        _check_id(request.trajectory_id)
        require(len(request.text) <= limits.MAX_RESPONSE_CHARS,
                f"text: {len(request.text)} characters; the limit is {limits.MAX_RESPONSE_CHARS}")
        t = request.timeout_s
        require(math.isfinite(t) and 0 <= t <= self.max_timeout_s,
                f"timeout_s must be in [0, {self.max_timeout_s:g}] (0: the service's default), got {t}")
        r = self.pool.step(request.trajectory_id, request.text, t or None)
        return env_pb2.EnvStepResponse(
            status=STATUS_CODES[r.status], messages_json=json.dumps(r.messages),
            reward=r.reward if r.reward is not None else 0.0, done=r.done, info_json=json.dumps(r.info),
            error=r.error)

    @rpc_method
    def Close(self, request, context):
        ids = list(request.trajectory_ids)
        require(len(ids) <= limits.MAX_ENV_IDS, f"trajectory_ids: {len(ids)} ids; the limit is {limits.MAX_ENV_IDS}")
        for i, tid in enumerate(ids):
            _check_id(tid, f"trajectory_ids[{i}]")
        return env_pb2.EnvCloseResponse(closed=self.pool.close(ids))

    @rpc_method
    def RunAgents(self, request, context):
        if self.agents is None:
            raise Abort(grpc.StatusCode.UNIMPLEMENTED, "this reward service runs no agents")
        return self.agents.run(request)
