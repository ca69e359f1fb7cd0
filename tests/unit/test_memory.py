"""fp8rl.memory: a phase's peak is the high-water mark of the intervals it was open, nested phases included."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fp8rl import memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not memory.reset_peak(),
                                reason="needs Linux's resettable VmHWM (/proc/self/clear_refs)")

MB = 1 << 20


def _touch(nbytes: int) -> torch.Tensor:
    """``nbytes`` resident (written, so the pages are really there)."""
    return torch.ones(nbytes // 4)


def test_a_phase_sees_its_own_allocation_and_a_later_phase_does_not():
    meter = memory.PhaseMemory()
    memory.release_free_memory()  # as a phase opening does once tune_allocator ran (here or in another test)
    base = memory.rss_bytes()
    with meter.phase("big"):
        t = _touch(256 * MB)
        del t
    with meter.phase("small"):
        s = _touch(8 * MB)
        del s
    peaks = meter.take()
    # the freed 256 MiB went back to the OS (glibc returns a large block at once), so "small" starts near base;
    # slack: what the interpreter itself allocates meanwhile, far under the 128 MiB margin
    assert peaks["big"] >= base + 256 * MB - 16 * MB
    assert peaks["small"] < base + 128 * MB
    assert meter.take() == {}  # taken: forgotten


def test_an_outer_phase_includes_what_an_inner_one_peaked_at():
    meter = memory.PhaseMemory()
    memory.release_free_memory()  # as a phase opening does once tune_allocator ran (here or in another test)
    base = memory.rss_bytes()
    with meter.phase("train"):
        with meter.phase("logprobs"):
            t = _touch(192 * MB)
            del t
        after = _touch(4 * MB)
        del after
    peaks = meter.take()
    assert peaks["logprobs"] >= base + 192 * MB - 16 * MB
    assert peaks["train"] >= peaks["logprobs"]
    assert meter.process_peak >= peaks["train"]


def test_step_memory_reports_gigabytes_per_phase_and_their_maximum():
    with memory.phase("rollout"):
        t = _touch(32 * MB)
        del t
    out = memory.step_memory()
    assert out["memory/peak_rss_gb"] == max(v for k, v in out.items() if k.startswith("memory/peak_rss_gb/"))
    assert out["memory/peak_rss_gb/rollout"] * memory.GB >= 32 * MB
    assert memory.step_memory() == {}


_FRAGMENT = """
import torch
from fp8rl import memory
tuned = memory.tune_allocator()
big = torch.ones(4 << 20); del big  # a 16 MiB free: glibc's default raises its mmap threshold to 16 MiB
before = memory.rss_bytes()
blocks = [torch.ones(1 << 19) for _ in range(200)]  # 200 x 2 MiB, from the heap now
keep = blocks.pop()  # the last one stays, above the others in the heap
del blocks  # the rest freed; under glibc's default they stay resident below the kept block
with memory.phase("next"):  # a phase boundary releases them (after tune_allocator)
    pass
print(tuned, (memory.rss_bytes() - before) / 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
def test_tuned_allocator_gives_freed_tensors_back_and_the_default_does_not():
    """199 of 200 tensors of 2 MiB freed (the last kept), then a phase boundary: with :func:`memory.tune_allocator`
    the process's RSS returns to within a few MiB of where it was; with glibc's defaults (``FP8RL_MALLOC_TUNING=0``,
    the control) the freed blocks stay resident — the retention the tuning exists to remove."""
    def grown(tuning: str) -> tuple[str, float]:
        env = {**os.environ, "FP8RL_MALLOC_TUNING": tuning}
        out = subprocess.run([sys.executable, "-c", _FRAGMENT], env=env, capture_output=True, text=True, check=True)
        flag, mib = out.stdout.split()
        return flag, float(mib)

    (on_flag, on), (off_flag, off) = grown("1"), grown("0")
    assert (on_flag, off_flag) == ("True", "False")
    assert on < 16, f"tuned: {on:.0f} MiB still resident after the frees"
    assert off > 200, f"control: glibc's default kept only {off:.0f} MiB (the test could not tell them apart)"


def test_another_processs_peak_is_read_from_its_status():
    """What bench/memory.py reads of each service: a child that touched 96 MiB and freed it still shows it as its
    peak; a pid that does not exist gives None."""
    code = "import sys, torch; t = torch.ones(24 << 20); del t; print('ready', flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert memory.peak_rss_bytes_of(child.pid) >= 96 * MB
    finally:
        child.communicate("", timeout=30)
    assert memory.peak_rss_bytes_of(child.pid) is None  # reaped: gone


def test_a_set_limit_caps_what_is_available_by_this_processs_own_rss():
    """``set_limit`` (a service's --memory-limit-gb): available = min(kernel's MemAvailable, limit - RSS now);
    past the limit it is negative; None lifts it; a limit <= 0 is refused."""
    free = memory.available_bytes()
    try:
        memory.set_limit(memory.rss_bytes() + (64 << 20))
        capped = memory.available_bytes()
        assert capped <= 64 << 20 and capped > 0 and (free is None or capped <= free)
        memory.set_limit(1)
        assert memory.available_bytes() < 0
    finally:
        memory.set_limit(None)
    again = memory.available_bytes()
    assert (again is None) == (free is None) and (free is None or again > 64 << 20)
    with pytest.raises(ValueError, match="must be > 0"):
        memory.set_limit(0)
