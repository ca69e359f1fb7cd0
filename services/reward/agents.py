"""``EnvService.RunAgents`` on the reward service: an agent job's agents, each in the sandbox (issue 51).

Wiring only — the request checked, then each agent run by :func:`fp8rl.agents.sandboxed.run_sandboxed_agent` with a
:class:`~fp8rl.agents.proxy.AgentProxy` socket to its replica's endpoint (the session id, the endpoint's token and
the job's sampling set there, never by the agent), its session ended and read back, a text it returned graded on
the service's grading pool. At most ``--agent-slots`` agents run at once on the service, across calls.

Only entrypoints of the service's ``--env-module`` modules run (as for environments); an agent's failure — it
raised, hung past ``timeout_s``, returned no reward, could not start — is its outcome's ``end``, never an RPC error.
"""

from __future__ import annotations

import logging
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from fp8rl import limits
from fp8rl.agents.proxy import AgentProxy, base_url_problem
from fp8rl.agents.sandboxed import AgentRun, run_sandboxed_agent, sandbox_python_problem
from fp8rl.data.scoring import grade_many
from fp8rl.envs.sandbox import SandboxPool, sandbox_problem
from fp8rl.rpc import env_pb2
from services.common.runtime import Abort, require

from .envs import _check_id, _object

__all__ = ["AgentRunner"]

log = logging.getLogger("fp8rl.reward")

_ENDS = {"done": env_pb2.AGENT_END_DONE, "env_error": env_pb2.AGENT_END_ERROR,
         "env_timeout": env_pb2.AGENT_END_TIMEOUT}
MAX_AGENT_TIMEOUT_S = 24 * 3600.0


