"""One thread per service process runs its torch work.

Why: torch's CPU kernels run on OpenMP (libgomp). Every thread that starts a parallel region gets
its own team of worker threads, and the team outlives the region. Once a process has more
libgomp-managed threads than CPUs, libgomp stops spinning between regions: the workers sleep on a
futex after about 100 spins, and every region pays a wake-up. A service whose gRPC worker threads, refit
follower and main thread each had run torch ops had three teams on a 2-core box. Its trainer kept
about 157% of 200% busy during a train step, and the step was about 20% slower than the same step in
the in-process loop (`bench/overhead.py`). The same slowdown came back in-process when two idle
threads had each run one matmul first.

So a torch-heavy role (trainer, calibrator, the embedded rollout engine) builds its model and runs every
train step, logprob pass, generation, refit apply and checkpoint on one :class:`ComputeThread`.
Callers block on the result, so exceptions and their tracebacks propagate as if the call were inline.
Light tensor work (proto rows into a batch, a few thousand elements) stays on the calling thread.
Ops under torch's grain size (32768 elements) never start a parallel region.

Invariants:

- work runs in submission order, one item at a time;
- a call made *on* the compute thread runs inline, so nested calls cannot deadlock;
- a work item must never wait for a lock that its caller's thread could hold while waiting for
  this thread. Callers take service locks *before* they hand work over, and the work itself takes
  no service lock.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["ComputeThread", "OnComputeThread", "inline"]

T = TypeVar("T")


def inline(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """The runner of a role with no compute thread: the call, made here."""
    return fn(*args, **kwargs)


class ComputeThread:
    """A daemon thread that runs the callables handed to :meth:`call` one at a time, in order."""

    def __init__(self, name: str = "fp8rl-torch") -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._closed = False
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def call(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` run on the compute thread; blocks until it returns, re-raises what it raised."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        if self._closed:
            raise RuntimeError(f"the compute thread {self._thread.name} is closed (the service is stopping)")
        fut: Future = Future()
        self._queue.put((fut, fn, args, kwargs))
        return fut.result()

    def close(self, timeout: float = 5.0) -> None:
        """Run what is queued, then end the thread (its OpenMP team goes with it)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which re-raises it
                fut.set_exception(exc)


class OnComputeThread:
    """A refit target whose ``load_weights`` / ``load_scales`` run through ``run`` (a :class:`ComputeThread`).

    Everything else is the target's own attribute, read on the caller's thread (``weight_version``...).
    The refit subscriber fetches and verifies shards on its own thread and hands only the apply
    over: payload validation, quantization and the copy into the parameters.
    """

    _METHODS = ("load_weights", "load_scales")

    def __init__(self, target: Any, run: Callable[..., Any]) -> None:
        self._target, self._run = target, run

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if name in self._METHODS:
            run = self._run
            return lambda *args, **kwargs: run(attr, *args, **kwargs)
        return attr
