"""Bring your own agent: a user function drives the policy through the OpenAI-compatible endpoint, and each of its
sessions becomes a :class:`~fp8rl.envs.trajectory.Trajectory` (issue 51).

``agent.entrypoint: package.module:function`` is called as ``function(task, client)`` once per trajectory —
``task`` the problem as a dict (``question``, ``answer``), ``client`` a real ``openai.OpenAI`` whose every call
carries the trajectory's session id (``X-Session-Id``) — on a pool of ``agent.concurrency`` threads. The endpoint
(:class:`~fp8rl.endpoint.OpenAIEndpoint`) batches their calls into engine calls and records each session token by
token: the model's sampled tokens (trained, with their logprobs and weight version) and everything the agent sent
(its messages, tool results, the chat template's framing: masked). The calls of one session must continue one
another (the endpoint refuses a history that does not), so the record is the trajectory the model saw.

What the function returns is the reward: a number, or a text graded by ``reward.grader`` against the task's
answer. It ends its trajectory like an environment would (:data:`~fp8rl.envs.trajectory.END_REASONS`): ``done``
when it returned, ``env_error`` when it raised or made no model call, ``env_timeout`` past ``agent.timeout_s`` —
the last two ungraded (out of the loss, counted), never a silent 0.

The function runs in the loop's process: the loop trusts its user's code, as it trusts the job's model. On the
service stack it runs in the reward service's sandbox instead (:mod:`fp8rl.agents.sandboxed`,
:mod:`services.controller.agents`), and its session records become trajectories by :func:`trajectory_or_opening` too.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from fp8rl.endpoint import SESSION_HEADER, OpenAIEndpoint
from fp8rl.envs.adapters.common import import_object
from fp8rl.envs.trajectory import Trajectory

__all__ = ["AgentResult", "load_agent", "run_agents", "trajectory_of_session", "trajectory_or_opening"]

log = logging.getLogger(__name__)


def load_agent(entrypoint: str) -> Callable[[dict, Any], Any]:
    """Import ``package.module:function``.

    Raises:
        ValueError: not an import path, the module cannot be imported, or the attribute is missing or not callable
            (the message says which).
    """
    fn = import_object(entrypoint, "agent.entrypoint")
    if not callable(fn):
        raise ValueError(f"agent.entrypoint {entrypoint!r} is not callable")
    return fn


@dataclass(frozen=True)
class AgentResult:
    """What one agent call came to: its reward (None: ungraded), why it ended, and the error it raised."""

    reward: float | None
    end_reason: str
    error: str = ""


def _reward_of(value: Any, task: dict, grade: Callable[[str, str], float]) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError(f"an agent returns its reward (a number) or a text to grade, got {type(value).__name__}")
    if isinstance(value, str):
        return float(grade(value, str(task.get("answer", ""))))
    if not math.isfinite(value):
        raise ValueError(f"the agent's reward {value!r} is not finite")
    return float(value)


def trajectory_of_session(record: dict, prompt_index: int, result: AgentResult, version: int = -1) -> Trajectory:
    """A session's record (:meth:`~fp8rl.endpoint.sessions.SessionRecord.to_json`) as a trajectory: the leading
    caller tokens are its opening prompt, the rest its segments."""
    ids, mask = record["token_ids"], record["loss_mask"]
    first = mask.index(1) if 1 in mask else len(ids)
    t = Trajectory(prompt_index, tuple(ids[:first]), list(ids[first:]), list(record["logprobs"][first:]),
                   list(mask[first:]), list(record["weight_versions"][first:]))
    for m in t.token_mask:  # runs of model / caller tokens
        src = "model" if m else "env"
        if t.segments and t.segments[-1][0] == src:
            t.segments[-1] = (src, t.segments[-1][1] + 1)
        else:
            t.segments.append((src, 1))
    t.turns, t.reward, t.end_reason, t.version_begun = record["turns"], result.reward, result.end_reason, version
    t.tool_calls = record.get("tool_calls", 0)  # the calls the endpoint returned in OpenAI's tool_calls shape
    return t


def run_agents(fn: Callable[[dict, Any], Any], tasks: Sequence[dict], n: int, endpoint: OpenAIEndpoint,
               base_url: str, *, concurrency: int, timeout_s: float, grade: Callable[[str, str], float],
               openings: Sequence[Sequence[int]], version: int, tag: str = "") -> list[Trajectory]:
    """``n`` trajectories of every task (prompt-major), each one call of ``fn`` with its own session on
    ``endpoint`` (served at ``base_url``); each session is dropped from the endpoint (and its K/V from the engine)
    once read. ``openings[i]``: task ``i``'s prompt ids, the row of a trajectory whose agent never called the
    model (ungraded, masked: the batch keeps its shape); ``version`` the one the calls are pinned to."""
    try:
        import openai  # the real client, imported where agents run
    except ImportError:
        raise RuntimeError("agent jobs hand each agent an openai.OpenAI client: pip install 'fp8rl[agents]' (the "
                           "openai package)") from None

    tag = f"{tag}-{uuid.uuid4().hex[:8]}" if tag else uuid.uuid4().hex[:8]  # session ids are single-use
    sids = [f"agent-{tag}-{i}-{j}" for i in range(len(tasks)) for j in range(n)]

    def one(k: int) -> AgentResult:
        task = dict(tasks[k // n])
        client = openai.OpenAI(base_url=base_url, api_key="fp8rl-agent", default_headers={SESSION_HEADER: sids[k]},
                               max_retries=0, timeout=timeout_s)
        try:
            value = fn(task, client)
            return AgentResult(_reward_of(value, task, grade), "done")
        except Exception as exc:  # noqa: BLE001 - the user's agent: its failure ends its trajectory, counted
            return AgentResult(None, "env_error", f"{type(exc).__name__}: {exc}")
        finally:
            client.close()

    results: list[AgentResult] = []
    ex = ThreadPoolExecutor(max_workers=min(concurrency, len(sids)), thread_name_prefix="agent")
    try:
        futures = [ex.submit(one, k) for k in range(len(sids))]
        deadline = time.monotonic() + timeout_s  # the pool's: agents queued behind others share it
        for f in futures:
            try:
                results.append(f.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                results.append(AgentResult(None, "env_timeout", f"the agent ran past agent.timeout_s={timeout_s:g}"))
    finally:  # an agent past its time is not waited for (a thread cannot be killed: its later calls are refused)
        ex.shutdown(wait=False, cancel_futures=True)
    errors = [r.error for r in results if r.error]
    if errors:
        log.warning("%d of %d agents ended ungraded; the first: %s", len(errors), len(results), errors[0][:300])
    return [trajectory_or_opening(endpoint.close_session(sid), openings[k // n], k // n, res, version)
            for k, (sid, res) in enumerate(zip(sids, results, strict=True))]


def trajectory_or_opening(record: dict | None, opening: Sequence[int], prompt_index: int, result: AgentResult,
                          version: int) -> Trajectory:
    """The trajectory of a session's ``record`` — or, when the agent had the model write no token (no record,
    or one without a model token), its task's ``opening`` ids as an ungraded row (masked: the batch keeps its
    shape)."""
    if record is None or not any(record["loss_mask"]):
        result = AgentResult(None, "env_error", result.error or "the agent made no model call")
        ids = list(opening)
        record = {"token_ids": ids, "loss_mask": [0] * len(ids), "logprobs": [0.0] * len(ids),
                  "weight_versions": [-1] * len(ids), "turns": 0, "tool_calls": 0}
    return trajectory_of_session(record, prompt_index, result, version)
