"""The controller's gRPC adapters: the services behind :class:`fp8rl.controller.step.StepBackends`.

Every call resolves its role's endpoint from the newest live lease in Redis (a restarted service is
found on its new port at the next try) and converts protos; the step logic is the library's. Score
items the reward service could not grade are scored again, and a step never trains on a placeholder.
A multi-turn job's rollout is :class:`~services.controller.trajectories.TrajectoryRunner`'s: its environments
run in the reward service's env workers, its turns on sticky rollout replicas; an ungraded trajectory (its
environment failed) is left out of the loss by the step, never re-scored.
"""

from __future__ import annotations

import base64
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from fp8rl.controller.pictures import picture_table, sequence_files
from fp8rl.controller.plan import JobPlan, model_max_positions, sampling_seed
from fp8rl.controller.pool import RolloutError
from fp8rl.controller.step import Trained
from fp8rl.rewards.combine import mix_rewards
from fp8rl.rewards.items import item_of
from fp8rl.rewards.policy_judge import PolicyJudge
from fp8rl.rpc import calibrator_pb2, common_pb2, reward_pb2, rollout_pb2, trainer_pb2
from fp8rl.rpc.channel import DEFAULT_DEADLINE_S as DL
from fp8rl.rpc.routes import routes_to_proto

from .reward_router import NoReplica, RewardRouter

log = logging.getLogger("fp8rl.controller")

__all__ = ["Backends", "GrpcStep", "PictureSample", "call", "calibrate_request", "JobCancelled", "JobFailed",
           "RpcFailed", "Stopping", "TRANSIENT"]

TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
_GRADED = {reward_pb2.GRADE_STATUS_GRADED, reward_pb2.GRADE_STATUS_UNPARSABLE}  # rewards that are verdicts


class JobFailed(Exception):
    """The job cannot go on; the message is recorded as its error."""


class JobCancelled(Exception):
    pass


class Stopping(Exception):
    """The controller is shutting down: leave the job ``running``, to be resumed."""