class AgentRunner:
    """Runs RunAgents calls (module docstring).

    Args:
        modules: the service's ``--env-module`` modules: an entrypoint's module must be one of them.
        grading_pool, default_grader, grade_timeout_s: where and how a returned text is graded.
        slots: agents running at once on the service (sandbox slots).
        memory_mb: each agent process's address-space limit.
        token: the replica endpoints' bearer token (None: they take none).
    """

    def __init__(self, modules: tuple[str, ...], grading_pool: Any, default_grader: str, grade_timeout_s: float, *,
                 slots: int = 4, memory_mb: int = 2048, token: str | None = None) -> None:
        self.modules, self.grading_pool = modules, grading_pool
        self.default_grader, self.grade_timeout_s = default_grader, grade_timeout_s
        self.slots, self.memory_mb, self.token = slots, memory_mb, token
        self._pool: SandboxPool | None = None
        self._proxy: AgentProxy | None = None
        self._lock = threading.Lock()

    def _started(self) -> tuple[SandboxPool, AgentProxy]:
        with self._lock:
            return self._start()

    def _start(self) -> tuple[SandboxPool, AgentProxy]:
        if self._pool is None:  # at the first call: a stack that runs no agent job holds no proxy thread
            problem = sandbox_problem() or sandbox_python_problem()
            if problem:
                raise Abort(grpc.StatusCode.FAILED_PRECONDITION, f"this reward service cannot sandbox agents: "
                                                                 f"{problem}")
            self._proxy = AgentProxy(self.token, timeout_s=MAX_AGENT_TIMEOUT_S)
            # a uid range of its own, apart from the python environment's code sandboxes (60000..)
            self._pool = SandboxPool(self.slots, max_starting=2, queue_timeout_s=MAX_AGENT_TIMEOUT_S,
                                     uid_base=61000)
        return self._pool, self._proxy

    def check(self, request) -> None:
        """INVALID_ARGUMENT for a malformed call, or an entrypoint not run here."""
        ep = request.entrypoint
        module, sep, name = ep.partition(":")
        require(sep and module and name.isidentifier(), f"entrypoint {ep[:200]!r} is not package.module:function")
        require(module in self.modules, f"entrypoint {ep[:200]!r}: module {module!r} is not one of this reward "
                                        f"service's --env-module modules ({', '.join(self.modules) or 'none'}); "
                                        f"agents run only from those")
        require(0 < len(request.tasks) <= limits.MAX_ENV_IDS,
                f"tasks: {len(request.tasks)}; 1 to {limits.MAX_ENV_IDS} per call")
        require(math.isfinite(request.timeout_s) and 0 < request.timeout_s <= MAX_AGENT_TIMEOUT_S,
                f"timeout_s must be in (0, {MAX_AGENT_TIMEOUT_S:g}], got {request.timeout_s}")
        require(request.concurrency >= 1, f"concurrency must be >= 1, got {request.concurrency}")
        require(request.max_tokens_per_call >= 1, f"max_tokens_per_call must be >= 1, got "
                                                  f"{request.max_tokens_per_call}")
        require(math.isfinite(request.temperature) and request.temperature >= 0 and
                math.isfinite(request.top_p) and 0 < request.top_p <= 1,
                f"temperature >= 0 and top_p in (0, 1] are needed, got {request.temperature}, {request.top_p}")
        seen = set()
        for i, t in enumerate(request.tasks):
            _check_id(t.session_id, f"tasks[{i}].session_id")
            require(t.session_id not in seen, f"tasks[{i}].session_id {t.session_id!r} is repeated")
            seen.add(t.session_id)
            problem = base_url_problem(t.base_url)
            require(problem is None, f"tasks[{i}].base_url: {problem}")

    def run(self, request) -> env_pb2.RunAgentsResponse:
        self.check(request)
        tasks = [_object(t.task_json, f"tasks[{i}].task_json") for i, t in enumerate(request.tasks)]
        pool, proxy = self._started()

        def one(i: int) -> env_pb2.AgentOutcome:
            t = request.tasks[i]
            try:
                socket_dir = proxy.open(t.session_id, t.base_url, temperature=request.temperature,
                                        top_p=request.top_p, max_tokens=request.max_tokens_per_call)
            except ValueError as exc:
                return env_pb2.AgentOutcome(session_id=t.session_id, end=env_pb2.AGENT_END_ERROR, error=str(exc))
            try:
                run = run_sandboxed_agent(pool, request.entrypoint, tasks[i], socket_dir,
                                          timeout_s=request.timeout_s, memory_mb=self.memory_mb,
                                          give=lambda uid: proxy.give_to(t.session_id, uid))
            except ValueError as exc:  # its module has nothing to mount (agent_mounts)
                run = AgentRun("env_error", error=f"the agent cannot be sandboxed: {exc}")
            finally:
                try:
                    record, run_error = proxy.close(t.session_id), ""
                except (RuntimeError, TimeoutError) as exc:  # the replica went away: its tokens are lost with it
                    record, run_error = None, str(exc) or "ending the session timed out"
            if run.end != "done" and run.stderr:
                log.info("agent %s ended %s: %s", t.session_id, run.end, run.stderr[-500:])
            out = env_pb2.AgentOutcome(session_id=t.session_id, end=_ENDS[run.end], error=run.error or run_error)
            if run_error:
                out.end = env_pb2.AGENT_END_ERROR
            elif run.end == "done":
                self._reward(out, run.value, tasks[i], request.grader)
            if record is not None:
                _fill(out, record)
            return out

        workers = max(1, min(request.concurrency, self.slots, len(request.tasks)))
        with ThreadPoolExecutor(workers, thread_name_prefix="agent-run") as ex:
            outcomes = list(ex.map(one, range(len(request.tasks))))
        return env_pb2.RunAgentsResponse(outcomes=outcomes)

    def _reward(self, out: env_pb2.AgentOutcome, value: float | str, task: dict, grader: str) -> None:
        if isinstance(value, str):
            try:
                r = grade_many([(grader or self.default_grader, value, str(task.get("answer", "")))],
                               self.grade_timeout_s, pool=self.grading_pool)[0]
            except (KeyError, ValueError) as exc:  # an unknown grader name
                out.end, out.error = env_pb2.AGENT_END_ERROR, f"the agent's text could not be graded: {exc}"
                return
            if r.status not in ("ok", "unparsable"):
                out.end, out.error = env_pb2.AGENT_END_ERROR, f"the agent's text could not be graded: {r.detail}"
                return
            value = r.reward
        if not math.isfinite(value):
            out.end, out.error = env_pb2.AGENT_END_ERROR, f"the agent's reward {value!r} is not finite"
            return
        out.graded, out.reward = True, float(value)

    def close(self) -> None:
        if self._proxy is not None:
            self._proxy.shutdown()


def _fill(out: env_pb2.AgentOutcome, rec: dict) -> None:
    """The session record (the endpoint's JSON) into the outcome's typed fields."""
    try:
        ids, mask, lps, vers = rec["token_ids"], rec["loss_mask"], rec["logprobs"], rec["weight_versions"]
        if not (len(ids) == len(mask) == len(lps) == len(vers)):
            raise ValueError(f"lengths differ: {len(ids)} ids, {len(mask)} mask, {len(lps)} logprobs, "
                             f"{len(vers)} versions")
        out.token_ids.extend(ids)
        out.logprobs.extend(lps)
        out.loss_mask = bytes(1 if m else 0 for m in mask)
        out.weight_versions.extend(vers)
        out.turns, out.tool_calls = int(rec.get("turns", 0)), int(rec.get("tool_calls", 0))
    except (KeyError, TypeError, ValueError) as exc:
        out.end, out.error = env_pb2.AGENT_END_ERROR, f"the session record is malformed: {exc}"
        for f in ("token_ids", "logprobs", "weight_versions"):
            out.ClearField(f)
        out.loss_mask = b""
