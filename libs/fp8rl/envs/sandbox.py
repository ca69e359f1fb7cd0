"""A sandbox for model-written code: bubblewrap, an unprivileged uid, resource limits, a bounded pool.

:meth:`Sandbox.run` runs a Python program the model wrote and returns its stdout, stderr, exit status and, when the
sandbox killed it, why (:class:`SandboxResult`). Each run:

* **bubblewrap** (``bwrap``) with every namespace unshared: no network (a private network namespace with only a
  down loopback), a private PID namespace (its own ``/proc``, or none inside a container that masks the host's —
  :func:`proc_mountable`: no other process, ``/proc/*/environ`` included, is visible; when the program's first
  process ends, the kernel kills every process left in it), a read-only
  ``/usr`` as the whole root filesystem (``/bin``, ``/lib`` link into it; no ``/etc``, ``/home``, ``/root``, ``/run``,
  no service files, tokens or checkpoints), a private ``tmpfs`` work directory and ``/tmp`` (size-capped), an empty
  environment (``PATH`` only), every capability dropped, a new session (no terminal);
* as an **unprivileged uid** of its own (``uid_base + slot``; root ignores ``RLIMIT_NPROC``): the process-count
  limit counts only that slot's processes, so a fork bomb stops at ``processes`` (a service that does not run as
  root keeps its uid: the limit then counts its own processes too, and stops a bomb at ``processes`` more);
* **rlimits**: CPU seconds, address space (``memory_bytes``), file size (``output_bytes``: stdout and stderr are
  files, so endless output is cut by ``SIGXFSZ``), process count, no core files;
* a **wall clock**: past ``wall_seconds`` the whole process group is killed (``SIGKILL``), and the PID namespace
  takes every descendant with it.

What it does **not** protect against: kernel exploits (it shares the host kernel: bubblewrap is not a VM); reading
what ``/usr`` holds (installed software, world-readable by design); CPU and memory pressure up to the limits on
the host's other work; timing side channels. Run the services on machines whose ``/usr`` holds nothing secret.

:class:`SandboxPool` bounds the runs: at most ``slots`` at once, at most ``max_starting`` starting at once, and a
queue whose wait is bounded by ``queue_timeout_s`` (shorter than a trajectory's deadline, so a full pool fails a
call — :class:`SandboxUnavailable`, a recorded reason — instead of hanging scoring).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass

__all__ = ["KILL_REASONS", "Sandbox", "SandboxLimits", "SandboxPool", "SandboxResult", "SandboxUnavailable",
           "proc_mountable", "sandbox_problem"]

KILL_REASONS = ("timeout", "cpu", "memory", "output")
PYTHON = "/usr/bin/python3"  # the sandbox's interpreter: the system's, under the read-only /usr
# bubblewrap's PID namespace leaves one of its processes orphaned per run; where the host's PID 1 is slow to reap
# (a container's), those zombies pile up on the slot's uid and count against its process limit. So bwrap runs
# under this small reaper (a child subreaper: the orphans come back to it), which reaps every one and exits with
# bwrap's status (128 + n for a signal n). The reaper also sets the rlimits and drops to the slot's uid (argv[1],
# JSON) before it starts bwrap: the service forks it without running Python in the child (no ``preexec_fn``),
# which a multi-threaded parent — a gRPC server — cannot do safely.
_REAPER = """
import ctypes, json, os, resource, sys
lim = json.loads(sys.argv[1])
for name, value in lim["rlimits"].items():
    resource.setrlimit(getattr(resource, name), tuple(value))
if lim["uid"] is not None:
    os.setgroups([])
    os.setgid(lim["uid"])
    os.setuid(lim["uid"])
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    except OSError as e:
        os.write(2, f"bwrap: cannot run {sys.argv[2]}: {e}\\n".encode())
        os._exit(127)
code = 1
while True:
    try:
        p, status = os.wait()
    except ChildProcessError:
        break
    if p == pid:
        code = os.waitstatus_to_exitcode(status)
        code = 128 - code if code < 0 else code