class RpcFailed(Exception):
    def __init__(self, phase: str, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(f"{phase}: {code.name}: {detail}")
        self.code = code


@dataclass(frozen=True)
class Backends:
    """How a step reaches the services: each role's endpoint is read from its newest live lease at every call.

    Attributes:
        stub: ``(role, endpoint)`` → that service's stub (the caller owns and caches the channels).
        fallback: role → ``host:port`` used while no lease of that role is live (the controller's
            ``--trainer`` ... flags; empty when every service registers, as the launcher's do).
    """

    stub: Callable[[str, str], object]
    fallback: dict[str, str]

    def rollout(self, endpoint: str) -> object:
        return self.stub("rollout", endpoint)


class GrpcStep:
    """:class:`fp8rl.controller.step.StepBackends` over the services: protos in and out, nothing else."""

    def __init__(self, runner, plan: JobPlan) -> None:
        self.r, self.plan = runner, plan  # the JobRunner: its settings, rollout pool, refit store, cancel check
        self.agent = plan.job.agent.entrypoint is not None
        self.graded = plan.env is not None or self.agent  # trajectories carry their rewards
        # multi-turn and agent jobs: generate() is handed the problems (the tasks); vision-language jobs: their pictures
        self.wants_problems = self.graded or plan.images is not None
        self._trajectories = None
        self._agents = None
        self._rewards: RewardRouter | None = None
        self._judged = 0  # follow_policy: the judging rounds so far (each its own request id and seeds)
        self.reward_metrics: dict[str, float] = {}  # a reward model's reward/* of the latest score() call
        self.last_pictures: list[dict] = []  # a vision-language job: a few of the last scored picture prompts

    @property
    def trajectories(self):
        """The job's :class:`~services.controller.trajectories.TrajectoryRunner` (multi-turn jobs)."""
        if self._trajectories is None:
            from .trajectories import TrajectoryRunner

            self._trajectories = TrajectoryRunner(
                self.plan, lambda method, req, timeout: call(self.r, "rollout", "reward", method, req, timeout, "env"),
                self.r.pool, wait_s=self.r.settings.replica_wait_s,
                tick=lambda: self.r._check(self.plan.job_id, cancel=False), reraise=(RpcFailed,),
                deadline_exceeded=lambda e: isinstance(e, RpcFailed) and e.code == grpc.StatusCode.DEADLINE_EXCEEDED)
        return self._trajectories

    @property
    def agents(self):
        """The job's :class:`~services.controller.agents.AgentJobRunner` (agent jobs)."""
        if self._agents is None:
            from .agents import AgentJobRunner

            self._agents = AgentJobRunner(
                self.plan, lambda method, req, timeout: call(self.r, "rollout", "reward", method, req, timeout, "env"),
                self.r.refit, wait_s=self.r.settings.replica_wait_s,
                tick=lambda: self.r._check(self.plan.job_id, cancel=False))
        return self._agents

    def markdown(self) -> str:
        """A few of the last step's trajectories (multi-turn and agent jobs), else ""."""
        if self.plan.env is not None:
            return self.trajectories.markdown()
        return self.agents.markdown() if self.agent else ""

    def prompts_of(self, problems) -> list[list[int]]:
        """The problems' prompts: a multi-turn job's are its environments' openings (reset in the env workers)."""
        return self.trajectories.openings(problems) if self.plan.env is not None else self.plan.prompts(problems)

    def generate(self, prompts, version, *, step, n, temperature, problems=None):
        if step < self.plan.total:  # a step's own rollout (validation's and refills' indices lie past the steps):
            self.r.rollout_begun(self.plan.job_id, step)  # recorded first, so a successor controller counts it
        if self.plan.env is not None:
            try:
                return self.trajectories.run(problems, version, step=step, n=n, temperature=temperature)
            except RolloutError as exc:
                raise _rollout_failed(exc) from None
        if self.agent:
            try:
                return self.agents.run(problems, prompts, version, step=step, n=n, temperature=temperature)
            except RolloutError as exc:
                raise _rollout_failed(exc) from None
        return self._sample(self.plan, prompts, version, step=step, n=n, temperature=temperature, problems=problems)

    def score(self, pairs):
        if self.graded:  # the environment / agent graded each trajectory (None: it failed, ungraded)
            return [s.reward for _, s in pairs]
        self.rewards.reset()  # a new step: a replica that failed the last one may serve again
        self.reward_metrics = {}
        texts = [self.plan.tok.decode(s.token_ids) for _, s in pairs]
        rules = self._grade(self.plan, pairs, texts)
        out = rules if self.plan.job.reward.model.kind is None else self._mix(pairs, texts, rules)
        # replicas passed over this step (gone, or past a deadline): their calls went to the others
        self.reward_metrics["reward/replicas_failed"] = float(len(self.rewards.failed))
        if self.plan.images is not None:
            self.last_pictures = report_pictures(pairs, texts, rules)
        return out

    @property
    def rewards(self) -> RewardRouter:
        """The job's calls to the reward replicas: every live ``reward`` lease (else the ``--reward`` address), the
        least loaded first, a failed one passed over."""
        if self._rewards is None:
            def endpoints() -> list[str]:
                live = sorted(ls.endpoint for ls in self.r.refit.live_replicas("reward").values())
                fallback = self.r.b.fallback.get("reward")
                return live or ([fallback] if fallback else [])

            self._rewards = RewardRouter(endpoints, lambda ep: self.r.b.stub("reward", ep))
        return self._rewards

    def _mix(self, pairs, texts: list[str], rules: list[float]) -> list[float | None]:
        """The rule rewards mixed with the reward model's scores (``reward.combine``); a sample the model left
        unscored after its attempts is None (ungraded: out of the step, counted in ``reward/model_unscored``)."""
        c, rm = self.plan.job.reward.combine, self.plan.job.reward.model
        items = [item_of(p, text) for (p, _), text in zip(pairs, texts, strict=True)]

        def score(batch: list) -> list:
            return self.rewards.score_model(batch, chunk=rm.max_batch, attempts=self.r.settings.score_attempts,
                                            timeout_s=rm.timeout_s)

        if rm.follow_policy:  # the policy judges, on the rollout replicas, at the version they hold (at least the
            score = self._policy_judge(min(s.weight_version for _, s in pairs)).score  # samples')
        try:
            out, self.reward_metrics = mix_rewards(items, rules, score, gate=c.gate, rule_weight=c.rule_weight,
                                                   model_weight=c.model_weight, pairwise=rm.pairwise,
                                                   group=self.plan.group)
        except NoReplica as exc:
            raise RpcFailed("reward", exc.code, exc.detail) from None
        if self.reward_metrics["reward/model_unscored"]:
            log.warning("job %s: the reward model left %d samples unscored; they are left out of the step",
                        self.plan.job_id, self.reward_metrics["reward/model_unscored"])
        return out

    def _policy_judge(self, version: int) -> PolicyJudge:
        """``reward.model.follow_policy``: judge prompts sampled on the rollout replicas (the pool's routing and
        retries), at ``version`` or newer."""
        rm, job_id = self.plan.job.reward.model, self.plan.job_id
        self._judged += 1

        def generate(prompts, n, seed):
            try:
                got = self.r.pool.generate(
                    prompts, version, n=n, sampling={"temperature": rm.temperature, "top_p": 1.0,
                                                     "max_tokens": rm.max_new_tokens},
                    seed_of=lambda a: seed + a, request_id=f"{job_id}-judge-{self._judged}",
                    wait_s=self.r.settings.replica_wait_s, tick=lambda: self.r._check(job_id, cancel=False),
                    at_least=True)
            except RolloutError as exc:
                raise _rollout_failed(exc) from None
            return [(i, list(s.token_ids)) for i, s in got]

        return PolicyJudge(rm, self.plan.tok, generate, max_len=model_max_positions(self.plan.job),
                           attempts=self.r.settings.score_attempts,
                           seed=sampling_seed(self.plan.job.job.seed, 1_000_000 + self._judged, 0))

    def train(self, version, step, rows, *, max_weight_lag=0):
        images, indices = picture_table([getattr(s, "images", ()) for _, s, _ in rows])
        req = trainer_pb2.TrainStepRequest(expected_version=version, step=step, max_weight_lag=max_weight_lag,
                                           calibrate_scales=self.plan.fp8_kv and self.site == "trainer",
                                           scales_from_logprobs=self.plan.fp8_kv and self.site == "logprobs",
                                           rows=[_sequence(p, s, a, idx) for (p, s, a), idx in
                                                 zip(rows, indices, strict=True)], images=images)
        resp = self.rpc("train", "trainer", "TrainStep", req, DL.train_step)
        pt = resp.phase_times
        # calibrate: the trainer's own calibration of the new version (calibration.site trainer), else 0
        return Trained(resp.new_version, dict(resp.metrics),
                       {"logprobs": pt.logprobs, "train": pt.train, "publish": pt.publish, "calibrate": pt.calibrate})

    @property
    def site(self) -> str:
        """calibration.site resolved for this job (``logprobs`` / ``trainer``: TrainStep stores the new version's
        scales; ``calibrator``: the Calibrate call does)."""
        return self.plan.job.calibration_site[0]

    def calibrate(self, version, sequences, *, pictures=None):
        if version > 0 and self.site != "calibrator" and self.r.refit.get_scales(version) is not None:
            return  # the trainer stored v's scales with its weights (TrainStep); version 0, or a version some other
            # TrainStep made without them (a step trained before a controller restart), is the calibrator's
        files = None if pictures is None else sequence_files(pictures, len(sequences))
        self.rpc("calibrate", "calibrator", "Calibrate", calibrate_request(version, sequences, files), DL.calibrate)

    def await_refit(self, version):
        return {"refit/fenced": float(len(self.r._refit_wait(version)))}

    def rpc(self, phase: str, role: str, method: str, request, timeout: float | None):
        return call(self.r, phase, role, method, request, timeout)

    def _sample(self, plan: JobPlan, prompts: list[list[int]], v: int, *, step: int, n: int,
                temperature: float, problems=None) -> list[tuple[int, rollout_pb2.Sample]]:
        g, seed = plan.job.policy.generation, plan.job.job.seed
        images = None
        if plan.images is not None and problems is not None:  # a vision-language job: each prompt's pictures
            images = [p.images for p in problems]
        try:
            out = self.r.pool.generate(
                prompts, v, n=n, sampling={"temperature": temperature, "top_p": g.top_p,
                                           "max_tokens": g.max_new_tokens},
                seed_of=lambda a: sampling_seed(seed, step, a), request_id=f"{plan.job_id}-s{step}",
                at_least=plan.async_grpo,  # async: the newest version a live replica holds, never older than v
                wait_s=self.r.settings.replica_wait_s, tick=lambda: self.r._check(plan.job_id, cancel=False),
                images=images)
        except RolloutError as exc:
            raise _rollout_failed(exc) from None
        if images is None:
            return out
        return [(i, PictureSample(s, images[i])) for i, s in out]  # the pictures go on with their samples

    def _grade(self, plan: JobPlan, pairs, texts: list[str]) -> list[float]:
        """One graded reward per pair (``texts``: the decoded responses): items the service could not grade are
        re-scored, up to ``score_attempts`` calls; one still ungraded fails the job (its 0 would be trained on as a
        verdict)."""
        grader = plan.job.reward.grader
        items = [reward_pb2.ScoreItem(response=text, answer=p.answer, grader=grader)
                 for (p, _), text in zip(pairs, texts, strict=True)]
        rewards: list[float | None] = [None] * len(items)
        todo, why = list(range(len(items))), {}
        for attempt in range(self.r.settings.score_attempts):
            try:  # the least loaded reward replica, failed over to another when it is gone
                resp = self.rewards.call("Score", reward_pb2.ScoreRequest(items=[items[i] for i in todo]), DL.score,
                                         items=len(todo))
            except NoReplica as exc:
                raise RpcFailed("reward", exc.code, exc.detail) from None
            if not (len(resp.rewards) == len(resp.statuses) == len(todo)):
                raise JobFailed(f"reward: the reward service answered {len(resp.rewards)} rewards and "
                              f"{len(resp.statuses)} statuses for {len(todo)} items")
            again = []
            for i, r, st, err in zip(todo, resp.rewards, resp.statuses, list(resp.errors) or [""] * len(todo),
                                     strict=True):
                if st in _GRADED and math.isfinite(r) and 0.0 <= r <= 1.0:
                    rewards[i] = float(r)
                else:
                    again.append(i)
                    why[i] = err or f"status {reward_pb2.GradeStatus.Name(st)}, reward {r}"
            todo = again
            if not todo:
                return rewards
            log.warning("job %s: %d of %d responses were not graded (items[%d]: %s); scoring them again (%d/%d)",
                        plan.job_id, len(todo), len(items), todo[0], why[todo[0]], attempt + 1,
                        self.r.settings.score_attempts)
        raise JobFailed(f"reward: {len(todo)} of {len(items)} responses could not be graded in "
                      f"{self.r.settings.score_attempts} tries (items[{todo[0]}]: {why[todo[0]]}); the step was not "
                      f"trained, so no placeholder reward was learned from")


def _rollout_failed(exc: RolloutError) -> Exception:
    """A failed rollout as the runner's error: a gRPC status is retried like any call's (transient ones), none
    (no replica, wrong samples) fails the job."""
    return RpcFailed("rollout", exc.code, str(exc)) if exc.code is not None else JobFailed(f"rollout: {exc}")


MAX_REPORT_PICTURES, MAX_REPORT_PICTURE_BYTES = 4, 256 * 1024  # StepReport.pictures (kept in Redis)


def report_pictures(pairs, texts: list[str], rules: list[float]) -> list[dict]:
    """The report's pictures (``StepReport.pictures``, as stored with the report: image files base64): the first
    sample of the first few problems with pictures, while their files fit :data:`MAX_REPORT_PICTURE_BYTES`."""
    out, seen, size = [], set(), 0
    for (p, _), text, rule in zip(pairs, texts, rules, strict=True):
        if not p.images or id(p) in seen:
            continue
        seen.add(id(p))
        size += sum(len(b) for b in p.images)
        if size > MAX_REPORT_PICTURE_BYTES or len(out) == MAX_REPORT_PICTURES:
            break
        out.append({"images": [base64.b64encode(b).decode() for b in p.images], "prompt": p.prompt,
                    "reference": p.answer, "sampled": text, "right": bool(rule >= 1.0)})
    return out


class PictureSample:
    """A rollout replica's Sample proto of a picture prompt with the prompt's image files (``images``), which its
    training row sends (everything else is the proto's)."""

    __slots__ = ("images", "proto")

    def __init__(self, proto: rollout_pb2.Sample, images: tuple[bytes, ...]) -> None:
        self.proto, self.images = proto, tuple(images)

    def __getattr__(self, name: str):
        return getattr(self.proto, name)


def calibrate_request(version: int, sequences: list[list[int]], files: list[tuple[bytes, ...]] | None
                      ) -> calibrator_pb2.CalibrateRequest:
    """The Calibrate call of ``version`` on ``sequences`` (prompts, or prompts and responses); ``files``: a
    vision-language job's, per sequence its prompt's image files."""
    images, indices = picture_table(files if files is not None else [()] * len(sequences))
    return calibrator_pb2.CalibrateRequest(version=version, images=images, sequences=[
        common_pb2.TokenSequence(token_ids=q, image_indices=idx) for q, idx in zip(sequences, indices, strict=True)])


def _sequence(prompt, s, advantage: float, images: list[int]) -> trainer_pb2.Sequence:
    """A training row: a rollout replica's Sample proto, or a multi-turn trajectory (its loss mask, its routes
    stitched turn by turn); ``images``: its prompt's pictures' indices into the request's."""
    if hasattr(s, "end_reason"):  # fp8rl.envs.trajectory.Trajectory
        return trainer_pb2.Sequence(prompt_ids=prompt, response_ids=s.token_ids, gen_logprobs=s.logprobs,
                                    advantage=advantage, weight_version=s.weight_version,
                                    loss_mask=[bool(m) for m in s.token_mask],
                                    routes=None if s.routes is None else routes_to_proto(s.routes))
    return trainer_pb2.Sequence(prompt_ids=prompt, response_ids=s.token_ids, gen_logprobs=s.logprobs,
                                advantage=advantage, weight_version=s.weight_version,
                                routes=s.routes if s.HasField("routes") else None, image_indices=images)


def call(runner, phase: str, role: str, method: str, request, timeout: float | None, service: str | None = None):
    """``role``'s ``method`` at the endpoint of its newest live lease (else its fallback address), on the stub of
    ``service`` (default: the role's own; ``"env"``: the reward service's EnvService); a gRPC error becomes
    :class:`RpcFailed` naming the phase, the role and the endpoint."""
    lease = runner.refit.endpoint_of(role)
    endpoint = lease.endpoint if lease is not None else runner.b.fallback.get(role)
    if not endpoint:
        raise RpcFailed(phase, grpc.StatusCode.UNAVAILABLE, f"no live {role} lease in Redis (is the {role} "
                                                             f"service running?) and no --{role} address")
    try:
        return getattr(runner.b.stub(service or role, endpoint), method)(request, timeout=timeout)
    except grpc.RpcError as err:
        raise RpcFailed(phase, err.code(), f"{role} at {endpoint}: {err.details()}") from None
