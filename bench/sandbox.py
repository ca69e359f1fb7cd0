"""What the code sandbox costs per call (issue 50): start → result of a trivial program, sandboxed vs a plain
subprocess of the same interpreter, measured in one run.

    python bench/sandbox.py [--calls 200] [--concurrency 1 4]

For each concurrency, ``--calls`` runs of ``print(6*7)`` through a :class:`~fp8rl.envs.sandbox.SandboxPool` (slots =
concurrency) and the same number as plain ``subprocess.run([python3, -I, -c, ...])``; prints p50 / p99 of each call's
wall time and ``ratio sandbox_call/plain_call`` (p50 over p50).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from fp8rl.envs.sandbox import PYTHON, SandboxLimits, SandboxPool, sandbox_problem

PROGRAM = "print(6*7)"


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args(argv)
    problem = sandbox_problem()
    if problem:
        print(f"no sandbox here: {problem}")
        return 1
    for c in args.concurrency:
        pool = SandboxPool(c, max_starting=c, queue_timeout_s=60.0, limits=SandboxLimits())

        def sandboxed(pool=pool):
            r = pool.run(PROGRAM)
            assert r.stdout == "42\n", r

        def plain():
            r = subprocess.run([PYTHON, "-I", "-c", PROGRAM], capture_output=True, text=True)
            assert r.stdout == "42\n", r

        times = {}
        for name, fn in (("plain", plain), ("sandbox", sandboxed), ("plain2", plain)):
            with ThreadPoolExecutor(c) as ex:
                times[name] = list(ex.map(lambda _, f=fn: _timed(f), range(args.calls)))
        base = times["plain"] + times["plain2"]  # before and after: drift shows as a spread between them
        for name, xs in (("plain", base), ("sandbox", times["sandbox"])):
            print(f"concurrency {c} {name:8s} p50 {1e3 * statistics.median(xs):7.2f} ms  p99 "
                  f"{1e3 * _pct(xs, 0.99):7.2f} ms  ({len(xs)} calls)")
        print(f"ratio sandbox_call/plain_call concurrency={c} "
              f"{statistics.median(times['sandbox']) / statistics.median(base):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
