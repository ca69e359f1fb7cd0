"""Asynchronous GRPO with bounded staleness: the rollouts of steps s+1 … s+k are generated while step s trains.

The same two halves of a step as the synchronous path (:func:`~fp8rl.controller.step.rollout_phase`,
:func:`~fp8rl.controller.step.train_phase`) over the same :class:`~fp8rl.controller.step.StepBackends`,
on four threads:

    rollout  generate_phase of steps in order. Step s waits until the rollout side holds (at least) the
             version step s-k starts from, then pins every sample to the newest version it holds.
    reward   score_phase of each generated step, in order: step s is graded (a reward model's judging
             included) while step s+1 generates. With dynamic sampling, whose next round depends on the
             last one's rewards, the rollout thread runs the whole rollout_phase and this one is idle.
    trainer  (the caller's thread) train_phase of step s on its rollout at the version the trainer holds,
             calibration when the backend cannot overlap it, then ``record``.
    refit    each new version in order: calibrate (when it overlaps: a calibrator with its own copy of
             the weights) and await_refit; a finished refit is what wakes the rollout role.

Invariants: a trained sample is at most ``k = plan.max_weight_lag`` versions older than the trainer's
(checked here before a batch is sent, and by the trainer again); a replica serves one version per
request, with the scales of that version, so no sample mixes two versions; refits apply in version
order. With ``k = 0`` the calls happen in exactly the synchronous order (rollout s waits for the refit
of the version step s starts from), so the run equals the synchronous one number for number.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from .step import (
    StepBackends,
    StepPlan,
    calibration_pictures,
    generate_phase,
    rollout_phase,
    score_phase,
    train_phase,
)

log = logging.getLogger(__name__)

__all__ = ["Pipeline"]

_JOIN_S = 60.0  # how long stopping waits for a thread in the middle of a call


class _Stopped(Exception):
    pass


class Pipeline:
    """One asynchronous run of steps ``first_step .. total-1`` from ``version`` (held by trainer and rollout side).

    Args:
        plan, b: the job's plan and backends (as for :func:`~fp8rl.controller.step.run_step`).
        first_step, total, version: where the run starts and ends.
        calibrate_inline: calibrate on the trainer's thread right after each train (the in-process loop's
            calibrator reads the trainer's live weights); else the refit thread calibrates, off the
            trainer's critical path.
        check: raises to stop (cancellation, shutdown); run on the trainer's and the rollout's threads.
    """

    def __init__(self, plan: StepPlan, b: StepBackends, *, first_step: int, total: int, version: int,
                 calibrate_inline: bool, check: Callable[[], None] = lambda: None) -> None:
        self.plan, self.b, self.k = plan, b, plan.max_weight_lag
        self.first, self.total, self.check = first_step, total, check
        self.calibrate_inline = calibrate_inline
        self._cv = threading.Condition()
        self._start_of = {first_step: version}  # step -> the version the trainer trains it from
        self._held = version  # the newest version the rollout side holds (a finished refit)
        self._rollouts: dict[int, dict] = {}
        self._refit_stats: list[tuple[float, float, dict]] = []  # (calibrate_s, refit_s, metrics) per finished refit
        self._error: BaseException | None = None
        self._stop = False
        self._refits: queue.Queue = queue.Queue()
        self._generated: queue.Queue = queue.Queue()  # generated, not yet graded steps (the reward thread's)

    # -- the trainer's thread -------------------------------------------------------------------------
    def run(self, record: Callable[[dict, dict, dict], bool], on_trained: Callable[[dict], None] = lambda p: None
            ) -> None:
        """Train every step; after each, ``on_trained(record so far)`` (the controller saves it at once), then
        ``record(partial, phase times, metrics)``, which returns whether to go on. Returns once the rollout
        side holds the last version trained (or raises what any of the three threads raised)."""
        producer = threading.Thread(target=self._produce, name="pipeline-rollout", daemon=True)
        grader = threading.Thread(target=self._grade, name="pipeline-reward", daemon=True)
        refitter = threading.Thread(target=self._refit, name="pipeline-refit", daemon=True)
        producer.start()
        grader.start()
        refitter.start()
        last = self._start_of[self.first]
        try:
            for step in range(self.first, self.total):
                t_idle = time.perf_counter()
                ro, version = self._take(step), self._start_of[step]
                idle = time.perf_counter() - t_idle
                oldest = min(s.weight_version for _, s in ro["samples"])
                if oldest < version - self.k:  # versions jumped (a republished checkpoint): generate it again
                    log.warning("step %d: its rollout is from version %d, more than %d behind the trainer's %d; "
                                "generating it again", step, oldest, self.k, version)
                    self.wait_held(version - self.k)
                    ro = rollout_phase(self.plan, self.b, step, self._held, self.check)
                t0 = time.perf_counter()
                partial = train_phase(self.plan, self.b, ro, version, self.check)
                on_trained(partial)
                new = last = partial["new_version"]
                t_cal = time.perf_counter()
                if self.calibrate_inline and self.plan.fp8_kv:
                    self.b.calibrate(new, partial["sequences"], **calibration_pictures(partial))
                calibrate_s = time.perf_counter() - t_cal
                with self._cv:
                    self._start_of[step + 1] = new
                    self._cv.notify_all()
                self._refits.put((new, None if self.calibrate_inline else partial))
                busy = time.perf_counter() - t0
                times = {**partial["phase_times"], "refit": 0.0,
                         "calibrate": partial["phase_times"].get("calibrate", 0.0) + calibrate_s}
                if not record(partial, times, self._metrics(ro, idle, busy)):
                    break
            self.wait_held(last)
        finally:
            with self._cv:
                self._stop = True
                self._cv.notify_all()
            self._refits.put(None)
            self._generated.put(None)
            producer.join(_JOIN_S)
            grader.join(_JOIN_S)
            refitter.join(_JOIN_S)
        self._raise()

    def wait_held(self, version: int) -> None:
        """Until the rollout side holds ``version`` (or a thread failed)."""
        with self._cv:
            while self._held < version and self._error is None:
                self._cv.wait(0.5)
        self._raise()

    def _take(self, step: int) -> dict:
        with self._cv:
            while step not in self._rollouts and self._error is None:
                self._cv.wait(0.5)
            self._raise()
            return self._rollouts.pop(step)

    def _metrics(self, ro: dict, idle: float, busy: float) -> dict[str, float]:
        rollout_busy = ro["phase_times"]["rollout"] + ro["phase_times"]["reward"]
        with self._cv:
            done, self._refit_stats = self._refit_stats, []
        out = {"async/max_weight_lag": float(self.k), "busy/trainer_s": busy, "busy/rollout_s": rollout_busy,
               "trainer_idle_fraction": idle / (idle + busy) if idle + busy > 0 else 0.0}
        if done:  # refits finished since the last record (off the trainer's path)
            out["busy/refit_s"] = sum(c + r for c, r, _ in done)
            out["calibrate_offpath_s"] = sum(c for c, _, _ in done)
            for _, _, m in done:
                for key, val in m.items():
                    out[key] = out.get(key, 0.0) + val
        return out

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _fail(self, exc: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = exc
            self._cv.notify_all()

    def _check(self) -> None:
        if self._stop:
            raise _Stopped
        self.check()

    # -- the rollout thread ---------------------------------------------------------------------------
    def _produce(self) -> None:
        try:
            for step in range(self.first, self.total):
                anchor = max(step - self.k, self.first)  # its samples may be as old as the version this step starts
                with self._cv:
                    while not self._stop and (anchor not in self._start_of or self._held < self._start_of[anchor]):
                        self._cv.wait(0.5)
                    if self._stop:
                        return
                    version = self._held
                if self.plan.max_gen_rounds > 1:  # each round graded before the next is drawn: all here
                    self._ready(rollout_phase(self.plan, self.b, step, version, self._check))
                else:  # graded on the reward thread while the next step generates
                    self._generated.put(generate_phase(self.plan, self.b, step, version, self._check))
        except _Stopped:
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread, which raises it
            self._fail(exc)

    def _ready(self, ro: dict) -> None:
        with self._cv:
            self._rollouts[ro["step"]] = ro
            self._cv.notify_all()

    # -- the reward thread ----------------------------------------------------------------------------
    def _grade(self) -> None:
        try:
            while (generated := self._generated.get()) is not None:
                self._ready(score_phase(self.plan, self.b, generated, self._check))
        except _Stopped:
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread
            self._fail(exc)

    # -- the refit thread -----------------------------------------------------------------------------
    def _refit(self) -> None:
        try:
            while (item := self._refits.get()) is not None:
                version, partial = item
                t = time.perf_counter()
                if partial is not None and self.plan.fp8_kv:
                    self.b.calibrate(version, partial["sequences"], **calibration_pictures(partial))
                calibrate_s, t = time.perf_counter() - t, time.perf_counter()
                metrics = self.b.await_refit(version)
                with self._cv:
                    self._held = version
                    self._refit_stats.append((calibrate_s, time.perf_counter() - t, metrics))
                    self._cv.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread
            self._fail(exc)
