"""Multi-turn trajectories on the stack: the controller drives the turns, the services do the work (issue 48).

:func:`fp8rl.envs.trajectory.run_trajectories` — the same turn loop the in-process loop runs — over two remote
halves:

* the **environment** of each trajectory lives in the reward service's env workers (``EnvService``:
  :class:`RemoteEnv` is its client; no environment code runs in the controller). ``Reset`` opens it, ``Step``
  answers each model turn within the job's ``env.step_timeout_s`` (the worker is killed past it), ``Close`` ends
  it. An environment's failure (a status on an OK reply) ends that trajectory ungraded; an RPC failure (the reward
  service is away) fails the step, which the runner retries like any transient failure — never a judged trajectory.
* each **turn** is one Generate per rollout replica (:meth:`fp8rl.controller.pool.RolloutPool.generate_turn`),
  sticky: a trajectory's turns go to the replica holding its K/V under its session key, and move (re-prefilled)
  when that replica is lost. The sessions are released when the trajectories end. Under ``env.partial: finish``
  a replica holds a refit back while trajectories of its version are in flight (each is sampled by one version);
  under ``interrupt`` it does not, and a trajectory's next turn runs on the new weights.

The tokens are the replicas' exactly (never re-tokenized) and the environment's replies are the chat template's
deltas, rendered here with the policy's tokenizer, so the trainer's one forward over a whole trajectory is
bitwise the replicas' per-turn decode under batch invariance.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from fp8rl.controller.plan import JobPlan, model_max_positions, sampling_seed
from fp8rl.data import Problem
from fp8rl.engines.base import Sample
from fp8rl.envs import ChatRenderer, EnvError, Environment, EnvStep
from fp8rl.envs.trajectory import TURN_SEED_STRIDE, Trajectory, run_trajectories, trajectories_markdown
from fp8rl.model.tokenizer import stop_token_ids
from fp8rl.rpc import env_pb2
from fp8rl.rpc.routes import routes_from_proto

__all__ = ["RemoteEnv", "TrajectoryRunner"]

_RPC_SLACK_S = 30.0  # a Step's deadline past the environment's own bound: a worker's kill and restart fit in it
MAX_REPORT_CHARS = 16 * 1024  # StepReport.trajectories_md (kept with every report in Redis)


class RemoteEnv(Environment):
    """One trajectory's environment in the reward service's env workers (see the module docstring).

    Args:
        call: ``call(method, request, timeout)`` → the EnvService reply; raises the runner's RpcFailed.
        trajectory_id: unique among the trajectories open on the service.
        name, kwargs: the job's ``env.name`` / ``env.kwargs``.
        step_timeout_s: the job's ``env.step_timeout_s`` (the worker's bound).
        deadline_exceeded: whether a call's exception is its deadline passing — a TimeoutError for this trajectory
            (its step ran long); any other exception propagates (the caller fails the step and retries it).
    """

    def __init__(self, call: Callable[[str, Any, float], Any], trajectory_id: str, name: str, kwargs: dict,
                 step_timeout_s: float, deadline_exceeded: Callable[[BaseException], bool]) -> None:
        self.call, self.id, self.env_name, self.kwargs = call, trajectory_id, name, kwargs
        self.step_timeout_s, self._deadline_exceeded = step_timeout_s, deadline_exceeded
        self._tools: list[dict] = []

    def reset(self, task: dict[str, Any]) -> list[dict]:
        resp = self.call("Reset", env_pb2.EnvResetRequest(
            trajectory_id=self.id, env=self.env_name, kwargs_json=json.dumps(self.kwargs),
            task_json=json.dumps(task)), self.step_timeout_s + _RPC_SLACK_S)
        self._tools = json.loads(resp.tools_json)
        return json.loads(resp.messages_json)

    def tools(self) -> list[dict]:
        return self._tools

    def step(self, assistant_text: str) -> EnvStep:
        try:
            resp = self.call("Step", env_pb2.EnvStepRequest(trajectory_id=self.id, text=assistant_text,
                                                            timeout_s=self.step_timeout_s),
                             self.step_timeout_s + _RPC_SLACK_S)
        except Exception as exc:
            if self._deadline_exceeded(exc):
                raise TimeoutError(f"the environment's step did not answer within {self.step_timeout_s:g} s + "
                                   f"{_RPC_SLACK_S:g} s") from None
            raise
        if resp.status == env_pb2.ENV_STATUS_TIMEOUT:
            raise TimeoutError(resp.error or f"the environment's step took longer than {self.step_timeout_s:g} s")
        if resp.status != env_pb2.ENV_STATUS_OK:
            raise EnvError(f"{env_pb2.EnvStatus.Name(resp.status)}: {resp.error}")
        messages, info = json.loads(resp.messages_json), json.loads(resp.info_json or "{}")
        return EnvStep(messages, resp.reward if resp.done else None, resp.done, info)


def _sample_of(msg) -> Sample:
    """A rollout replica's Sample proto as the engine's :class:`Sample` (routes as a tensor: stitched per turn)."""
    routes = routes_from_proto(msg.routes, "sample") if msg.HasField("routes") else None
    return Sample(prompt_index=msg.prompt_index, prompt_ids=(), token_ids=tuple(msg.token_ids),
                  logprobs=tuple(msg.logprobs), finish_reason=msg.finish_reason, weight_version=msg.weight_version,
                  routes=routes)


class TrajectoryRunner:
    """A job's trajectories over the services.

    Args:
        plan: the job (its env spec, tokenizer, seeds).
        env_call: ``call(method, request, timeout)`` on the reward service's EnvService.
        pool: the job's :class:`~fp8rl.controller.pool.RolloutPool`.
        wait_s, tick: as :meth:`RolloutPool.generate_turn`.
        reraise, deadline_exceeded: the runner's RpcFailed (propagates: the step is retried), and whether one is
            a DEADLINE_EXCEEDED (an environment step that ran long: that trajectory's timeout).
    """

    def __init__(self, plan: JobPlan, env_call, pool, *, wait_s: float, tick: Callable[[], None],
                 reraise: tuple[type[BaseException], ...], deadline_exceeded: Callable[[BaseException], bool]) -> None:
        self.plan, self.env_call, self.pool = plan, env_call, pool
        self.wait_s, self.tick, self.reraise, self.deadline_exceeded = wait_s, tick, reraise, deadline_exceeded
        self.renderer = ChatRenderer(plan.tok)
        self.max_context = model_max_positions(plan.job)
        self.last: list[Trajectory] = []

    def _env(self, ids: list[str], prefix: str) -> RemoteEnv:
        spec = self.plan.env
        ids.append(f"{prefix}{len(ids)}")
        return RemoteEnv(self.env_call, ids[-1], spec.name, spec.kwargs, spec.step_timeout_s,
                         self.deadline_exceeded)

    def openings(self, problems: Sequence[Problem]) -> list[list[int]]:
        """Each problem's opening prompt (its environment reset in a worker, rendered with its tools, closed)."""
        ids: list[str] = []
        prefix = f"{self.plan.job_id}-open-{uuid.uuid4().hex[:8]}-"
        try:
            out = []
            for p in problems:
                env = self._env(ids, prefix)
                out.append(self.renderer.opening(env.reset({"question": p.prompt, "answer": p.answer}), env.tools()))
            return out
        finally:
            self._close(ids)

    def run(self, problems: Sequence[Problem], version: int, *, step: int, n: int, temperature: float
            ) -> list[tuple[int, Trajectory]]:
        """``n`` trajectories of every problem at ``version``, prompt-major, as ``(problem index, trajectory)``."""
        plan, g = self.plan, self.plan.job.policy.generation
        tag = f"{plan.job_id}-s{step}-{uuid.uuid4().hex[:8]}-"
        ids: list[str] = []
        keys: list[str] = []
        sticky: dict[str, tuple[str, int]] = {}
        pins: dict[str, int] = {}  # the version each trajectory is sampled at (asynchronous GRPO: at least version)
        # env.partial interrupt: no pin past a turn and no replica holding a refit back for these trajectories; each
        # turn runs at the version its replica serves then (at least ``version``), a refit's new weights recompute
        # the older K/V (the engine drops its sessions), and every token keeps the version it was sampled by
        interrupt = plan.job.env.partial == "interrupt"

        def generate_turn(prompts, max_tokens, turn, turn_keys):
            samples = self.pool.generate_turn(
                prompts, turn_keys, version, sampling={"temperature": temperature, "top_p": g.top_p,
                                                       "max_tokens": max_tokens},
                seed_of=lambda a: sampling_seed(plan.job.job.seed, step, a) + TURN_SEED_STRIDE * turn,
                request_id=f"{tag}t{turn}", wait_s=self.wait_s, sticky=sticky, pins={} if interrupt else pins,
                tick=self.tick, at_least=plan.async_grpo, max_weight_lag=0 if interrupt else plan.max_weight_lag)
            return [_sample_of(s) for s in samples]

        tasks = [{"question": p.prompt, "answer": p.answer} for p in problems]
        try:
            trajs = run_trajectories(
                tasks, n, plan.env, lambda: self._env(ids, tag), self.renderer, generate_turn,
                max_context=self.max_context, decode=lambda t: plan.tok.decode(t, skip_special=False),
                stop_ids=stop_token_ids(plan.tok), release=keys.append,
                step_env=lambda env, text: env.step(text), reraise=self.reraise, key_prefix=tag)
        finally:
            self._close(ids)
            if keys:
                self.pool.release(keys, sticky)
        self.last = trajs[:4]
        return [(t.prompt_index, t) for t in trajs]

    def markdown(self) -> str:
        """Two of the last step's trajectories as Markdown (:func:`~fp8rl.envs.trajectory.trajectories_markdown`),
        cut at :data:`MAX_REPORT_CHARS`."""
        if not self.last:
            return ""
        md = trajectories_markdown(self.last[:2], lambda t: self.plan.tok.decode(t, skip_special=False),
                                   title=f"Trajectories ({self.plan.env.name})")
        return md if len(md) <= MAX_REPORT_CHARS else md[:MAX_REPORT_CHARS - 20] + "\n\n[... cut]\n"

    def _close(self, ids: list[str]) -> None:
        """Close the environments of ``ids`` (best effort: a service that restarted has none of them)."""
        for a in range(0, len(ids), 4096):
            try:
                self.env_call("Close", env_pb2.EnvCloseRequest(trajectory_ids=ids[a:a + 4096]), 30.0)
            except self.reraise:
                return
