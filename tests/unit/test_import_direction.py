"""The dependency direction of the code base (docs/ARCHITECTURE.md), checked on every import statement.

fp8 ← rl, model ← engines ← presets ← controller / observatory / export ← loop; data and limits at the bottom;
refit never imports engines or services; rpc ← sdk, services; services never import each other except
``services.common``; nothing in ``libs`` imports ``services``. Lazy imports inside functions count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# top-level package group -> the groups it may import (itself always)
LIBS = {
    "fp8rl.limits": set(),
    "fp8rl.memory": set(),  # process memory: a leaf every role may measure with
    "fp8rl.redis_server": set(),  # a private redis-server's password and files: the launcher's and the benches'
    "fp8rl.metrics": {"fp8rl.memory"},
    "fp8rl.fp8": set(),
    "fp8rl.rl": {"fp8rl.fp8"},
    "fp8rl.model": {"fp8rl.fp8"},
    "fp8rl.data": {"fp8rl.limits"},
    "fp8rl.rpc": {"fp8rl.limits"},
    "fp8rl.envs": {"fp8rl.model", "fp8rl.data", "fp8rl.limits"},  # environments: text, a tokenizer, tasks
    "fp8rl.engines": {"fp8rl.fp8", "fp8rl.rl", "fp8rl.model", "fp8rl.data", "fp8rl.limits", "fp8rl.memory"},
    "fp8rl.refit": {"fp8rl.fp8", "fp8rl.rpc", "fp8rl.limits"},
    "fp8rl.presets": {"fp8rl.fp8", "fp8rl.model", "fp8rl.engines", "fp8rl.data", "fp8rl.envs"},
    "fp8rl.config": {"fp8rl.limits", "fp8rl.fp8", "fp8rl.rl", "fp8rl.data", "fp8rl.engines", "fp8rl.envs"},
    # export, eval: the local commands `fp8rl export` / `fp8rl eval`, imported when run
    "fp8rl.sdk": {"fp8rl.rpc", "fp8rl.config", "fp8rl.limits", "fp8rl.export", "fp8rl.eval"},
    "fp8rl.controller": {"fp8rl.config", "fp8rl.data", "fp8rl.envs", "fp8rl.model", "fp8rl.presets", "fp8rl.rl",
                         "fp8rl.refit", "fp8rl.rpc", "fp8rl.limits"},
    "fp8rl.observatory": {"fp8rl.engines", "fp8rl.fp8", "fp8rl.model", "fp8rl.rl", "fp8rl.presets", "fp8rl.data"},
    # the OpenAI-compatible endpoint: an engine's samples as OpenAI choices, messages rendered by envs' renderer
    "fp8rl.endpoint": {"fp8rl.engines", "fp8rl.envs", "fp8rl.model", "fp8rl.limits"},
    # users' agents: their endpoint sessions as trajectories; a job's agent section (its type only)
    "fp8rl.agents": {"fp8rl.endpoint", "fp8rl.envs", "fp8rl.config"},
    # reward models (judge, classifier) on the embedded engine, and how their scores mix with the rule grader's
    "fp8rl.rewards": {"fp8rl.config", "fp8rl.data", "fp8rl.engines", "fp8rl.fp8", "fp8rl.model", "fp8rl.presets",
                      "fp8rl.limits"},
    "fp8rl.loop": {"fp8rl.controller", "fp8rl.data", "fp8rl.engines", "fp8rl.envs", "fp8rl.fp8", "fp8rl.model",
                   "fp8rl.rewards", "fp8rl.presets", "fp8rl.rl", "fp8rl.report", "fp8rl.config", "fp8rl.limits",
                   "fp8rl.observatory", "fp8rl.export", "fp8rl.rundir", "fp8rl.loop_config", "fp8rl.endpoint",
                   "fp8rl.agents"},
    "fp8rl.loop_config": {"fp8rl.config", "fp8rl.data", "fp8rl.fp8"},  # the loop's job and flags
    "fp8rl.rundir": {"fp8rl.report"},  # the loop's run directory: rows and checkpoints as a run goes
    "fp8rl.report": {"fp8rl.limits"},
    "fp8rl.export": {"fp8rl.fp8", "fp8rl.model", "fp8rl.engines", "fp8rl.presets"},
    "fp8rl.eval": {"fp8rl.config", "fp8rl.controller", "fp8rl.data", "fp8rl.engines", "fp8rl.export", "fp8rl.fp8",
                   "fp8rl.model", "fp8rl.presets", "fp8rl.agents"},
}


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[0] == "libs":
        parts = parts[1:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str] | None = None) -> set[str]:
    """What ``path`` imports, anywhere in it (a deferred import inside a function is still a dependency). With
    ``modules`` (the repository's), only those, and ``from pkg import sub`` of a submodule counts as importing
    ``pkg.sub`` (not ``pkg``, which its own submodules are always imported under)."""
    mod = _module(path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            subs = {f"{base}.{a.name}" for a in node.names if modules and f"{base}.{a.name}" in modules}
            out.update(subs)
            if modules is None or len(subs) < len(node.names):  # names defined in the module itself
                out.add(base)
    return out if modules is None else {t for t in out if t in modules and t != mod}


def _group(name: str) -> str | None:
    p = name.split(".")
    if p[0] in ("fp8rl", "services"):
        return ".".join(p[:2]) if len(p) > 1 else p[0]
    return None


def _arrows() -> list[tuple[str, str, str]]:
    files = [*(REPO / "libs" / "fp8rl").rglob("*.py"), *(REPO / "services").rglob("*.py")]
    return [(_module(f), _group(_module(f)), _group(t)) for f in files for t in _imports(f)
            if _group(t) is not None and _group(t) != _group(_module(f))]


def forbidden(arrows: list[tuple[str, str, str]]) -> list[str]:
    bad = []
    for mod, src, dst in arrows:
        if src.startswith("services."):
            ok = dst == "services.common" or dst.startswith("fp8rl") or dst == "fp8rl"
        elif src in LIBS:
            ok = dst in LIBS[src] or dst == "fp8rl"  # "fp8rl" itself: `from fp8rl import limits`
        else:
            ok = False  # a new package: give it a row above
        if not ok:
            bad.append(f"{mod} ({src}) imports {dst}")
    return sorted(set(bad))


def test_no_import_against_the_dependency_direction():
    bad = forbidden(_arrows())
    assert not bad, "imports against the dependency direction:\n  " + "\n  ".join(bad)


def test_every_package_has_a_rule():
    groups = {src for _, src, _ in _arrows() if src.startswith("fp8rl")}
    assert groups <= set(LIBS) | {"fp8rl"}, sorted(groups - set(LIBS))


def test_the_scanner_catches_a_forbidden_arrow():
    arrows = [("fp8rl.refit.subscriber", "fp8rl.refit", "fp8rl.engines"),
              ("fp8rl.model.x", "fp8rl.model", "fp8rl.presets"),
              ("services.trainer.server", "services.trainer", "services.rollout"),
              ("fp8rl.data.x", "fp8rl.data", "services.common")]
    assert len(forbidden(arrows)) == 4
    assert forbidden([("services.trainer.server", "services.trainer", "services.common")]) == []


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_module_imports_itself_through_others():
    """No import circle between modules (the last three — presets smollm2/tiny_arith, refit publisher/transport,
    trainer ranks/server — were untied: a shared cache module, a transport-side protocol, the trainer's build)."""
    files = [*(REPO / "libs" / "fp8rl").rglob("*.py"), *(REPO / "services").rglob("*.py")]
    modules = {_module(f) for f in files}
    cycles = import_cycles({_module(f): _imports(f, modules) for f in files})
    assert not cycles, f"import circles: {cycles}"


def test_the_cycle_finder_finds_a_circle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