sys.exit(code)
"""


class SandboxUnavailable(RuntimeError):
    """No sandbox ran the code: bubblewrap missing or refused, or the pool's queue deadline passed. The trajectory
    ends with this reason (ungraded, counted), never with a score."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use.

    Attributes:
        wall_seconds: wall-clock time before the process group is killed.
        cpu_seconds: CPU time (``RLIMIT_CPU``).
        memory_bytes: address space per process (``RLIMIT_AS``).
        processes: processes and threads of the slot's uid (``RLIMIT_NPROC``).
        output_bytes: stdout and stderr each, and any file written (``RLIMIT_FSIZE``).
        tmp_bytes: the work directory's and ``/tmp``'s tmpfs size each.
        code_bytes: the longest program accepted.
    """

    wall_seconds: float = 5.0
    cpu_seconds: int = 4
    memory_bytes: int = 512 * 2**20
    processes: int = 32
    output_bytes: int = 64 * 2**10
    tmp_bytes: int = 16 * 2**20
    code_bytes: int = 64 * 2**10

    def __post_init__(self) -> None:
        for name in ("wall_seconds", "cpu_seconds", "memory_bytes", "processes", "output_bytes", "tmp_bytes",
                     "code_bytes"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int | float) or not val > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {val!r}")


@dataclass(frozen=True)
class SandboxResult:
    """One run: ``exit_status`` (negative: killed by that signal), ``killed`` (None or one of
    :data:`KILL_REASONS`), ``truncated`` (an output stream hit ``output_bytes``), ``start_s`` (the wait for a
    slot and the start), ``wall_s`` (the program's own run)."""

    stdout: str
    stderr: str
    exit_status: int
    killed: str | None = None
    truncated: bool = False
    start_s: float = 0.0
    wall_s: float = 0.0

    def as_tool_result(self, max_chars: int = 2000) -> str:
        """The text a ``python`` tool call is answered with: exit status (and why it was killed), stdout, stderr."""
        head = f"exit status: {self.exit_status}" + (f" (killed: {self.killed})" if self.killed else "")
        parts = [head]
        if self.stdout:
            parts.append("stdout:\n" + self.stdout[:max_chars])
        if self.stderr:
            parts.append("stderr:\n" + self.stderr[-max_chars:])
        return "\n".join(parts)


_ROOT = ("--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
         "--symlink", "usr/bin", "/bin")
_proc_ok: list[bool] = []


def proc_mountable() -> bool:
    """Whether bubblewrap may mount the PID namespace's own ``/proc`` here (asked once per process).

    Inside a container whose runtime masks parts of ``/proc`` (podman's and Docker's defaults; Kubernetes'
    ``procMount: Default``) the kernel refuses a new ``proc`` mount to an unprivileged user namespace. The sandbox
    then has no ``/proc`` at all: it still runs in its own PID namespace, and sees less (programs that read
    ``/proc/self`` get ``FileNotFoundError``)."""
    if not _proc_ok:
        try:
            r = subprocess.run(["bwrap", "--unshare-all", "--die-with-parent", *_ROOT, "--proc", "/proc", PYTHON,
                                "-I", "-S", "-c", "pass"], capture_output=True, text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return True  # no bubblewrap to ask (not cached): the run says why it cannot start
        _proc_ok.append(r.returncode == 0 or "proc" not in r.stderr)  # another refusal is sandbox_problem()'s
    return _proc_ok[0]


def sandbox_problem() -> str | None:
    """Why no sandbox can run here (no ``bwrap``, no ``/usr/bin/python3``, or bubblewrap refused to start), or None."""
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed: apt-get install bubblewrap"
    if not os.path.exists(PYTHON):
        return f"{PYTHON} is missing (the sandbox runs the system's Python under a read-only /usr)"
    try:
        r = Sandbox(SandboxLimits(wall_seconds=10)).run("print('ok')")
    except SandboxUnavailable as e:
        return str(e)
    if r.stdout.strip() != "ok":
        return f"bubblewrap did not run a trivial program: exit {r.exit_status}, stderr {r.stderr[-300:]!r}"
    return None


class Sandbox:
    """Runs programs under bubblewrap with :class:`SandboxLimits` (module docstring), as uid ``uid``."""

    def __init__(self, limits: SandboxLimits | None = None, *, uid: int = 60000,
                 ro_binds: tuple[tuple[str, str], ...] = ()) -> None:
        self.limits = limits or SandboxLimits()
        self.uid = uid
        self.ro_binds = ro_binds  # (host path, sandbox path) pairs mounted read-only after the work directory

    def _argv(self, code: str) -> list[str]:
        size = str(self.limits.tmp_bytes)
        binds = [a for src, dest in self.ro_binds for a in ("--ro-bind", src, dest)]
        return ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                *_ROOT, *(["--proc", "/proc"] if proc_mountable() else []), "--dev", "/dev",
                "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/work", *binds, "--chdir", "/work",
                "--clearenv", "--setenv", "PATH", "/usr/bin", "--setenv", "HOME", "/work",
                PYTHON, "-I", "-B", "-c", code]

    def _command(self, code: str, procs: int) -> list[str]:
        """bwrap's argv under the reaper (:data:`_REAPER`), which first sets the rlimits — ``procs`` processes,
        CPU (``SIGXCPU``, then ``SIGKILL`` a second later), address space, file size, no core files — and, as root,
        drops to the slot's uid (root ignores ``RLIMIT_NPROC``)."""
        lim = self.limits
        cpu = int(lim.cpu_seconds)
        setup = {"uid": self.uid if os.geteuid() == 0 else None, "rlimits": {
            "RLIMIT_CPU": (cpu, cpu + 1), "RLIMIT_AS": (lim.memory_bytes, lim.memory_bytes),
            "RLIMIT_FSIZE": (lim.output_bytes, lim.output_bytes), "RLIMIT_NPROC": (procs, procs),
            "RLIMIT_CORE": (0, 0)}}
        return [PYTHON, "-I", "-S", "-B", "-c", _REAPER, json.dumps(setup), *self._argv(code)]

    def run(self, code: str, on_start=None) -> SandboxResult:
        """Run ``code`` (a Python program) and return what it printed and how it ended; ``on_start()`` is called
        once the sandbox's process exists (the pool's start cap ends there).

        Raises:
            ValueError: ``code`` is not a str or is longer than ``code_bytes``.
            SandboxUnavailable: bubblewrap is missing or could not start the program.
        """
        if not isinstance(code, str):
            raise ValueError(f"sandbox code must be a str, got {type(code).__name__}")
        if len(code.encode()) > self.limits.code_bytes or "\x00" in code:
            raise ValueError(f"sandbox code must be at most {self.limits.code_bytes} bytes without NUL")
        lim = self.limits
        # a service that is not root keeps its own uid (bubblewrap's user namespace still isolates the program): the
        # process limit then counts the uid's processes already running on top
        procs = lim.processes if os.geteuid() == 0 else lim.processes + _processes_of(os.geteuid())
        t0 = time.perf_counter()
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.Popen(self._command(code, procs), stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=err, cwd="/", env={"PATH": "/usr/bin:/bin"}, close_fds=True,
                                        start_new_session=True)
            except (OSError, subprocess.SubprocessError) as e:
                raise SandboxUnavailable(f"the sandbox could not start: {e}") from None
            finally:
                if on_start is not None:
                    on_start()
            killed = None
            try:
                status = proc.wait(timeout=lim.wall_seconds)
            except subprocess.TimeoutExpired:
                killed = "timeout"
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)  # bwrap and its namespace's init: the namespace dies
                status = proc.wait()
            wall = time.perf_counter() - t0
            stdout, stderr = _read(out, lim.output_bytes), _read(err, lim.output_bytes)
        truncated = len(stdout) >= lim.output_bytes or len(stderr) >= lim.output_bytes
        if stderr.startswith(b"bwrap:"):  # bubblewrap itself failed: nothing of the model's ran
            raise SandboxUnavailable(f"the sandbox could not start: {stderr.decode(errors='replace').strip()[:300]}")
        if killed is None:
            killed = _kill_reason(status, stderr, truncated)
        text = {"stdout": stdout.decode(errors="replace"), "stderr": stderr.decode(errors="replace")}
        return SandboxResult(text["stdout"], text["stderr"], _exit_status(status), killed, truncated, 0.0, wall)


