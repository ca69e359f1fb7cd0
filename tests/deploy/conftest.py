"""Deployment-file fixtures: the repository root, the five roles and the dev extra's tool binaries."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def default_ports() -> dict[str, int]:
    """Each role's default port, read from the services themselves (reward has its own flag parser)."""
    from services.calibrator.server import SPEC as calibrator
    from services.controller.server import SPEC as controller
    from services.rollout.server import SPEC as rollout
    from services.trainer.server import SPEC as trainer

    ports = {s.name: s.default_port for s in (controller, trainer, rollout, calibrator)}
    ports["reward"] = 50053  # services/reward/__main__.py --port default
    return ports


@pytest.fixture(scope="session")
def tool() -> Callable[[str], str]:
    """``tool(name)``: path of a binary a dev-extra wheel installs beside the interpreter (or on PATH)."""

    def find(name: str) -> str:
        here = Path(sys.executable).parent / name
        found = str(here) if here.exists() else shutil.which(name)
        if not found:
            pytest.fail(f"{name} not found beside {sys.executable} nor on PATH: run `make setup` (dev extra)",
                        pytrace=False)
        return found

    return find
