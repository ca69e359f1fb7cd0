"""A user's agent run in the sandbox (:mod:`fp8rl.envs.sandbox`): how agent jobs run on the service stack.

On the stack an agent is user code running beside the services' tokens and files, so it runs where model-written
code runs — bubblewrap, an unprivileged uid, no network, rlimits, a wall clock (``agent.timeout_s``) — with three
read-only mounts more than a code sandbox: the service's ``site-packages`` (``openai``, ``httpx`` and the rest of
what the agent imports), the package directories of :mod:`fp8rl` and of the agent's own module, and the directory
of its :class:`~fp8rl.agents.proxy.AgentProxy` socket, its one way to the model. Inside, a small runner imports
``agent.entrypoint``, hands it the task and an ``openai.OpenAI`` whose transport is that socket, and prints what
it returned on a marked last line; the service reads it back from the sandbox's stdout (never a pickle).

The sandbox's interpreter is the system's ``/usr/bin/python3`` (under the read-only ``/usr``): the service's own
may live where the sandbox's uid cannot reach (``/root/.pyenv``), so the two must share a minor version for the
service's packages to load (:func:`sandbox_python_problem` says when they do not). What the sandbox does not
protect against is in :mod:`fp8rl.envs.sandbox`; the mounted package directories are readable by the agent.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import site
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from fp8rl.envs.sandbox import PYTHON, SandboxLimits, SandboxPool, SandboxUnavailable

from .proxy import SOCKET_NAME

__all__ = ["AgentRun", "RESULT_MARK", "SOCKET_DIR", "agent_limits", "agent_mounts", "run_sandboxed_agent",
           "sandbox_python_problem"]

SOCKET_DIR = "/run/fp8rl"  # where the proxy's socket directory is mounted inside the sandbox
RESULT_MARK = "@@fp8rl-agent-result@@ "

_RUNNER = r"""
import json, site, sys
P = json.loads(@PARAMS@)
before = list(sys.path)
for d in P["site_dirs"]:
    site.addsitedir(d)
sys.path[:] = [p for p in sys.path if p not in before] + P["paths"] + before

def out(obj):
    sys.stdout.write("\n" + P["mark"] + json.dumps(obj) + "\n")
    sys.stdout.flush()

try:
    import importlib
    import openai
    try:  # the HTTP package the openai client is built on (httpx2 since openai 3)
        import httpx2 as hx
    except ImportError:
        import httpx as hx
    module, _, name = P["entrypoint"].partition(":")
    fn = getattr(importlib.import_module(module), name)
    http = hx.Client(transport=hx.HTTPTransport(uds=P["socket"]), timeout=P["timeout_s"])
    client = openai.OpenAI(base_url="http://fp8rl-agent/v1", api_key="sandboxed", max_retries=0,
                           timeout=P["timeout_s"], http_client=http)
    value = fn(P["task"], client)
except BaseException as exc:
    out({"error": (type(exc).__name__ + ": " + str(exc))[:2000]})
    sys.exit(1)
if isinstance(value, bool) or not isinstance(value, (int, float, str)):
    out({"error": "an agent returns its reward (a number) or a text to grade, got " + type(value).__name__})
    sys.exit(1)
out({"value": value})
"""


@functools.cache
def sandbox_python_problem() -> str | None:
    """Why agents cannot run in the sandbox here (None: they can): the sandbox's interpreter is missing or is
    another minor version than this process's (whose ``site-packages`` it loads)."""
    want = f"{sys.version_info[0]}.{sys.version_info[1]}"
    try:
        got = subprocess.run([PYTHON, "-I", "-S", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"the sandbox's interpreter {PYTHON} cannot run: {exc}"
    if got != want:
        return (f"the sandbox runs agents with {PYTHON} (Python {got}) over this service's site-packages (Python "
                f"{want}): run the service on a Python {got} environment, or install Python {want} as {PYTHON}")
    return None


def _package_dirs(module: str) -> tuple[list[str], list[str]]:
    """Where ``module``'s top-level package lives: (directories or files to mount, import roots to put on
    ``sys.path``)."""
    top = module.split(".")[0]
    spec = importlib.util.find_spec(top)
    if spec is None:
        raise ValueError(f"module {top!r} cannot be found by this service")
    if spec.submodule_search_locations:
        places = [os.path.abspath(p) for p in spec.submodule_search_locations]
    elif spec.origin and os.path.isfile(spec.origin):
        places = [os.path.abspath(spec.origin)]
    else:
        raise ValueError(f"module {top!r} has no files to mount into the sandbox (built in?)")
    return places, sorted({os.path.dirname(p) for p in places})


@functools.cache  # a service's modules and packages do not move while it runs: looked up once per entrypoint
def agent_mounts(entrypoint: str) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...], tuple[str, ...]]:
    """What an agent of ``entrypoint`` needs mounted: ``(read-only binds, site dirs, import roots)``."""
    site_dirs = [p for p in site.getsitepackages() if os.path.isdir(p)]
    places, roots = _package_dirs(entrypoint.partition(":")[0])
    fp8rl_places, fp8rl_roots = _package_dirs("fp8rl")
    binds = tuple(dict.fromkeys((p, p) for p in [*site_dirs, *places, *fp8rl_places]))
    return binds, tuple(site_dirs), tuple(sorted({*roots, *fp8rl_roots}))


