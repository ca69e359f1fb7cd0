"""The reward service: ``RewardService.Score`` over :mod:`fp8rl.data.scoring`, on the common skeleton.

Started like every role (``python -m services.reward --config JOB.yaml``, :mod:`services.common.runtime`):
the job's ``reward.grader`` and ``reward.timeout_s`` are the defaults (``--grader`` / ``--timeout-s``
win). It holds no model and no refit state; Redis holds only its endpoint lease (role ``reward``), so a
reward service restarted on another port is found by the controller.

Every item is graded by the grader it names (``""`` = the service's default) in a
:class:`~fp8rl.data.process_pool.ProcessGradingPool` (``--grading-workers`` processes) with a per-item
wall-clock bound; a wrong or unparsable answer scores 0 and never fails the call. Each item comes back
with a status (``GradeStatus``): a hung grader's item is ``TIMEOUT`` (its worker process is killed and
replaced), a crashing one ``ERROR`` — both *ungraded*, so the controller retries them and never trains
on their placeholder 0. The only failure is a caller's mistake: an unknown grader name is INVALID_ARGUMENT,
naming the item and the known graders, and nothing in that batch is graded. So is a batch over the
size limits (more than ``max_items`` items, or a response or answer longer than ``max_response_chars``;
defaults in :mod:`fp8rl.limits`), refused before anything is graded. A caller that is gone (cancelled, past its
deadline) stops the batch: items not yet taken by a worker are dropped, the ones grading finish within their
bound. At start the service records its grader names in Redis (those of each ``--grader-module`` too), which the
controller checks a submitted job's ``reward.grader`` against.

The service also serves ``EnvService`` (:mod:`services.reward.envs`): the environment steps of multi-turn
trajectories, each trajectory's environment in one of ``--env-workers`` worker processes with rlimits
(``--env-memory-mb``) and a per-step bound (the job's ``env.step_timeout_s``, which the controller sends). The
environments it runs — the registered ones and import paths of each ``--env-module`` — are recorded in Redis too;
SubmitJob refuses a job whose ``env.name`` is not among them.

With ``reward.model`` set in the job it starts with, the service also holds that reward model — a judge or a
classifier on its own embedded engine (:mod:`fp8rl.rewards.model`), loaded before it serves — and scores items with it
in ``ScoreModel``: the items of concurrent calls share forward batches on one worker thread, beside the rule graders'
process pool, which it never holds up. An item the model cannot score comes back unscored, with the reason.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import threading

import grpc

from fp8rl import limits
from fp8rl.data import GRADERS
from fp8rl.data.process_pool import ProcessGradingPool
from fp8rl.data.scoring import DEFAULT_TIMEOUT_S, GradingCancelled, GradingPool, grade_many
from fp8rl.envs import env_names
from fp8rl.envs.worker_pool import EnvWorkerPool, Rlimits
from fp8rl.rewards.items import ModelItem
from fp8rl.rewards.model import RewardModel
from fp8rl.rpc import env_pb2_grpc, reward_pb2, reward_pb2_grpc
from fp8rl.rpc.channel import read_token_file
from services.common.runtime import Context, Service, ServiceSpec, StartupError, env_default

from .agents import AgentRunner
from .envs import EnvServicer

log = logging.getLogger("fp8rl.reward")

__all__ = ["RewardService", "RewardServicer", "SPEC", "STATUS_CODES"]

# fp8rl.data.scoring's statuses on the wire
STATUS_CODES = {"ok": reward_pb2.GRADE_STATUS_GRADED, "unparsable": reward_pb2.GRADE_STATUS_UNPARSABLE,
                "timeout": reward_pb2.GRADE_STATUS_TIMEOUT, "error": reward_pb2.GRADE_STATUS_ERROR}


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    """Scores batches of responses.

    Args:
        default_grader: grader for items whose ``grader`` is ``""``; must be registered.
        timeout_s: per-item wall-clock bound in seconds; an item past it scores 0 with error
            ``"timeout: ..."``.
        pool: grading pool (the ``pool`` attribute; may be set later, before serving); None uses the
            process-wide :func:`fp8rl.data.scoring.default_pool`.
        max_items: most items in one Score call.
        max_response_chars: most characters in one item's response (and in its answer).

    Raises:
        ValueError: ``default_grader`` is not registered, or ``timeout_s`` / a limit is not > 0.
    """

    def __init__(self, default_grader: str = "math_verify", timeout_s: float = DEFAULT_TIMEOUT_S,
                 pool: GradingPool | ProcessGradingPool | None = None, *, max_items: int = limits.MAX_SCORE_ITEMS,
                 max_response_chars: int = limits.MAX_RESPONSE_CHARS):
        self.metrics = None  # fp8rl.metrics.ServiceMetrics, set by the service
        if default_grader not in GRADERS:
            raise ValueError(f"unknown default grader {default_grader!r}; known graders: {', '.join(sorted(GRADERS))}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_items < 1 or max_response_chars < 1:
            raise ValueError(f"max_items and max_response_chars must be >= 1, got {max_items}, {max_response_chars}")
        self.default_grader, self.timeout_s, self.pool = default_grader, timeout_s, pool
        self.max_items, self.max_response_chars = max_items, max_response_chars
        self.model: RewardModel | None = None  # the job's reward.model, served by ScoreModel (set by the service)
        self.model_name = ""

    def _check_size(self, items, fields: tuple[str, ...], context: grpc.ServicerContext) -> None:
        """At most ``max_items`` items, each text field in ``fields`` at most ``max_response_chars``."""
        if len(items) > self.max_items:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"items: {len(items)} items; the limit is "
                                                            f"{self.max_items} (--max-items)")
        for i, item in enumerate(items):
            for field in fields:
                n = len(getattr(item, field))
                if n > self.max_response_chars:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"items[{i}].{field}: {n} characters; the limit is {self.max_response_chars} "
                                  f"(--max-response-chars)")

    def Score(self, request: reward_pb2.ScoreRequest, context: grpc.ServicerContext) -> reward_pb2.ScoreResponse:
        self._check_size(request.items, ("response", "answer"), context)
        items = [(item.grader or self.default_grader, item.response, item.answer) for item in request.items]
        for i, (name, _, _) in enumerate(items):
            if name not in GRADERS:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"items[{i}].grader: unknown grader {name[:80]!r}; known graders: {', '.join(sorted(GRADERS))}",
                )
        try:  # a caller that is gone (cancelled, past its deadline) stops the batch at its next item
            results = grade_many(items, self.timeout_s, pool=self.pool, should_stop=lambda: not context.is_active())
        except GradingCancelled as exc:
            context.abort(grpc.StatusCode.CANCELLED, str(exc))
        if self.metrics is not None:
            self.metrics.graded.inc(len(results))
        return reward_pb2.ScoreResponse(
            rewards=[r.reward for r in results],
            num_unparsable=sum(r.status == "unparsable" for r in results),
            errors=["" if r.status == "ok" else f"{r.status}: {r.detail}" for r in results],
            statuses=[STATUS_CODES[r.status] for r in results],
        )

    def ScoreModel(self, request: reward_pb2.ScoreModelRequest,
                   context: grpc.ServicerContext) -> reward_pb2.ScoreModelResponse:
        self._check_size(request.items, ("question", "response", "answer", "other"), context)
        timeout_s = request.timeout_s
        if not (math.isfinite(timeout_s) and timeout_s >= 0):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s: {timeout_s} is not a finite number >= 0")
        if self.model is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "this reward service holds no reward model: start it with a job whose reward.model is set "
                          "(--config JOB.yaml)")
        got = self.model.score([ModelItem(it.question, it.response, it.answer, it.other) for it in request.items],
                               timeout_s=timeout_s or None, should_stop=lambda: not context.is_active())
        if self.metrics is not None:
            self.metrics.graded.inc(len(got))
        return reward_pb2.ScoreModelResponse(
            scores=[reward_pb2.ModelScore(scored=s.score is not None, score=s.score or 0.0, error=s.error,
                                          tokens=s.tokens, unparsable=s.unparsable, compared=s.compared,
                                          reference_scored=s.reference is not None, reference=s.reference or 0.0)
                    for s in got],
            model=self.model_name)


class RewardService(Service):
    """A grading process pool and the servicer over it."""

    def __init__(self, ctx: Context) -> None:
        a, job = ctx.args, ctx.job
        modules = tuple(a.grader_module or ())
        for name in modules:  # registers their graders here (names are checked here) and in every worker
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - any import failure is a startup error naming the module
                raise StartupError(f"--grader-module {name}: cannot import it: {type(exc).__name__}: {exc}") from None
        grader = a.grader or job.reward.grader
        timeout_s = a.timeout_s if a.timeout_s is not None else job.reward.timeout_s
        if a.grading_workers < 1:
            raise StartupError(f"--grading-workers must be >= 1, got {a.grading_workers}")
        try:
            self.servicer = RewardServicer(grader, timeout_s, None, max_items=a.max_items,
                                           max_response_chars=a.max_response_chars)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        env_modules = tuple(a.env_module or ())
        for name in env_modules:  # checked here (a clear startup error), imported again by every worker
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - any import failure is a startup error naming the module
                raise StartupError(f"--env-module {name}: cannot import it: {type(exc).__name__}: {exc}") from None
        if a.env_workers < 1 or a.env_memory_mb < 64:
            raise StartupError(f"--env-workers must be >= 1 and --env-memory-mb >= 64, got {a.env_workers}, "
                               f"{a.env_memory_mb}")
        self.pool = ProcessGradingPool(a.grading_workers, modules=modules, eager=True)
        self.servicer.pool = self.pool  # made after the servicer validated the flags: no workers for a bad config
        self.servicer.metrics = ctx.metrics
        rm = job.reward.model
        # loaded before serving (a model that cannot load is a startup error, named); follow_policy: the rollout's
        if rm.kind is not None and not rm.follow_policy:
            log.info("loading the reward model (%s %s, %s)", rm.kind, rm.model, rm.precision)
            try:
                self.servicer.model = RewardModel(rm, scaling=job.fp8_recipe("rollout").scaling, seed=job.job.seed)
            except (OSError, ValueError, RuntimeError) as exc:  # RuntimeError: vLLM missing, or no FP8 here
                raise StartupError(f"reward.model: {rm.model!r} cannot be served: {exc}") from None
            self.servicer.model_name = f"{rm.kind} {rm.model} {rm.precision}"
        self.grader, self.timeout_s = grader, timeout_s
        self.env_modules = env_modules
        # started at the first Reset: a stack that runs no multi-turn job holds no environment worker
        self.envs = EnvWorkerPool(a.env_workers, modules=env_modules, rlimits=Rlimits(memory_mb=a.env_memory_mb),
                                  timeout_s=job.env.step_timeout_s, eager=False)
        if a.agent_slots < 1 or a.agent_memory_mb < 256:
            raise StartupError(f"--agent-slots must be >= 1 and --agent-memory-mb >= 256, got {a.agent_slots}, "
                               f"{a.agent_memory_mb}")
        token = read_token_file(a.openai_token_file, "--openai-token-file") if a.openai_token_file else None
        self.agents = AgentRunner(env_modules, self.pool, grader, timeout_s, slots=a.agent_slots,
                                  memory_mb=a.agent_memory_mb, token=token)

    def servicers(self):
        return [(reward_pb2_grpc.add_RewardServiceServicer_to_server, self.servicer),
                (env_pb2_grpc.add_EnvServiceServicer_to_server, EnvServicer(self.envs, agents=self.agents))]

    def start(self, ctx: Context) -> None:
        ctx.set_serving(True)
        # what SubmitJob checks a job's reward.grader against; Redis may be away (grading needs none): retried
        threading.Thread(target=self._record_graders, args=(ctx,), name="reward-graders", daemon=True).start()

    def _record_graders(self, ctx: Context) -> None:
        while not ctx.stopping.is_set():
            try:
                ctx.store.set_graders(sorted(GRADERS))
                ctx.store.set_envs(env_names(), list(self.env_modules))
                return
            except Exception as exc:  # noqa: BLE001 - Redis away: the controller falls back to the built-in graders
                log.warning("cannot record the graders in Redis yet (%s); retrying in 5 s", exc)
                ctx.stopping.wait(5.0)

    def stop(self) -> None:
        if self.servicer.model is not None:
            self.servicer.model.close()
        self.agents.close()
        self.pool.close()
        self.envs.close_all()


def _module_list(key: str) -> list[str] | None:
    """The comma-separated module names of environment default ``key`` (``$FP8RL_<KEY>``), None when empty."""
    return [m.strip() for m in env_default(key, "").split(",") if m.strip()] or None


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grader", default=env_default("grader"),
                   help="grader for items that name none (default: the job's reward.grader)")
    p.add_argument("--timeout-s", type=float, default=env_default("grade_timeout_s"),
                   help="per-item grading time bound in seconds (default: the job's reward.timeout_s)")
    p.add_argument("--grader-module", action="append", metavar="MODULE", default=_module_list("grader_modules"),
                   help="import MODULE (repeatable) to register more graders (fp8rl.data.register_grader; default: "
                        "the comma-separated $FP8RL_GRADER_MODULES)")
    p.add_argument("--grading-workers", type=int, default=int(env_default("grading_workers", 2)),
                   help="grading worker processes (default 2)")
    p.add_argument("--env-module", action="append", metavar="MODULE", default=_module_list("env_modules"),
                   help="a module (repeatable) whose environments the env workers may run by import path "
                        "(module:Class in a job's env.name; default: the comma-separated $FP8RL_ENV_MODULES)")
    p.add_argument("--env-workers", type=int, default=int(env_default("env_workers", 2)),
                   help="environment worker processes (default 2): at most this many environment steps run at once")
    p.add_argument("--env-memory-mb", type=int, default=int(env_default("env_memory_mb", 4096)),
                   help="address-space limit of each environment worker in MiB (default 4096)")
    p.add_argument("--agent-slots", type=int, default=int(env_default("agent_slots", 4)),
                   help="agents of agent jobs running at once, each in its sandbox (default 4)")
    p.add_argument("--agent-memory-mb", type=int, default=int(env_default("agent_memory_mb", 2048)),
                   help="address-space limit of each agent process in MiB (default 2048)")
    p.add_argument("--openai-token-file", default=env_default("openai_token_file"),
                   help="file holding the rollout replicas' OpenAI-endpoint token, which agents' calls carry "
                        "(the agents never see it)")
    p.add_argument("--max-items", type=int, default=int(env_default("max_items", limits.MAX_SCORE_ITEMS)),
                   help=f"most items in one Score call (default {limits.MAX_SCORE_ITEMS})")
    p.add_argument("--max-response-chars", type=int,
                   default=int(env_default("max_response_chars", limits.MAX_RESPONSE_CHARS)),
                   help=f"most characters in one item's response or answer (default {limits.MAX_RESPONSE_CHARS})")


# Grading needs no Redis: the service starts without it; its lease (how the controller finds it) registers once
# Redis answers.
SPEC = ServiceSpec(name="reward", default_port=50053, build=RewardService, add_args=_add_args, needs_redis=False)
