"""Fixtures shared by every tier."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
# Credentials a developer may have exported for a stack of their own (`deploy.launcher up` suggests
# FP8RL_TOKEN_FILE): tests choose their tokens themselves, so none of these may leak into them.
CREDENTIAL_VARIABLES = ("FP8RL_AUTH_TOKEN", "FP8RL_TOKEN_FILE", "FP8RL_SERVICE_TOKEN", "FP8RL_SERVICE_TOKEN_FILE",
                        "FP8RL_CLIENT_TOKEN", "FP8RL_CLIENT_TOKEN_FILE", "FP8RL_INSECURE")


def pytest_configure(config: pytest.Config) -> None:
    """Drop the caller's fp8rl credentials from the environment of the whole run (and of its children)."""
    for var in CREDENTIAL_VARIABLES:
        os.environ.pop(var, None)


def _cpu_kernels() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Refuse to run when ``ATEN_CPU_CAPABILITY`` asks for kernels torch did not take.

    A typo or a capability this CPU lacks would make the ISA-matrix tier (``make test-isa``) test the
    native kernels a second time and call that a pass.
    """
    wanted, held = os.environ.get("ATEN_CPU_CAPABILITY"), _cpu_kernels()
    if wanted and wanted.upper() != held.upper():
        raise pytest.UsageError(f"ATEN_CPU_CAPABILITY={wanted} but torch runs {held} kernels")


def pytest_report_header(config: pytest.Config) -> str:
    """Which CPU kernels this run uses: numerics differ between ISAs, so every log says which it had."""
    restrict = ", ".join(f"{k}={os.environ[k]}" for k in ISA_VARIABLES if k in os.environ) or "none"
    return f"cpu kernels: torch {_cpu_kernels()} (ISA restrictions: {restrict})"


@pytest.fixture(scope="session")
def self_signed_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(cert.pem, key.pem)``: a one-day EC certificate for ``localhost``, minted with the openssl CLI."""
    if shutil.which("openssl") is None:
        pytest.fail("TLS tests need the openssl CLI to mint a test certificate (apt-get install openssl)",
                    pytrace=False)
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="session")
def controller_stack():
    """``tests/integration/controller/conftest.py`` as a module — its stack helpers (``launcher``, ``Stack``,
    ``tiny_model``, ``tiny_job``) for tiers outside that directory (Megatron, real model)."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parent / "integration" / "controller" / "conftest.py"
    spec = importlib.util.spec_from_file_location("_controller_stack_helpers", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass (Stack) looks its module up while being defined
    spec.loader.exec_module(mod)
    return mod
