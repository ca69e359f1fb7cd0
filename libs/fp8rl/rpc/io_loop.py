"""The one asyncio event loop of a process's gRPC servers, on its own daemon thread.

Every server :func:`fp8rl.rpc.server.build_server` makes is a ``grpc.aio`` server living on this loop,
however many a process runs (a service, the trainer's WeightStore, tests): gRPC's asyncio stack binds
its completion queue to the loops that use it, and one loop per process is the arrangement it is
built and tested for. The loop only moves bytes and runs the call gate (:mod:`fp8rl.rpc.guard`);
servicer code runs on worker threads, so nothing here ever blocks it.

Invariant: :func:`io_loop` returns the same running loop to every caller of the process; it is started
on first use and lives until the process exits (a daemon thread).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["io_loop", "run_on_loop"]

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def io_loop() -> asyncio.AbstractEventLoop:
    """The process's gRPC event loop, started on its thread the first time it is asked for."""
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop._fp8rl_thread = threading.current_thread()  # run_on_loop refuses to deadlock on it
                loop.call_soon(ready.set)
                loop.run_forever()

            threading.Thread(target=run, name="fp8rl-grpc-io", daemon=True).start()
            ready.wait()
            _loop = loop
        return _loop


def run_on_loop(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Runs ``coro`` on :func:`io_loop` from any other thread and returns its result (or raises its error)."""
    loop = io_loop()
    if threading.current_thread() is getattr(loop, "_fp8rl_thread", None):
        raise RuntimeError("run_on_loop called on the gRPC loop's own thread: await the coroutine instead")
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)
