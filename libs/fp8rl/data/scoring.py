"""Scoring with a wall-clock bound: any registered grader, run on a bounded pool of daemon threads.

A grader (:mod:`.grading`) maps ``(response, answer)`` to a reward and never raises, but nothing
stops it from running for a long time: symbolic equivalence (sympy under ``math_verify``) can
hang on adversarial input, and its own ``signal.alarm`` timeouts only work in the main thread.
So the time bound lives here, outside the grader:

* Every item runs on a :class:`GradingPool` worker. Its clock starts when a worker picks it up
  (not when it is queued); once ``timeout_s`` has passed, a watchdog completes it as
  ``(0.0, "timeout")`` and the caller moves on — the batch waits no longer on that item.
* Python threads cannot be killed, so the worker stuck on a timed-out item is *retired*: it
  finishes (or hangs) on its own as a daemon thread, its late result is dropped, and a fresh
  worker takes its slot. At most ``max_stuck`` retired threads are tolerated; past that the
  pool stops replacing workers and, once no healthy worker is left, fails queued and new items
  fast with status ``"error"`` rather than letting callers wait forever.
* Workers are daemon threads so a hung grader never keeps the process from exiting on SIGTERM.

Statuses (:data:`STATUSES`): ``"ok"`` graded cleanly (right *or* wrong), ``"unparsable"`` the
response held no answer the grader could read (reward 0), ``"timeout"`` the bound above (reward
0), ``"error"`` the grader broke its contract (raised, or returned a value outside [0, 1]) or
the reference answer itself was unusable (reward 0).

Only ``"ok"`` and ``"unparsable"`` are *graded* (:data:`GRADED`, :func:`is_graded`): their reward
is the grader's verdict. A ``"timeout"`` or ``"error"`` item's 0.0 is a placeholder, not a reward —
whoever trains on rewards must retry it or drop the step, never learn from it (NeMo RL #3589).

The reward service runs :class:`fp8rl.data.process_pool.ProcessGradingPool` (a hung grader's process
is killed at its bound); the thread pool here is the in-process default.

Where the status comes from: a grader object with a ``grade(response, answer) -> GradeResult``
method (a :class:`DetailedGrader`, e.g. ``math_verify``) reports its own; for a plain grader,
a 0.0 reward on a response with neither a ``\\boxed{}`` nor any number counts as
``"unparsable"`` (the notion of "an answer" the rule graders share).
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from .grading import extract_boxed, extract_final_number, get_grader

__all__ = [
    "GradingCancelled",
    "DEFAULT_TIMEOUT_S",
    "STATUSES",
    "GRADED",
    "DetailedGrader",
    "GradeResult",
    "GradeStatus",
    "GradingPool",
    "default_pool",
    "grade_many",
    "grade_with_status",
    "is_graded",
]

GradeStatus = Literal["ok", "unparsable", "timeout", "error"]
STATUSES: tuple[str, ...] = ("ok", "unparsable", "timeout", "error")
GRADED: tuple[str, ...] = ("ok", "unparsable")  # statuses whose reward is a verdict; the others are placeholders
DEFAULT_TIMEOUT_S = 5.0  # same default as the job file's reward.timeout_s


@dataclass(frozen=True)
class GradeResult:
    """One graded item.

    Attributes:
        reward: in [0, 1]; always 0.0 unless ``status`` is ``"ok"``.
        status: one of :data:`STATUSES`.
        detail: a human-readable reason when ``status`` is not ``"ok"`` ("" otherwise).
    """

    reward: float
    status: GradeStatus
    detail: str = ""


def is_graded(status: str) -> bool:
    """Whether an item with this status was graded (its reward may be trained on)."""
    return status in GRADED


@runtime_checkable
class DetailedGrader(Protocol):
    """A grader that also says *why* it scored 0 (it is still a plain ``(response, answer) -> float``)."""

    def __call__(self, response: str, answer: str) -> float: ...

    def grade(self, response: str, answer: str) -> GradeResult: ...


def _has_answer(response: object) -> bool:
    if not isinstance(response, str):
        return False
    return extract_boxed(response) is not None or extract_final_number(response) is not None


def _run_grader(grader: Callable[[str, str], float], response: str, answer: str) -> GradeResult:
    """Runs one grader in the calling thread and turns whatever happens into a GradeResult."""
    try:
        if isinstance(grader, DetailedGrader):
            result = grader.grade(response, answer)
            if not isinstance(result, GradeResult):
                return GradeResult(0.0, "error", f"grade() returned {type(result).__name__}, not GradeResult")
            reward, status, detail = result.reward, result.status, result.detail
        else:
            reward, status, detail = grader(response, answer), "ok", ""
        reward = float(reward)
    except Exception as e:  # the grader contract says it never raises; when one does, the item scores 0
        return GradeResult(0.0, "error", f"grader raised {type(e).__name__}: {e}")
    if status not in STATUSES:
        return GradeResult(0.0, "error", f"grader reported unknown status {status!r}")
    if not (math.isfinite(reward) and 0.0 <= reward <= 1.0):
        return GradeResult(0.0, "error", f"grader returned {reward!r}, outside [0, 1]")
    if status != "ok":
        return GradeResult(0.0, status, detail or status)
    if reward == 0.0 and not isinstance(grader, DetailedGrader) and not _has_answer(response):
        return GradeResult(0.0, "unparsable", "no \\boxed{} answer or number in the response")
    return GradeResult(reward, "ok")


class _Task:
    """One item in flight. The first of (worker, watchdog, drain) to call ``finish`` wins."""

    __slots__ = ("fn", "args", "timeout_s", "result", "done", "worker")

    def __init__(self, fn: Callable[..., GradeResult], args: tuple, timeout_s: float):
        self.fn, self.args, self.timeout_s = fn, args, timeout_s
        self.result: GradeResult | None = None
        self.done = threading.Event()
        self.worker: _Worker | None = None  # set while a worker runs it

    def finish(self, result: GradeResult) -> bool:
        """Records ``result`` unless the task already has one; True when this call won."""
        if self.result is not None:
            return False
        self.result = result
        self.done.set()
        return True


class _Worker:
    __slots__ = ("retired", "thread")

    def __init__(self):
        self.retired = False
        self.thread: threading.Thread | None = None


class GradingPool:
    """A bounded pool of daemon grading threads with per-item wall-clock timeouts (thread-safe).

    Args:
        max_workers: healthy worker threads. Graders are mostly pure Python, so more threads
            add isolation (one slow item does not stall the others), not throughput.
        max_stuck: retired threads (still running a timed-out item) tolerated before the pool
            stops replacing workers.
    """

    def __init__(self, max_workers: int = 4, max_stuck: int = 32):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if max_stuck < 0:
            raise ValueError(f"max_stuck must be >= 0, got {max_stuck}")
        self.max_workers, self.max_stuck = max_workers, max_stuck
        self._lock = threading.Lock()  # guards everything below
        self._work_ready = threading.Condition(self._lock)  # workers wait here for a queued item
        self._watchdog_wake = threading.Condition(self._lock)  # a new deadline to watch
        self._queue: deque[_Task] = deque()
        self._healthy = 0
        self._stuck = 0
        self._deadlines: list[tuple[float, int, _Task]] = []  # heap of (deadline, seq, task) being run
        self._seq = itertools.count()
        self._names = itertools.count()
        with self._lock:
            for _ in range(max_workers):
                self._spawn_locked()
            threading.Thread(target=self._watchdog, name="fp8rl-grade-watchdog", daemon=True).start()

    @property
    def stuck(self) -> int:
        """Retired threads still running an item that timed out."""
        with self._lock:
            return self._stuck

    def grade(self, name: str, response: str, answer: str, *, timeout_s: float) -> _Task:
        """Queues one item for the grader named ``name`` (the same call as the process pool's)."""
        return self.submit(_run_grader, get_grader(name), response, answer, timeout_s=timeout_s)

    def submit(self, fn: Callable[..., GradeResult], *args, timeout_s: float) -> _Task:
        """Queues ``fn(*args)``; wait on the returned task's ``done`` event, then read ``result``."""
        task = _Task(fn, args, timeout_s)
        with self._lock:
            if self._healthy == 0:
                task.finish(self._saturated())
            else:
                self._queue.append(task)
                self._work_ready.notify()
        return task

    def _saturated(self) -> GradeResult:
        return GradeResult(0.0, "error", f"grading pool saturated: {self._stuck} graders hung past their timeout")

    def _spawn_locked(self) -> None:
        worker = _Worker()
        worker.thread = threading.Thread(
            target=self._work, args=(worker,), name=f"fp8rl-grade-{next(self._names)}", daemon=True
        )
        self._healthy += 1
        worker.thread.start()

    def _work(self, worker: _Worker) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    self._work_ready.wait()
                task = self._queue.popleft()
                if task.done.is_set():  # its batch was cancelled: nobody waits for it
                    continue
                task.worker = worker
                deadline = time.monotonic() + task.timeout_s
                heapq.heappush(self._deadlines, (deadline, next(self._seq), task))
                self._watchdog_wake.notify_all()
            try:
                result = task.fn(*task.args)
            except BaseException as e:  # _run_grader catches Exception; never leave a caller waiting forever
                result = GradeResult(0.0, "error", f"grading thread failed: {type(e).__name__}: {e}")
            with self._lock:
                task.finish(result)  # loses (result dropped) when the watchdog already timed it out
                task.worker = None
                if not worker.retired:
                    continue
                self._stuck -= 1
                if self._healthy >= self.max_workers:
                    return  # a replacement took this slot: the retired thread ends here
                worker.retired = False  # the pool ran short of workers: rejoin instead of ending
                self._healthy += 1

    def _watchdog(self) -> None:
        with self._lock:
            while True:
                now = time.monotonic()
                while self._deadlines and (self._deadlines[0][2].done.is_set() or self._deadlines[0][0] <= now):
                    _, _, task = heapq.heappop(self._deadlines)
                    if task.done.is_set():
                        continue
                    task.finish(GradeResult(0.0, "timeout", f"grading took longer than {task.timeout_s:g} s"))
                    self._retire_locked(task.worker)
                wait = self._deadlines[0][0] - now if self._deadlines else None
                self._watchdog_wake.wait(wait)

    def _retire_locked(self, worker: _Worker | None) -> None:
        if worker is None or worker.retired:
            return
        worker.retired = True
        self._healthy -= 1
        self._stuck += 1
        if self._stuck <= self.max_stuck:
            self._spawn_locked()
        elif self._healthy == 0:
            while self._queue:  # nobody is left to run these: fail them now instead of never
                self._queue.popleft().finish(self._saturated())


_DEFAULT_POOL: GradingPool | None = None
_DEFAULT_POOL_LOCK = threading.Lock()


def default_pool() -> GradingPool:
    """The process-wide pool (created on first use; ``$FP8RL_GRADING_WORKERS`` workers, default 4)."""
    global _DEFAULT_POOL
    with _DEFAULT_POOL_LOCK:
        if _DEFAULT_POOL is None:
            _DEFAULT_POOL = GradingPool(max_workers=int(os.environ.get("FP8RL_GRADING_WORKERS", "4")))
        return _DEFAULT_POOL


class GradingCancelled(RuntimeError):
    """:func:`grade_many` stopped because its caller is gone (``should_stop()`` turned True)."""


_CANCELLED = GradeResult(0.0, "error", "not graded: the caller cancelled the batch")
_POLL_S = 0.1  # how often a batch with a should_stop checks it while waiting


def grade_many(
    items: Iterable[tuple[str, str, str]],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    pool: GradingPool | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[GradeResult]:
    """Grades ``(grader_name, response, answer)`` items concurrently, each bounded by ``timeout_s``.

    Every grader name is resolved before any item runs, so an unknown name fails the whole batch
    up front. Each item's clock starts when a worker picks it up; a batch therefore takes about
    its grading work spread over the workers, plus at most ``timeout_s`` for a hung item.

    Args:
        items: ``(grader_name, response, answer)`` triples; names as in :func:`.grading.get_grader`.
        timeout_s: per-item wall-clock bound in seconds (> 0).
        pool: the pool to run on (a :class:`GradingPool` or a
            :class:`~fp8rl.data.process_pool.ProcessGradingPool`); None uses :func:`default_pool`.
        should_stop: polled while the batch waits (every 0.1 s); once True, every item not yet taken by a
            worker is dropped (no worker grades it) and :class:`GradingCancelled` is raised. Items already
            running finish within their own time bound. The reward service passes "the caller is gone".

    Returns:
        One :class:`GradeResult` per item, in order.

    Raises:
        ValueError: an unknown grader name (the message lists the known ones), or a bad timeout.
        GradingCancelled: ``should_stop()`` turned True before every item was graded.
    """
    if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
    items = list(items)
    for name in {name for name, _, _ in items}:
        get_grader(name)  # an unknown name fails the batch before anything runs
    if not items:
        return []
    pool = pool if pool is not None else default_pool()
    tasks = [pool.grade(name, response, answer, timeout_s=timeout_s) for name, response, answer in items]
    for task in tasks:
        # always set in the end: by the worker, the watchdog (timeout) or a saturated pool
        while not task.done.wait(None if should_stop is None else _POLL_S):
            if should_stop():
                for t in tasks:
                    t.finish(_CANCELLED)  # a worker skips a task that is already finished
                dropped = sum(t.result is _CANCELLED for t in tasks)
                raise GradingCancelled(f"grading stopped: the caller is gone ({dropped} of {len(tasks)} items were "
                                       f"not graded)")
    return [task.result for task in tasks]


def grade_with_status(
    grader_name: str, response: str, answer: str, timeout_s: float = DEFAULT_TIMEOUT_S, *,
    pool: GradingPool | None = None,
) -> tuple[float, GradeStatus]:
    """Grades one response with the grader named ``grader_name``, within ``timeout_s`` seconds.

    Never raises for anything the response or answer contain; see the module docstring for
    what each status means.

    Returns:
        ``(reward, status)``: reward in [0, 1] (0.0 unless status is ``"ok"``), status one of
        ``"ok"``, ``"unparsable"``, ``"timeout"``, ``"error"``.

    Raises:
        ValueError: unknown ``grader_name`` (a caller's mistake, not a bad response), or a bad
            ``timeout_s``.
    """
    (result,) = grade_many([(grader_name, response, answer)], timeout_s, pool=pool)
    return result.reward, result.status

