"""services/<role>/Dockerfile: hadolint-clean, non-root, health-checked, exposing the role's port."""

from __future__ import annotations

import re
import subprocess

import pytest

ROLES = ("controller", "trainer", "rollout", "reward", "calibrator")
GPU_ROLES = ("trainer", "rollout")


def _stages(text: str) -> dict[str, str]:
    """stage name → its instructions (text from its FROM to the next FROM)."""
    parts = re.split(r"^(?=FROM )", text, flags=re.M)
    out = {}
    for part in parts[1:]:
        m = re.match(r"FROM \S+ AS (\S+)", part)
        assert m, f"unnamed stage: {part.splitlines()[0]}"
        out[m.group(1)] = part
    return out


@pytest.mark.parametrize("role", ROLES)
def test_hadolint_passes(repo, tool, role):
    out = subprocess.run([tool("hadolint"), "--no-color", str(repo / "services" / role / "Dockerfile")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_rejects_a_bad_dockerfile(tmp_path, tool):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\n")
    out = subprocess.run([tool("hadolint"), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "DL3007" in out.stdout and "DL3013" in out.stdout, out.stdout


@pytest.mark.parametrize("role", ROLES)
def test_runtime_stages(repo, default_ports, role):
    text = (repo / "services" / role / "Dockerfile").read_text()
    stages = _stages(text)
    runtime = ["cpu", "gpu"] if role in GPU_ROLES else ["cpu"]
    # "wheels" is the empty stage a local torch wheel directory replaces (--build-context wheels=DIR)
    assert sorted(s for s in stages if not s.endswith("-build") and s not in ("uv", "wheels")) == runtime
    assert "FROM scratch AS wheels" in text and "from=wheels" in stages["cpu-build"]
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS cpu$", text, re.M), "the CPU image takes ARG BASE_IMAGE"
    assert list(stages)[-1] == "cpu", "the default target (last stage) is the CPU image"
    port = default_ports[role]
    for name in runtime:
        body = stages[name]
        assert "COPY --from=" in body, f"{name}: multi-stage, the runtime copies the built venv"
        assert re.search(r"^USER 10001:10001$", body, re.M), f"{name}: runs as uid 10001, not root"
        assert f"EXPOSE {port}\n" in body and f"FP8RL_PORT={port}" in body
        assert "PYTHONUNBUFFERED=1" in body
        assert re.search(r'^HEALTHCHECK .*CMD \["python", "-m", "fp8rl.rpc.health_probe"\]', body, re.M)
        assert f'ENTRYPOINT ["python", "-m", "services.{role}"]' in body
    for arg in re.findall(r"^ARG \w+_IMAGE=(\S+)$", text, re.M):  # every base pinned by tag, none floating
        assert ":" in arg and not arg.endswith(":latest"), arg
    if role in GPU_ROLES:
        assert "nvidia/cuda:" in text


def test_dockerignore_keeps_the_context_small(repo):
    text = (repo / ".dockerignore").read_text().splitlines()
    assert text[text.index("**") + 1:].count("!libs/") == 1 and "**/__pycache__" in text
