"""fp8rl.memory: a phase's peak is the high-water mark of the intervals it was open, nested phases included."""

from __future__ import annotations

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
