"""The compute thread of a service process (services.common.compute): order, errors, nesting, and one OpenMP team."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from fp8rl.config import JobConfig
from services.calibrator.server import SPEC as CALIBRATOR
from services.common.compute import ComputeThread, OnComputeThread, inline
from services.controller.server import SPEC as CONTROLLER
from services.reward.server import SPEC as REWARD
from services.rollout.server import SPEC as ROLLOUT
from services.trainer.server import SPEC as TRAINER


@pytest.fixture
def compute():
    c = ComputeThread("test-torch")
    yield c
    c.close()


def test_runs_on_its_thread_in_order(compute):
    seen, order = set(), []

    def work(i):
        seen.add(threading.current_thread().name)
        order.append(i)
        return i * i

    callers = [threading.Thread(target=lambda i=i: compute.call(work, i)) for i in range(8)]
    for t in callers:
        t.start()
        t.join()  # one at a time, so the submission order is known
    assert seen == {"test-torch"}
    assert order == list(range(8))
    assert compute.call(work, 3) == 9


def test_reraises_the_callers_exception(compute):
    class Boom(ValueError):
        pass

    def fail():
        raise Boom("bad batch")

    with pytest.raises(Boom, match="bad batch"):
        compute.call(fail)
    assert compute.call(lambda: 1) == 1  # the thread survives a failed item


def test_nested_call_runs_inline(compute):
    def outer():
        return compute.call(lambda: threading.current_thread().name)  # would deadlock if queued

    assert compute.call(outer) == "test-torch"


def test_closed_thread_refuses_work():
    c = ComputeThread("test-closed")
    c.close()
    assert not c.thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        c.call(lambda: 1)


def test_refit_target_proxy_hands_over_only_the_apply(compute):
    class Target:
        weight_version = 7

        def load_weights(self, version, tensors, scales=None):
            return threading.current_thread().name, version

        def load_scales(self, scales):
            return threading.current_thread().name

    proxy = OnComputeThread(Target(), compute.call)
    assert proxy.weight_version == 7
    assert proxy.load_weights(8, {}) == ("test-torch", 8)
    assert proxy.load_scales(None) == "test-torch"
    assert OnComputeThread(Target(), inline).load_scales(None) == threading.current_thread().name


def test_torch_roles_have_a_compute_thread():
    tiny_job = JobConfig()
    assert TRAINER.uses_compute_thread(tiny_job) and CALIBRATOR.uses_compute_thread(tiny_job)
    assert ROLLOUT.uses_compute_thread(tiny_job)  # the embedded torch engine
    vllm = tiny_job.with_settings({"policy.generation.backend": "vllm"})
    assert not ROLLOUT.uses_compute_thread(vllm)  # vLLM computes in its own processes
    assert not REWARD.uses_compute_thread(tiny_job) and not CONTROLLER.uses_compute_thread(tiny_job)


# Counts the threads of a fresh process after parallel torch ops issued from three long-lived threads
# (as gRPC workers are), either directly or through one ComputeThread. libgomp gives every thread that
# starts a parallel region its own team of (num_threads - 1) workers, kept while that thread lives.
_PROBE = textwrap.dedent("""
    import os, sys, threading, torch
    from services.common.compute import ComputeThread
    torch.set_num_threads(2)
    x = torch.ones(1 << 22)
    def nthreads():
        return len(os.listdir("/proc/self/task"))
    compute = ComputeThread("probe-torch") if sys.argv[1] == "compute" else None
    base = nthreads()
    hold, done = threading.Event(), []
    def caller():
        (compute.call if compute else (lambda f: f()))(lambda: (x + 1).sum())
        done.append(1)
        hold.wait()
    callers = [threading.Thread(target=caller) for _ in range(3)]
    for t in callers:
        t.start()
    while len(done) < 3:
        pass
    print(nthreads() - base - len(callers))
    hold.set()
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc/self/task")
def test_one_openmp_team_per_process():
    def extra_threads(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120,
                             check=True)
        return int(out.stdout.split()[-1])

    direct, through = extra_threads("direct"), extra_threads("compute")
    assert through == 1, f"through the compute thread: {through} OpenMP workers beyond the callers (want 1 team of 2)"
    assert direct == 3, f"direct calls from 3 threads: {direct} workers (want 3 teams of 2: what the fix avoids)"
