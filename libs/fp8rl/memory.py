"""Process memory: resident set size now, at its peak, and per phase of a step.

A phase's peak is exact on Linux: the kernel keeps the process's high-water mark of resident memory
(``VmHWM`` in ``/proc/self/status``), and writing ``5`` to ``/proc/self/clear_refs`` resets it to the current
RSS (Linux >= 4.0). :class:`PhaseMemory` resets it when a phase opens and reads it when any phase opens or
closes, so every open phase (nested ones included: the trainer's ``logprobs`` inside the loop's ``train``) gets
the maximum over exactly the intervals it was open. Where ``clear_refs`` cannot be written (another OS, a locked
down container) the mark is never reset and a phase's value is the process's peak so far: an upper bound,
flagged by :attr:`PhaseMemory.exact`.

Phases on several threads at once (asynchronous GRPO: rollout beside training) share one process: each
phase's peak then includes what the other threads held meanwhile. The process peak stays exact.

What a step reports (the loop's ``metrics.jsonl``, the trainer service's step metrics, the report and
Prometheus): ``memory/peak_rss_gb/<phase>`` per phase that ran and ``memory/peak_rss_gb`` (their maximum), in
GB of 10**9 bytes.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import threading
from collections.abc import Iterator

__all__ = ["GB", "PhaseMemory", "available_bytes", "open_phases", "peak_rss_bytes", "peak_rss_bytes_of", "phase",
           "process_peak_bytes", "release_free_memory", "reset_peak", "rss_bytes", "saved_for_backward", "set_limit",
           "step_memory", "tune_allocator"]

GB = 10**9

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _status_kib(field: str, status: str = _STATUS) -> int | None:
    try:
        with open(status) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    """Resident memory of this process now (``VmRSS``; elsewhere the peak so far, an upper bound)."""
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else peak_rss_bytes()


def peak_rss_bytes() -> int:
    """Resident memory's high-water mark since the last :func:`reset_peak` (or since the process started)."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return ru if sys.platform == "darwin" else ru * 1024  # bytes on macOS, KiB on Linux


def peak_rss_bytes_of(pid: int) -> int | None:
    """Another process's resident-memory high-water mark (its ``VmHWM``), bytes; None where it cannot be read."""
    kib = _status_kib("VmHWM", f"/proc/{pid}/status")
    return kib * 1024 if kib is not None else None


def reset_peak() -> bool:
    """Reset the high-water mark to the current RSS; False where the OS does not allow it."""
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


_limit: list[int] = []  # set_limit's cap on this process's resident memory, bytes (empty: none)


def set_limit(limit_bytes: int | None) -> None:
    """Cap the memory this process may take at ``limit_bytes`` of resident memory (None: no cap of its own), for
    :func:`available_bytes` — a service sharing a machine with others gets its share (``--memory-limit-gb``)."""
    if limit_bytes is not None and limit_bytes <= 0:
        raise ValueError(f"a memory limit must be > 0 bytes, got {limit_bytes}")
    _limit[:] = [] if limit_bytes is None else [int(limit_bytes)]


def available_bytes() -> int | None:
    """Memory this process may still take: the kernel's ``MemAvailable``, capped by the cgroup's limit
    (``memory.max`` minus ``memory.current``, cgroup v2) when one is set and by :func:`set_limit`'s (the limit minus
    this process's RSS; negative once past it); None where none of them can be read."""
    avail = None
    if _limit:
        avail = _limit[0] - rss_bytes()
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    kernel = int(line.split()[1]) * 1024
                    avail = kernel if avail is None else min(avail, kernel)
                    break
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                room = int(limit) - int(f.read().strip())
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError):
        pass
    return avail


_libc: list = []  # glibc, once tune_allocator found it


