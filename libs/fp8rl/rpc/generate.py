"""Generate the gRPC stubs of ``proto/fp8rl/v1/*.proto`` into this package (``fp8rl.rpc``).

Usage::

    python -m fp8rl.rpc.generate           # (re)write the stubs; `make proto` runs this
    python -m fp8rl.rpc.generate --check   # exit 1, naming the stale files, if they are out of date

Layout: protoc runs with ``proto_path=proto`` so every file keeps its canonical name
(``fp8rl/v1/rollout.proto``) in the descriptor pool and in server reflection, but the stubs
are written *flat* into ``libs/fp8rl/rpc/``::

    from fp8rl.rpc import rollout_pb2, rollout_pb2_grpc

protoc emits cross-file imports as ``from fp8rl.v1 import common_pb2``; those lines (and only
those) are rewritten to ``from fp8rl.rpc import common_pb2``. The rewrite is a pure function of
protoc's output, so generating twice gives byte-identical files, which is what ``--check``
relies on: it regenerates into a temporary directory and compares file by file (changed,
missing, and leftover stubs whose proto was removed all count as stale).

``grpcio-tools`` (a dev dependency) is imported only here, never by the runtime stubs.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

__all__ = ["PROTO_ROOT", "RPC_DIR", "render", "write", "stale_files", "main"]

RPC_DIR = Path(__file__).resolve().parent
PROTO_ROOT = RPC_DIR.parents[2] / "proto"
PROTO_PACKAGE_DIR = Path("fp8rl") / "v1"  # where the .proto files sit under PROTO_ROOT
TARGET_PACKAGE = "fp8rl.rpc"

_STUB_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
_PROTOC_IMPORT = re.compile(r"^from fp8rl\.v1 import ", re.MULTILINE)
_LEFTOVER_IMPORT = re.compile(r"^\s*(from|import) fp8rl\.v1\b", re.MULTILINE)


def _is_stub(name: str) -> bool:
    return name.endswith(_STUB_SUFFIXES)


def _protoc(proto_root: Path, protos: list[Path], out: Path) -> None:
    """Runs the protoc bundled with grpcio-tools; raises RuntimeError if it fails."""
    try:
        from importlib.resources import files

        from grpc_tools import protoc
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("generating stubs needs grpcio-tools (pip install -e '.[dev]')") from e
    well_known = str(files("grpc_tools") / "_proto")  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        f"--proto_path={proto_root}",
        f"--proto_path={well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(str(p.relative_to(proto_root)) for p in protos),
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed (exit {code}) on {[p.name for p in protos]}; see its message above")


def _rewrite_imports(name: str, text: str) -> str:
    """``from fp8rl.v1 import X`` -> ``from fp8rl.rpc import X``; fails loudly on any other form."""
    text = _PROTOC_IMPORT.sub(f"from {TARGET_PACKAGE} import ", text)
    leftover = _LEFTOVER_IMPORT.search(text)
    if leftover:
        raise RuntimeError(f"{name}: protoc emitted an import this generator cannot rewrite: {leftover.group(0)!r}")
    return text


def render(proto_root: Path = PROTO_ROOT) -> dict[str, str]:
    """Generates every stub in memory.

    Args:
        proto_root: the ``proto_path`` root; the sources are ``proto_root/fp8rl/v1/*.proto``.

    Returns:
        ``{file name: text}`` for every ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py``, with
        imports already rewritten to ``fp8rl.rpc``. Deterministic for a given proto tree and
        grpcio-tools version.

    Raises:
        FileNotFoundError: no ``.proto`` file under ``proto_root/fp8rl/v1``.
        RuntimeError: protoc failed or emitted an import form that cannot be rewritten.
    """
    proto_root = Path(proto_root).resolve()
    protos = sorted((proto_root / PROTO_PACKAGE_DIR).glob("*.proto"))
    if not protos:
        raise FileNotFoundError(f"no .proto files under {proto_root / PROTO_PACKAGE_DIR}")
    with tempfile.TemporaryDirectory(prefix="fp8rl-protoc-") as tmp:
        _protoc(proto_root, protos, Path(tmp))
        produced = Path(tmp) / PROTO_PACKAGE_DIR
        return {
            p.name: _rewrite_imports(p.name, p.read_text(encoding="utf-8"))
            for p in sorted(produced.iterdir())
            if _is_stub(p.name)
        }


def write(stubs: dict[str, str], out_dir: Path = RPC_DIR) -> list[str]:
    """Writes ``stubs`` into ``out_dir`` and deletes leftover stubs no proto produces any more.

    Only files that changed are rewritten (so mtimes of unchanged stubs are kept).

    Returns:
        Names of the files written or deleted, sorted.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    touched = []
    for name, text in stubs.items():
        path = out_dir / name
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            touched.append(name)
    for path in out_dir.iterdir():
        if _is_stub(path.name) and path.name not in stubs:
            path.unlink()
            touched.append(path.name)
    return sorted(touched)


def stale_files(proto_root: Path = PROTO_ROOT, out_dir: Path = RPC_DIR) -> list[str]:
    """Names of the stubs in ``out_dir`` that differ from a fresh generation.

    A stub counts as stale when its text differs, when it is missing, or when it is a leftover
    that no proto produces any more. Nothing in ``out_dir`` is modified.

    Returns:
        Sorted file names; empty when ``out_dir`` is up to date.
    """
    fresh = render(proto_root)
    out_dir = Path(out_dir)
    on_disk = {p.name for p in out_dir.iterdir() if _is_stub(p.name)} if out_dir.is_dir() else set()
    stale = on_disk - fresh.keys()
    for name, text in fresh.items():
        path = out_dir / name
        if name not in on_disk or path.read_text(encoding="utf-8") != text:
            stale.add(name)
    return sorted(stale)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the process exit code (1 = stale stubs under ``--check``)."""
    parser = argparse.ArgumentParser(prog="python -m fp8rl.rpc.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 naming stale files")
    parser.add_argument("--proto-root", type=Path, default=PROTO_ROOT, help=f"proto_path root (default {PROTO_ROOT})")
    parser.add_argument("--out", type=Path, default=RPC_DIR, help=f"stub directory (default {RPC_DIR})")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files(args.proto_root, args.out)
        if stale:
            print(
                f"stale gRPC stubs in {args.out} (run `make proto` and commit the result):\n  " + "\n  ".join(stale),
                file=sys.stderr,
            )
            return 1
        print(f"gRPC stubs in {args.out} are up to date")
        return 0
    touched = write(render(args.proto_root), args.out)
    print(f"wrote {len(touched)} file(s) into {args.out}" + ("".join(f"\n  {n}" for n in touched)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
