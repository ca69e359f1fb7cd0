"""Agent jobs on the stack: the reward service runs the agents in its sandbox, the replicas' endpoints serve their
calls, the controller assigns and reads back the sessions (issue 51).

A step's ``n`` trajectories of every problem are one ``RunAgents`` call to the reward service's EnvService: each
agent gets a single-use session id and the base URL of one rollout replica's OpenAI-compatible endpoint (replicas
started with ``--openai-port`` record it in Redis; those holding the step's version are used, round-robin, so a
trajectory's calls all reach the replica that holds its K/V). The reward service runs each agent in a sandbox
whose only way out is a proxy socket to that endpoint (:mod:`services.reward.agents`), ends its session there and
returns the session's record — every token, the model's with their logprobs and weight versions — with how the
agent ended. The record becomes the trajectory (:func:`fp8rl.agents.runner.trajectory_or_opening`), exactly as
in the in-process loop, so the trainer trains the very tokens the replica sampled.

An agent that failed, hung or made no call is its trajectory's ``end_reason`` (ungraded, out of the loss,
counted); the reward service away is an RPC failure that the runner retries like any, never a judged trajectory.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Sequence

import grpc

from fp8rl.agents.runner import AgentResult, trajectory_or_opening
from fp8rl.controller.plan import JobPlan, model_config_of
from fp8rl.controller.pool import RolloutError
from fp8rl.data import Problem
from fp8rl.envs.trajectory import Trajectory, trajectories_markdown
from fp8rl.rpc import env_pb2

__all__ = ["AgentJobRunner"]

_RPC_SLACK_S = 60.0
_ENDS = {env_pb2.AGENT_END_DONE: "done", env_pb2.AGENT_END_ERROR: "env_error",
         env_pb2.AGENT_END_TIMEOUT: "env_timeout"}
MAX_REPORT_CHARS = 16 * 1024


class AgentJobRunner:
    """An agent job's rollouts over the services (module docstring).

    Args:
        plan: the job (its ``agent`` section, tokenizer, model).
        env_call: ``call(method, request, timeout)`` on the reward service's EnvService (raises the runner's
            RpcFailed, which propagates: the step is retried).
        refit: the job's :class:`~fp8rl.refit.store.RefitStore` (live leases, the endpoints they recorded).
        wait_s, tick: how long to wait for a replica serving the step's version, and the cancel check run meanwhile.
    """

    def __init__(self, plan: JobPlan, env_call: Callable, refit, *, wait_s: float, tick: Callable[[], None]) -> None:
        self.plan, self.env_call, self.refit, self.wait_s, self.tick = plan, env_call, refit, wait_s, tick
        cfg = model_config_of(plan.job)
        self.max_context, self.vocab_size = cfg.max_position_embeddings, cfg.vocab_size
        self.last: list[Trajectory] = []

    def endpoints(self, version: int) -> list[str]:
        """Base URLs of the live replicas' endpoints holding ``version``, waiting up to ``wait_s`` for one.

        Raises:
            RolloutError: none within ``wait_s`` — UNAVAILABLE (retried) when no replica of that version is live,
                no code (the job fails) when replicas are live but none serves an endpoint.
        """
        deadline = time.monotonic() + self.wait_s
        while True:
            leases = self.refit.live_replicas("rollout")
            urls = self.refit.agent_endpoints()
            at = {rid: ls for rid, ls in leases.items() if ls.version == version}
            usable = [urls[rid] for rid in sorted(at) if rid in urls]
            if usable:
                return usable
            if time.monotonic() >= deadline:
                if at:
                    raise RolloutError(f"agent jobs call the rollout replicas' OpenAI-compatible endpoint, and none "
                                       f"of the {len(at)} live replicas at version {version} serves one: start them "
                                       f"with --openai-port")
                raise RolloutError(f"no live rollout replica holds weight version {version} within {self.wait_s:g} s",
                                   grpc.StatusCode.UNAVAILABLE)
            self.tick()
            time.sleep(0.2)

    def run(self, problems: Sequence[Problem], prompts: Sequence[Sequence[int]], version: int, *, step: int, n: int,
            temperature: float) -> list[tuple[int, Trajectory]]:
        """``n`` trajectories of every problem at ``version``, prompt-major, as ``(problem index, trajectory)``;
        ``prompts[i]`` is problem ``i``'s opening, the row of an agent that never called the model."""
        plan, agent, g = self.plan, self.plan.job.agent, self.plan.job.policy.generation
        urls = self.endpoints(version)
        tag = f"agent-{plan.job_id[:48]}-s{step}-{uuid.uuid4().hex[:8]}"
        total = len(problems) * n
        sids = [f"{tag}-{k}" for k in range(total)]
        tasks = [env_pb2.AgentTask(session_id=sids[k], base_url=urls[k % len(urls)], task_json=json.dumps(
            {"question": problems[k // n].prompt, "answer": problems[k // n].answer})) for k in range(total)]
        req = env_pb2.RunAgentsRequest(entrypoint=agent.entrypoint, tasks=tasks, timeout_s=agent.timeout_s,
                                       concurrency=agent.concurrency, temperature=temperature, top_p=g.top_p,
                                       grader=plan.job.reward.grader, max_tokens_per_call=agent.max_tokens_per_call)
        # the bound of the whole call: every agent is bounded by timeout_s in the reward service, but how many run at
        # once there (its --agent-slots) is its own, so the worst case is one at a time; a reward service that dies
        # fails the call at once (UNAVAILABLE), not at this deadline
        resp = self.env_call("RunAgents", req, agent.timeout_s * total + _RPC_SLACK_S)
        by_sid = {o.session_id: o for o in resp.outcomes}
        trajs = []
        for k, sid in enumerate(sids):
            o = by_sid.get(sid)
            if o is None:
                result, rec = AgentResult(None, "env_error", "the reward service returned no outcome for it"), None
            else:
                result, rec = self._read(o)
            trajs.append(trajectory_or_opening(rec, prompts[k // n], k // n, result, version))
        self.last = trajs[:4]
        return [(t.prompt_index, t) for t in trajs]

    def _read(self, o: env_pb2.AgentOutcome) -> tuple[AgentResult, dict | None]:
        """An outcome as the agent's result and its session record (None: none usable, with the reason)."""
        end = _ENDS.get(o.end, "env_error")
        if end == "done" and not (o.graded and math.isfinite(o.reward)):
            end = "env_error"
        result = AgentResult(o.reward if end == "done" else None, end, o.error)
        if not o.token_ids:
            return result, None
        n, vocab = len(o.token_ids), self.vocab_size
        problem = None
        if not (len(o.logprobs) == len(o.loss_mask) == len(o.weight_versions) == n):
            problem = (f"the session record's lengths differ ({n} ids, {len(o.logprobs)} logprobs, "
                       f"{len(o.loss_mask)} mask, {len(o.weight_versions)} versions)")
        elif n > self.max_context:
            problem = f"the trajectory holds {n} tokens, more than the model's {self.max_context} positions"
        elif min(o.token_ids) < 0 or max(o.token_ids) >= vocab:
            problem = f"the session record holds token ids outside the vocabulary [0, {vocab})"
        elif any(m > 1 for m in o.loss_mask) or not all(math.isfinite(x) for x in o.logprobs):
            problem = "the session record's loss mask or logprobs are malformed"
        if problem:
            return AgentResult(None, "env_error", problem), None
        rec = {"token_ids": list(o.token_ids), "loss_mask": list(o.loss_mask), "logprobs": list(o.logprobs),
               "weight_versions": list(o.weight_versions), "turns": o.turns, "tool_calls": o.tool_calls}
        return result, rec

    def markdown(self) -> str:
        """Two of the last step's trajectories as Markdown, cut at :data:`MAX_REPORT_CHARS`."""
        if not self.last:
            return ""
        md = trajectories_markdown(self.last[:2], lambda t: self.plan.tok.decode(t, skip_special=False),
                                   title=f"Trajectories (agent {self.plan.job.agent.entrypoint})")
        return md if len(md) <= MAX_REPORT_CHARS else md[:MAX_REPORT_CHARS - 20] + "\n\n[... cut]\n"