def tune_allocator() -> bool:
    """Have this process give freed heap memory back to the kernel at every phase boundary and training
    micro-batch (:func:`release_free_memory`), so its resident memory follows what its tensors hold; call it once,
    early (``python -m fp8rl.loop`` and every service do). glibc keeps freed blocks below its mmap threshold (which
    rises with large frees, up to 32 MiB) in its heap, resident, and a step's tensors of other sizes cannot always
    reuse them: on a 630M model that held 2-4 GB more than the live tensors (bench/RESULTS.md). False (nothing
    changes) where the C library is not glibc; ``FP8RL_MALLOC_TUNING=0`` in the environment turns it off."""
    import ctypes
    import os

    if _libc:
        return _libc[0] is not None
    lib = None
    if os.environ.get("FP8RL_MALLOC_TUNING", "1") != "0" and sys.platform.startswith("linux"):
        try:
            lib = ctypes.CDLL("libc.so.6")
            lib.malloc_trim.argtypes, lib.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):
            lib = None
    _libc.append(lib)
    return lib is not None


def release_free_memory() -> None:
    """Return the heap's free pages to the kernel (glibc's ``malloc_trim``) after :func:`tune_allocator`; no-op
    otherwise. Costs a walk of the heap (milliseconds) and, later, a page fault per page reused."""
    if _libc and _libc[0] is not None:
        _libc[0].malloc_trim(0)


class PhaseMemory:
    """Peak RSS per named phase (see the module docstring); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: list[str] = []
        self._peaks: dict[str, int] = {}
        self._process = 0  # every fold's mark: the process's peak since the meter was made
        self.exact = True

    def _fold(self) -> None:
        """Give every open phase the high-water mark of the interval that ends now."""
        hwm = peak_rss_bytes()
        self._process = max(self._process, hwm)
        for name in self._open:
            self._peaks[name] = max(self._peaks.get(name, 0), hwm)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the block as phase ``name`` (a phase run twice in one step keeps its larger peak)."""
        with self._lock:
            self._fold()
            release_free_memory()  # the phase starts from what is held (after tune_allocator)
            self.exact = reset_peak() and self.exact
            self._open.append(name)
        try:
            yield
        finally:
            with self._lock:
                self._fold()
                self._open.remove(name)
                release_free_memory()

    @property
    def process_peak(self) -> int:
        """The process's peak RSS since the meter was made, in bytes: exact while the marks are reset only here
        (between phases, the next fold reads the mark that covers the gap)."""
        with self._lock:
            self._fold()
            return self._process

    def take(self) -> dict[str, int]:
        """The peaks measured since the last call (bytes per phase), forgotten here."""
        with self._lock:
            self._fold()  # phases still open keep their share so far (and go on measuring)
            out, self._peaks = self._peaks, {}
            for name in self._open:
                out.setdefault(name, 0)
            return {k: v for k, v in out.items() if v > 0}


_METER = PhaseMemory()


def phase(name: str) -> contextlib.AbstractContextManager[None]:
    """The process's meter measuring the block as phase ``name`` (:class:`PhaseMemory`)."""
    return _METER.phase(name)


@contextlib.contextmanager
def saved_for_backward(exclude=()) -> Iterator[dict[int, int]]:
    """Inside the block, the storages autograd saves for backward (``{data_ptr: bytes}``, each storage once), but
    those of the tensors in ``exclude`` (weights: held anyway). What the activations of a forward cost."""
    import torch

    skip = {t.untyped_storage().data_ptr() for t in exclude if t is not None}
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def open_phases() -> list[str]:
    """The phases of the process's meter open now, outermost first."""
    with _METER._lock:
        return list(_METER._open)


def process_peak_bytes() -> int:
    """The process's peak RSS (:attr:`PhaseMemory.process_peak` of the process's meter), in bytes."""
    return _METER.process_peak


def step_memory() -> dict[str, float]:
    """The step's memory metrics from the process's meter (peaks since the last call): ``memory/peak_rss_gb``
    and ``memory/peak_rss_gb/<phase>``, in GB; empty when no phase ran."""
    peaks = _METER.take()
    if not peaks:
        return {}
    out = {f"memory/peak_rss_gb/{k}": v / GB for k, v in sorted(peaks.items())}
    out["memory/peak_rss_gb"] = max(peaks.values()) / GB
    return out
