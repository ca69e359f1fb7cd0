"""Print fp8rl's runtime requirements from ``pyproject.toml``, one per line, leaving out the named ones.

Images use it so the pins live in one place (``[project].dependencies``): the CPU images install
them all, the GPU images leave out ``torch`` because vLLM / Transformer Engine bring the CUDA build
they were compiled against::

    python deploy/docker/requirements.py --exclude torch > /tmp/requirements.txt

``--exclude-from-env NAME`` leaves out the space-separated project names in the environment variable ``NAME`` too
(a Dockerfile ``ARG``: one build stage serves images that leave out different ones).

Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, exclude: set[str], extras: list[str]) -> list[str]:
    """The dependency strings of ``pyproject`` (plus ``extras``) whose project name is not in ``exclude``."""
    project = tomllib.loads(pyproject.read_text())["project"]
    deps = list(project["dependencies"])
    for extra in extras:
        try:
            deps += project["optional-dependencies"][extra]
        except KeyError:
            raise SystemExit(f"{pyproject}: no optional-dependencies extra {extra!r}") from None
    keep = []
    for dep in deps:
        name = re.split(r"[\s\[<>=!~;]", dep, maxsplit=1)[0].lower().replace("_", "-")
        if name not in exclude:
            keep.append(dep)
    return keep


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pyproject", type=Path, default=Path(__file__).resolve().parents[2] / "pyproject.toml")
    p.add_argument("--exclude", action="append", default=[], help="project name to leave out (repeatable)")
    p.add_argument("--exclude-from-env", metavar="NAME", help="environment variable of project names to leave out "
                   "(space-separated)")
    p.add_argument("--extra", action="append", default=[], help="optional-dependencies extra to add (repeatable)")
    args = p.parse_args(argv)
    names = args.exclude + (os.environ.get(args.exclude_from_env, "").split() if args.exclude_from_env else [])
    exclude = {e.lower().replace("_", "-") for e in names}
    print("\n".join(requirements(args.pyproject, exclude, args.extra)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
