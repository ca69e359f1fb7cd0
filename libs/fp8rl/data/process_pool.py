"""Grading in worker processes: a pathological response can take at most one item's time bound.

:class:`GradingPool` (threads) cannot stop a grader that hangs: the thread is retired, and once enough
are stuck the pool runs short and fails items as ``"error"`` — a batch of correct answers then scores 0
unless its caller reads the statuses. :class:`ProcessGradingPool` is what the reward service runs:

* ``max_workers`` worker processes (``spawn``: safe beside gRPC's threads), each fed by one slot thread.
  A worker imports :mod:`fp8rl.data`, grades one warm-up item per built-in grader (so lazy imports —
  sympy behind ``math_verify`` — never eat an item's time bound), then imports ``modules`` (which may
  register more graders; import them in the parent too, where names are checked) before it takes work.
* An item's clock starts when its slot sends it to a ready worker. Past ``timeout_s`` the worker is
  SIGKILLed and the item completes as ``"timeout"``; the slot starts a fresh worker for the next item.
  A worker that dies mid-item completes it as ``"error"``. Nothing is ever left hung: the pool keeps
  its full width however many items time out.
* Requests and results cross the pipe as JSON (``[grader, response, answer]`` →
  ``[reward, status, detail]``), never pickles. A worker exits when its parent does.

Both pools answer :meth:`grade` with a task whose ``done`` event is set once ``result`` holds a
:class:`~fp8rl.data.scoring.GradeResult`; :func:`fp8rl.data.scoring.grade_many` runs on either.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Sequence

from .scoring import GradeResult, _Task

__all__ = ["ProcessGradingPool", "watch_parent"]

log = logging.getLogger(__name__)

_WARMUP = ("\\boxed{1}", "1")  # graded once by each registered grader before a worker takes work


def watch_parent() -> None:
    """In a worker process: exit as soon as the parent is gone. The pipe's EOF ends an idle worker; this ends one
    hung in user code (a grader, an environment)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def _worker_main(conn, modules: Sequence[str]) -> None:  # runs in the child process
    import importlib

    from fp8rl.data import GRADERS, get_grader
    from fp8rl.data.scoring import _run_grader

    for name in list(GRADERS):  # the built-in graders; a module's own may be slow on purpose
        _run_grader(get_grader(name), *_WARMUP)
    for name in modules:
        importlib.import_module(name)
    watch_parent()
    conn.send_bytes(b'"ready"')
    while True:
        try:
            name, response, answer = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            r = _run_grader(get_grader(name), response, answer)
        except ValueError as e:  # an unknown name: the parent checks names first, so only a registry mismatch
            r = GradeResult(0.0, "error", str(e))
        conn.send_bytes(json.dumps([r.reward, r.status, r.detail]).encode())


class _Worker:
    def __init__(self, ctx, modules: Sequence[str], start_timeout_s: float) -> None:
        self.lock = threading.Lock()
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, tuple(modules)), name="fp8rl-grader", daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(start_timeout_s):
            self.kill()
            raise RuntimeError(f"a grading worker did not start within {start_timeout_s:g} s")
        try:
            self.conn.recv_bytes()
        except (EOFError, OSError):
            self.kill()
            raise RuntimeError(f"a grading worker exited while starting (exit code {self.proc.exitcode})") from None

    def grade(self, name: str, response: str, answer: str, timeout_s: float) -> GradeResult | None:
        """The item's result, or None when it took longer than ``timeout_s`` (the caller kills the worker)."""
        try:
            self.conn.send_bytes(json.dumps([name, response, answer]).encode())
        except OSError:  # it died while idle
            self.proc.join(1.0)
            raise RuntimeError(f"the grading worker died (exit code {self.proc.exitcode})") from None
        if not self.conn.poll(timeout_s):
            return None
        try:
            reward, status, detail = json.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            self.proc.join(1.0)
            raise RuntimeError(f"the grading worker died mid-item (exit code {self.proc.exitcode})") from None
        return GradeResult(float(reward), status, detail)

    def kill(self) -> None:
        """Kills the process and closes the pipe (idempotent: a slot and ``close`` may both call it)."""
        with self.lock:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(5.0)
            if not self.conn.closed:
                self.conn.close()


class ProcessGradingPool:
    """``max_workers`` grading processes, each item bounded by its ``timeout_s`` (thread-safe).

    Args:
        max_workers: worker processes (and slot threads).
        modules: modules each worker imports before grading (to register more graders).
        start_timeout_s: how long a worker may take to start and warm up.
        eager: start every worker now (a service does, so its first batch does not wait for imports);
            else each on its slot's first item.

    Attributes:
        restarts: workers killed (an item timed out) or lost (one died) so far.
    """

    def __init__(self, max_workers: int = 2, *, modules: Sequence[str] = (), start_timeout_s: float = 120.0,
                 eager: bool = False) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers, self.modules, self.start_timeout_s = max_workers, tuple(modules), start_timeout_s
        self._ctx = multiprocessing.get_context("spawn")
        self._queue: queue.Queue[_Task | None] = queue.Queue()
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self.restarts = 0
        self.eager = eager
        self._slots = [threading.Thread(target=self._slot, name=f"fp8rl-grade-slot-{i}", daemon=True)
                       for i in range(max_workers)]
        for t in self._slots:
            t.start()

    def grade(self, name: str, response: str, answer: str, *, timeout_s: float) -> _Task:
        """Queues one item for the grader named ``name``; wait on the task's ``done``, then read ``result``."""
        task = _Task(None, (name, response, answer), timeout_s)
        self._queue.put(task)
        return task

    def _start(self) -> _Worker:
        w = _Worker(self._ctx, self.modules, self.start_timeout_s)
        with self._lock:
            self._workers.append(w)
        return w

    def _drop(self, w: _Worker) -> None:
        w.kill()
        with self._lock:
            if w in self._workers:
                self._workers.remove(w)
            self.restarts += 1

    def _slot(self) -> None:
        worker: _Worker | None = None
        if self.eager:
            try:
                worker = self._start()
            except RuntimeError as e:
                log.warning("%s; starting it again on the first item", e)
        while True:
            task = self._queue.get()
            if task is None:
                break
            if task.done.is_set():  # its batch was cancelled: nobody waits for it
                continue
            if worker is None:
                try:
                    worker = self._start()
                except RuntimeError as e:
                    task.finish(GradeResult(0.0, "error", str(e)))
                    continue
            try:
                result = worker.grade(*task.args, task.timeout_s)
            except RuntimeError as e:
                result = GradeResult(0.0, "error", str(e))
                self._drop(worker)
                worker = None
            if result is None:
                log.warning("grading took longer than %g s: killing its worker and starting another", task.timeout_s)
                result = GradeResult(0.0, "timeout", f"grading took longer than {task.timeout_s:g} s (worker killed)")
                self._drop(worker)
                worker = None
            task.finish(result)
        if worker is not None:
            worker.kill()

    def close(self) -> None:
        """Stops the slots and kills the workers (queued items are left unfinished)."""
        for _ in self._slots:
            self._queue.put(None)
        with self._lock:
            workers = list(self._workers)
        for w in workers:
            w.kill()