@dataclass(frozen=True)
class AgentRun:
    """How one sandboxed agent ended: ``value`` (its return: a reward or a text) when it returned, else
    ``end`` ``env_error`` / ``env_timeout`` with ``error`` naming why; ``stderr``'s tail for the log."""

    end: str
    value: float | str | None = None
    error: str = ""
    stderr: str = ""


def _no_constant(name: str):
    raise ValueError(f"{name} is not a finite number")


def agent_limits(timeout_s: float, memory_mb: int = 2048) -> SandboxLimits:
    """An agent's sandbox limits: ``timeout_s`` of wall clock and as much CPU, ``memory_mb`` of address space per
    process (an interpreter with ``openai`` imported maps a few hundred MB), 64 processes, 1 MiB of output."""
    return SandboxLimits(wall_seconds=timeout_s, cpu_seconds=max(1, int(timeout_s) + 1),
                         memory_bytes=memory_mb << 20, processes=64, output_bytes=1 << 20, tmp_bytes=64 << 20,
                         code_bytes=4 << 20)


def run_sandboxed_agent(pool: SandboxPool, entrypoint: str, task: dict[str, Any], socket_dir: str, *,
                        timeout_s: float, give, memory_mb: int = 2048) -> AgentRun:
    """Run ``entrypoint(task, client)`` in ``pool`` with the proxy socket of ``socket_dir`` (under
    :func:`agent_limits`); ``give(uid)`` hands the socket to the uid the sandbox runs as, before it starts
    (:meth:`AgentProxy.give_to <fp8rl.agents.proxy.AgentProxy.give_to>`). Never raises for the agent's own
    failures (they are the run's ``end``)."""
    binds, site_dirs, roots = agent_mounts(entrypoint)
    params = {"site_dirs": site_dirs, "paths": roots, "mark": RESULT_MARK, "entrypoint": entrypoint, "task": task,
              "socket": f"{SOCKET_DIR}/{SOCKET_NAME}", "timeout_s": timeout_s}
    code = _RUNNER.replace("@PARAMS@", repr(json.dumps(params)))
    try:
        r = pool.run(code, ro_binds=(*binds, (socket_dir, SOCKET_DIR)), limits=agent_limits(timeout_s, memory_mb),
                     before_start=give)
    except SandboxUnavailable as exc:
        return AgentRun("env_error", error=f"sandbox: {exc}")
    tail = r.stderr[-2000:]
    if r.killed == "timeout":
        return AgentRun("env_timeout", error=f"the agent ran past agent.timeout_s={timeout_s:g} (killed)", stderr=tail)
    if r.killed:
        return AgentRun("env_error", error=f"the sandbox killed the agent ({r.killed} limit)", stderr=tail)
    marked = [line for line in r.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if not marked:
        return AgentRun("env_error", error=f"the agent's sandbox exited {r.exit_status} without a result: "
                                           f"{tail[-300:]}", stderr=tail)
    try:
        out = json.loads(marked[-1][len(RESULT_MARK):], parse_constant=_no_constant)
    except ValueError as exc:
        return AgentRun("env_error", error=f"the agent's result is not readable: {exc}", stderr=tail)
    if "error" in out:
        return AgentRun("env_error", error=str(out["error"])[:2000], stderr=tail)
    value = out.get("value")
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return AgentRun("env_error", error="the agent's result is not a reward or a text", stderr=tail)
    return AgentRun("done", value=value, stderr=tail)