def _processes_of(uid: int) -> int:
    """How many processes ``uid`` runs now (``/proc``)."""
    n = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                n += entry.stat().st_uid == uid
            except OSError:
                pass
    return n


def _read(f, limit: int) -> bytes:
    f.seek(0)
    return f.read(limit)


def _exit_status(status: int) -> int:
    """The program's exit status as Python reports it (a shell's 128 + n from bwrap's init is the signal -n)."""
    return -(status - 128) if 128 < status < 160 else status


def _kill_reason(status: int, stderr: bytes, truncated: bool) -> str | None:
    """Why the limits ended the program (the wall clock is the caller's): output at its cap, CPU time (SIGXCPU), an
    allocation refused; None when it ended by itself (or by a signal none of them sends)."""
    sig = -_exit_status(status)
    if truncated or sig == signal.SIGXFSZ:
        return "output"
    if sig == signal.SIGXCPU:
        return "cpu"
    if b"MemoryError" in stderr or b"Cannot allocate memory" in stderr:
        return "memory"
    return None


class SandboxPool:
    """A bounded set of sandbox slots (module docstring), shared by the threads of one process.

    Args:
        slots: runs at once; each slot runs as its own uid (``uid_base + slot``).
        max_starting: runs starting at once (the rest wait their turn in the queue).
        queue_timeout_s: the longest wait for a slot; past it :meth:`run` raises :class:`SandboxUnavailable`.
        limits: of every run.
        ro_binds: ``(host path, sandbox path)`` pairs mounted read-only into every run (an agent's interpreter
            packages, :mod:`fp8rl.agents.sandboxed`); none for model-written code.
    """

    def __init__(self, slots: int = 4, *, max_starting: int = 2, queue_timeout_s: float = 10.0,
                 limits: SandboxLimits | None = None, uid_base: int = 60000,
                 ro_binds: tuple[tuple[str, str], ...] = ()) -> None:
        if slots < 1 or max_starting < 1 or not queue_timeout_s > 0:
            raise ValueError(f"SandboxPool needs slots >= 1, max_starting >= 1 and queue_timeout_s > 0, got "
                             f"{slots}, {max_starting}, {queue_timeout_s}")
        self.limits = limits or SandboxLimits()
        self.queue_timeout_s = queue_timeout_s
        self._free = list(range(slots))
        self._cond = threading.Condition()
        self._starting = threading.BoundedSemaphore(max_starting)
        self._uid_base, self.ro_binds = uid_base, ro_binds
        self.stats = {"runs": 0, "unavailable": 0, "start_s_total": 0.0, "queue_s_max": 0.0,
                      **{f"killed/{r}": 0 for r in KILL_REASONS}}

    def run(self, code: str, ro_binds: tuple[tuple[str, str], ...] = (), limits: SandboxLimits | None = None,
            before_start=None) -> SandboxResult:
        """Run ``code`` in a free slot (waiting at most ``queue_timeout_s`` for one and for its start), with the
        pool's read-only mounts and ``ro_binds``, under ``limits`` (default: the pool's). ``before_start(uid)`` is
        called once the slot is taken, before the sandbox starts, with the uid the program will run as (None: the
        service's own, when it is not root) — e.g. to give that uid alone a resource mounted into the sandbox."""
        t0 = time.perf_counter()
        deadline = t0 + self.queue_timeout_s
        with self._cond:
            while not self._free:
                left = deadline - time.perf_counter()
                if left <= 0 or not self._cond.wait(left):
                    if not self._free:
                        self.stats["unavailable"] += 1
                        raise SandboxUnavailable(f"no sandbox slot free within {self.queue_timeout_s:.1f}s "
                                                 f"(pool of {self._uid_base}..: all busy)")
            slot = self._free.pop()
        try:
            if not self._starting.acquire(timeout=max(deadline - time.perf_counter(), 0.0)):
                self.stats["unavailable"] += 1
                raise SandboxUnavailable(f"no sandbox start within {self.queue_timeout_s:.1f}s")
            waited = time.perf_counter() - t0
            if before_start is not None:
                try:
                    before_start(self._uid_base + slot if os.geteuid() == 0 else None)
                except BaseException:
                    self._starting.release()
                    raise
            result = Sandbox(limits or self.limits, uid=self._uid_base + slot, ro_binds=self.ro_binds + ro_binds).run(
                code, on_start=self._starting.release)
        finally:
            with self._cond:
                self._free.append(slot)
                self._cond.notify()
        self.stats["runs"] += 1
        self.stats["start_s_total"] += waited
        self.stats["queue_s_max"] = max(self.stats["queue_s_max"], waited)
        if result.killed:
            self.stats[f"killed/{result.killed}"] += 1
        return SandboxResult(result.stdout, result.stderr, result.exit_status, result.killed, result.truncated,
                             waited, result.wall_s)
