"""Environment workers: each trajectory's environment lives in a bounded worker process (the stack's env steps).

The service stack never runs environment code in the controller: the reward service holds an
:class:`EnvWorkerPool` and serves ``EnvService`` over it (``services/reward/envs.py``). The pool:

* ``workers`` processes (``spawn``: safe beside gRPC's threads), each started with resource limits
  (:class:`Rlimits`: address space, open files, file size, no core dumps) set in the child before it imports
  anything of the user's, and importing ``modules`` (the user environments it may run, :func:`~.registry.allowed`).
* A trajectory is *placed* on the least loaded worker at :meth:`reset` and stays there (its environment object is
  that process's state) until :meth:`close`. A worker runs one request at a time; callers of the same worker
  queue on its lock, so at most ``workers`` environment calls run at once.
* Every call has a wall-clock bound. Past it the worker is SIGKILLed and replaced, and the call's trajectory ends
  ``timeout``; a worker that dies mid-call (a segfault, the memory limit, an ``os._exit`` in user code) ends its
  call's trajectory with ``error``. The *other* trajectories that lived on that worker are not lost: the pool
  keeps each open trajectory's task and the replies its steps got, and at its next step re-creates its
  environment on a live worker by replaying them (reset, then every earlier turn), checking that every reply comes
  back the same. An environment that answers its replay differently (not deterministic) is ``lost``, named so —
  never continued from a state its model turns did not see.
* Requests and replies cross the pipe as JSON, never pickles; a reply is checked (messages, a finite reward,
  JSON info) before anything is returned, and one larger than :data:`fp8rl.limits.MAX_ENV_TASK_BYTES` is an
  error. A worker exits when its parent does.

Results are :class:`EnvResult` values, never exceptions, except for the caller's own mistakes (an environment the
pool may not run, a duplicate or unknown id): ``ValueError`` / ``KeyError``.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import resource
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fp8rl import limits
from fp8rl.data.process_pool import watch_parent

__all__ = ["EnvResult", "EnvWorkerPool", "Rlimits"]

log = logging.getLogger(__name__)

STATUSES = ("ok", "error", "timeout", "lost")


@dataclass(frozen=True)
class Rlimits:
    """Resource limits of each environment worker (``setrlimit`` in the child; None: inherited).

    Attributes:
        memory_mb: address space (RLIMIT_AS); an allocation past it fails in the worker (MemoryError).
        open_files: file descriptors (RLIMIT_NOFILE).
        file_mb: largest file the worker may write (RLIMIT_FSIZE).
    """

    memory_mb: int | None = 4096
    open_files: int | None = 256
    file_mb: int | None = 64

    def apply(self) -> None:
        """Set the limits on the calling process (the worker, before it imports user code); never core dumps."""
        pairs = [(resource.RLIMIT_CORE, 0)]
        if self.memory_mb is not None:
            pairs.append((resource.RLIMIT_AS, self.memory_mb << 20))
        if self.open_files is not None:
            pairs.append((resource.RLIMIT_NOFILE, self.open_files))
        if self.file_mb is not None:
            pairs.append((resource.RLIMIT_FSIZE, self.file_mb << 20))
        for what, value in pairs:
            _, hard = resource.getrlimit(what)
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(what, (value, value))


@dataclass(frozen=True)
class EnvResult:
    """One environment call's outcome.

    Attributes:
        status: ``ok``; ``error`` (the environment raised or returned something malformed; ``error`` says what);
            ``timeout`` (past the bound: its worker was killed); ``lost`` (the environment is gone).
        messages: the opening messages (reset) or the step's new messages.
        reward, done, info: the step's (reset: None, False, {}).
        tools: the environment's tools (reset only).
    """

    status: str
    messages: list[dict] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    tools: list[dict] = field(default_factory=list)
    error: str = ""


# ------------------------------------------------------------------------------------------------ the worker
def _worker_main(conn, modules: Sequence[str], rlimits: Rlimits) -> None:  # runs in the child process
    rlimits.apply()
    import importlib

    from .base import EnvStep
    from .registry import make_env

    for name in modules:
        importlib.import_module(name)
    watch_parent()
    envs: dict[str, Any] = {}
    conn.send_bytes(b'{"ready": true}')
    while True:
        try:
            req = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        op, out = req.get("op"), {}
        try:
            if op == "reset":
                env = make_env(req["env"], **req["kwargs"])
                messages = env.reset(req["task"])
                envs[req["id"]] = env
                out = {"messages": messages, "tools": env.tools()}
            elif op == "step":
                env = envs.get(req["id"])
                if env is None:
                    out = {"status": "lost", "error": f"trajectory {req['id'][:80]!r} has no environment here"}
                else:
                    st = env.step(req["text"])
                    if not isinstance(st, EnvStep):
                        raise TypeError(f"env.step returned {type(st).__name__}, not an EnvStep")
                    out = {"messages": st.messages, "reward": st.reward, "done": st.done, "info": st.info}
            elif op == "close":
                out = {"closed": sum(envs.pop(i, None) is not None for i in req["ids"])}
            text = json.dumps({"status": "ok", **out} if "status" not in out else out, allow_nan=False)
        except BaseException as e:  # noqa: BLE001 - any failure of user code is this call's error, the worker lives
            text = json.dumps({"status": "error", "error": f"{type(e).__name__}: {e}"[:2000]})
        conn.send_bytes(text.encode())


class _Worker:
    def __init__(self, ctx, index: int, modules: Sequence[str], rlimits: Rlimits, start_timeout_s: float) -> None:
        self.index, self.lock = index, threading.Lock()
        self.ids: set[str] = set()  # trajectories whose environments live here
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, tuple(modules), rlimits), name="fp8rl-env",
                                daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(start_timeout_s):
            self.kill()
            raise RuntimeError(f"an environment worker did not start within {start_timeout_s:g} s")
        try:
            json.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            code = self.proc.exitcode
            self.kill()
            raise RuntimeError(f"an environment worker died while starting (exit code {code}); does every "
                               f"--env-module import?") from None

    def call(self, req: dict, timeout_s: float) -> dict | None:
        """The reply, or None past ``timeout_s``; raises EOFError / OSError when the worker died."""
        self.conn.send_bytes(json.dumps(req, allow_nan=False).encode())
        if not self.conn.poll(timeout_s):
            return None
        return json.loads(self.conn.recv_bytes())

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.join(5.0)
        finally:
            self.conn.close()


class EnvWorkerPool:
    """Trajectories' environments in ``workers`` bounded processes (see the module docstring).

    Args:
        workers: worker processes.
        modules: user modules each worker imports (their environments may then run by import path).
        rlimits: each worker's resource limits.
        timeout_s: default wall-clock bound of one call (a call may pass its own).
        max_open: most trajectories open at once (a reset beyond is ``ValueError``).
        eager: start the workers now; else at the first reset.
    """

    def __init__(self, workers: int = 2, *, modules: Sequence[str] = (), rlimits: Rlimits = Rlimits(),
                 timeout_s: float = 10.0, max_open: int = 65_536, start_timeout_s: float = 60.0,
                 eager: bool = True) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.modules, self.rlimits, self.timeout_s, self.max_open = tuple(modules), rlimits, timeout_s, max_open
        self._start_timeout_s = start_timeout_s
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._owner: dict[str, _Worker] = {}
        self._lost: dict[str, str] = {}  # id -> why its environment is gone (until closed)
        self._history: dict[str, _History] = {}  # id -> what replays its environment on another worker
        self._orphans: set[str] = set()  # ids whose worker was replaced: replayed at their next step
        self.counts = {"resets": 0, "steps": 0, "errors": 0, "timeouts": 0, "lost": 0, "restarts": 0, "replays": 0}
        self._width = workers
        self._workers: list[_Worker] = []  # started at the first reset (a service that never runs one holds none)
        if eager:
            self._start()

    def _start(self) -> None:
        """Start the workers (once; the caller holds ``_lock`` or is the constructor)."""
        if not self._workers:
            self._workers = [_Worker(self._ctx, i, self.modules, self.rlimits, self._start_timeout_s)
                             for i in range(self._width)]

    @property
    def open(self) -> int:
        """Trajectories open (on a worker, or waiting to be replayed onto one)."""
        with self._lock:
            return len(self._owner) + len(self._orphans)

    def _replace(self, w: _Worker, why: str, culprit: str) -> None:
        """Kill ``w`` (its lock held), start a fresh worker in its slot; its other trajectories are replayed at
        their next step (module docstring), the culprit's is gone."""
        w.kill()
        with self._lock:
            for i in w.ids:
                if i != culprit and self._owner.get(i) is w:
                    self._orphans.add(i)
                    self._lost[i] = why
                    del self._owner[i]
            self._owner.pop(culprit, None)
            self._history.pop(culprit, None)
            self.counts["restarts"] += 1
            fresh = _Worker(self._ctx, w.index, self.modules, self.rlimits, self._start_timeout_s)
            self._workers[w.index] = fresh
        log.warning("environment worker %d replaced: %s", w.index, why)

    def _call(self, w: _Worker, tid: str, req: dict, timeout_s: float | None) -> dict:
        bound = timeout_s or self.timeout_s
        with w.lock:
            if self._workers[w.index] is not w:  # replaced while this call waited: the caller replays it
                return {"status": "replaced"}
            try:
                reply = w.call(req, bound)
            except (EOFError, OSError, ValueError) as e:
                code = w.proc.exitcode
                self._replace(w, f"the environment worker died during trajectory {tid[:80]!r}'s {req['op']} "
                                 f"(exit code {code})", tid)
                return {"status": "error", "error": f"the environment worker died (exit code {code}; e.g. past its "
                                                    f"memory limit of {self.rlimits.memory_mb} MiB): {e}"}
            if reply is None:
                self._replace(w, f"trajectory {tid[:80]!r}'s {req['op']} ran past {bound:g} s", tid)
                return {"status": "timeout", "error": f"the environment's {req['op']} took longer than {bound:g} s; "
                                                      f"its worker was killed"}
            return reply

    def reset(self, tid: str, env: str, kwargs: dict, task: dict, timeout_s: float | None = None) -> EnvResult:
        """Create trajectory ``tid``'s environment (``env`` with ``kwargs``) on the least loaded worker and reset it
        with ``task``. Raises ValueError: ``tid`` is open already, or the pool is full."""
        with self._lock:
            if tid in self._owner or tid in self._orphans:
                raise ValueError(f"trajectory {tid[:80]!r} is open already")
            if len(self._owner) + len(self._orphans) >= self.max_open:
                raise ValueError(f"{len(self._owner)} trajectories are open; the limit is {self.max_open}")
            self._lost.pop(tid, None)
            self.counts["resets"] += 1
        w = self._place(tid)
        req = {"op": "reset", "id": tid, "env": env, "kwargs": kwargs, "task": task}
        reply = self._call(w, tid, req, timeout_s)
        out = self._result(reply, reset=True)
        if out.status != "ok":
            self._forget(tid)
        else:
            with self._lock:
                self._history[tid] = _History(req, _canonical(reply))
        return out

    def _place(self, tid: str) -> _Worker:
        """Put ``tid`` on the least loaded worker."""
        with self._lock:
            self._start()
            w = min(self._workers, key=lambda x: len(x.ids))
            w.ids.add(tid)
            self._owner[tid] = w
            return w

    def _replay(self, tid: str, timeout_s: float | None) -> EnvResult | None:
        """Re-create orphaned ``tid``'s environment on a live worker from its history; None when it is back, else
        the ``lost`` result saying why (the history is dropped)."""
        with self._lock:
            self._orphans.discard(tid)
            h, why = self._history.get(tid), self._lost.pop(tid, "")
        if h is None:
            return EnvResult("lost", error=f"trajectory {tid[:80]!r} has no environment: {why}")
        w = self._place(tid)
        self.counts["replays"] += 1
        for n, (req, want) in enumerate([(h.reset, h.reset_reply), *h.steps]):
            reply = self._call(w, tid, req, timeout_s)
            if _canonical(reply) != want:
                self._forget(tid)
                with self._lock:
                    self.counts["lost"] += 1
                what = "its reset" if n == 0 else f"step {n}"
                return EnvResult("lost", error=f"trajectory {tid[:80]!r}: {why}; replaying its environment on "
                                               f"another worker, {what} answered differently (the environment is "
                                               f"not deterministic), so it cannot go on")
        log.info("trajectory %s replayed (%d steps) after its worker was replaced", tid[:80], len(h.steps))
        return None

    def step(self, tid: str, text: str, timeout_s: float | None = None) -> EnvResult:
        """One step of trajectory ``tid``'s environment with the model's turn ``text``."""
        with self._lock:
            self.counts["steps"] += 1
            orphan = tid in self._orphans
            w = self._owner.get(tid)
            if w is None and not orphan:
                why = self._lost.get(tid, "it was never reset here (was the service restarted?) or it was closed")
                self.counts["lost"] += 1
                return EnvResult("lost", error=f"trajectory {tid[:80]!r} has no environment: {why}")
        req = {"op": "step", "id": tid, "text": text}
        for _ in range(2):  # a second time when its worker was replaced while this call waited for it
            if orphan:
                lost = self._replay(tid, timeout_s)
                if lost is not None:
                    return lost
                with self._lock:
                    w = self._owner[tid]
            reply = self._call(w, tid, req, timeout_s)
            if reply.get("status") != "replaced":
                break
            with self._lock:
                orphan = tid in self._orphans
        out = self._result(reply)
        with self._lock:
            h = self._history.get(tid)
            if out.status == "ok" and h is not None and not out.done:
                h.steps.append((req, _canonical(reply)))
        return out

    def close(self, ids: Sequence[str]) -> int:
        """Forget the environments of ``ids`` (ended trajectories); returns how many were open."""
        by_worker: dict[int, list[str]] = {}
        with self._lock:
            for tid in ids:
                self._lost.pop(tid, None)
                self._history.pop(tid, None)
                self._orphans.discard(tid)
                w = self._owner.pop(tid, None)
                if w is not None:
                    w.ids.discard(tid)
                    by_worker.setdefault(w.index, []).append(tid)
        closed = 0
        for index, tids in by_worker.items():
            w = self._workers[index]
            with w.lock:
                try:
                    reply = w.call({"op": "close", "ids": tids}, self.timeout_s)
                except (EOFError, OSError, ValueError):
                    reply = None
            closed += len(tids) if reply is None else int(reply.get("closed", 0))
        return closed

    def _forget(self, tid: str) -> None:
        with self._lock:
            self._history.pop(tid, None)
            w = self._owner.pop(tid, None)
            if w is not None:
                w.ids.discard(tid)

    def _result(self, reply: dict, *, reset: bool = False) -> EnvResult:
        """A worker's JSON reply as an :class:`EnvResult`, checked; counted."""
        status = reply.get("status")
        if status not in STATUSES:
            status, reply = "error", {"error": f"malformed reply from the environment worker: {str(reply)[:200]}"}
        if status == "ok":
            try:
                out = _checked(reply, reset)
            except (TypeError, ValueError) as e:
                status, reply = "error", {"error": f"the environment returned something malformed: {e}"}
            else:
                return out
        with self._lock:
            self.counts[{"error": "errors", "timeout": "timeouts", "lost": "lost"}[status]] += 1
        return EnvResult(status, error=str(reply.get("error", ""))[:2000])

    def close_all(self) -> None:
        """Stop every worker."""
        for w in self._workers:
            w.kill()


@dataclass
class _History:
    """What re-creates a trajectory's environment: its reset request and reply, then each step's."""

    reset: dict
    reset_reply: str
    steps: list[tuple[dict, str]] = field(default_factory=list)


def _canonical(reply: dict) -> str:
    return json.dumps(reply, sort_keys=True)


def _checked(reply: dict, reset: bool) -> EnvResult:
    """An ``ok`` reply as an :class:`EnvResult`; raises ValueError / TypeError when it is malformed."""
    from .base import EnvStep, check_message

    size = len(json.dumps(reply))
    if size > limits.MAX_ENV_TASK_BYTES:
        raise ValueError(f"its reply is {size} bytes of JSON; the limit is {limits.MAX_ENV_TASK_BYTES}")
    messages = reply.get("messages")
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        check_message(m, f"messages[{i}]")
    if reset:
        tools = reply.get("tools")
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise ValueError("tools must be a list of objects")
        return EnvResult("ok", messages=messages, tools=tools)
    st = EnvStep(messages, reply.get("reward"), bool(reply.get("done")), dict(reply.get("info") or {}))
    return EnvResult("ok", messages=st.messages, reward=st.reward, done=st.done, info=st.info)
