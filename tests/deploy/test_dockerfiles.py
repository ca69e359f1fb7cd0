"""deploy/docker/fp8rl.Dockerfile, every role's image: hadolint-clean; one shared build and runtime stage per variant
(CPU, GPU), each role a short target on top — non-root, health-checked, exposing the role's port."""

from __future__ import annotations

import re
import subprocess

import pytest

ROLES = ("controller", "trainer", "rollout", "reward", "calibrator")
GPU_ROLES = ("trainer", "rollout")
ROLE_TARGET_LINES = 8  # a role's target adds its port, health timing and entry point: a few lines, never a build


def _stages(text: str) -> dict[str, str]:
    """stage name → its instructions (text from its FROM to the next FROM)."""
    parts = re.split(r"^(?=FROM )", text, flags=re.M)
    out = {}
    for part in parts[1:]:
        m = re.match(r"FROM \S+ AS (\S+)", part)
        assert m, f"unnamed stage: {part.splitlines()[0]}"
        out[m.group(1)] = part
    return out


def _parent(stage: str) -> str:
    return re.match(r"FROM (\S+)", stage).group(1)


def _dockerfile(repo):
    return repo / "deploy" / "docker" / "fp8rl.Dockerfile"


def test_hadolint_passes(repo, tool):
    out = subprocess.run([tool("hadolint"), "--no-color", str(_dockerfile(repo))], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_rejects_a_bad_dockerfile(tmp_path, tool):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\n")
    out = subprocess.run([tool("hadolint"), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "DL3007" in out.stdout and "DL3013" in out.stdout, out.stdout


def test_no_role_keeps_a_dockerfile_of_its_own(repo):
    assert not list((repo / "services").glob("*/Dockerfile"))


def test_one_build_per_variant_and_every_role_a_short_target_on_it(repo):
    text = _dockerfile(repo).read_text()
    stages = _stages(text)
    assert [s for s in stages if s.endswith("-build")] == ["gpu-build", "cpu-build"]
    assert "FROM scratch AS wheels" in text and "from=wheels" in stages["cpu-build"]
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS cpu-runtime$", text, re.M), "the CPU image takes ARG BASE_IMAGE"
    assert list(stages)[-1] in ROLES, "the default target (last stage) is a CPU role's image"
    for runtime, build in (("cpu-runtime", "cpu-build"), ("gpu-runtime", "gpu-build")):
        body = stages[runtime]
        assert f"COPY --from={build} /opt/venv /opt/venv" in body, f"{runtime}: multi-stage, copies the built venv"
        assert re.search(r"^USER 10001:10001$", body, re.M), f"{runtime}: runs as uid 10001, not root"
        assert "PYTHONUNBUFFERED=1" in body
        assert re.search(r'^HEALTHCHECK .*CMD \["python", "-m", "fp8rl.rpc.health_probe"\]', body, re.M)
    targets = {**{r: "cpu-runtime" for r in ROLES}, **{f"{r}-gpu": "gpu-runtime" for r in GPU_ROLES}}
    assert sorted(s for s in stages if s not in ("uv", "wheels") and not s.endswith(("-build", "-runtime"))) == \
        sorted(targets)
    for target, parent in targets.items():
        body = stages[target]
        assert _parent(body) == parent, target
        assert len([ln for ln in body.splitlines() if ln.strip() and not ln.startswith("#")]) <= ROLE_TARGET_LINES
        assert "COPY" not in body and "pip install" not in body, f"{target}: nothing built per role"
    for arg in re.findall(r"^ARG \w+_IMAGE=(\S+)$", text, re.M):  # every base pinned by tag, none floating
        assert ":" in arg and not arg.endswith(":latest"), arg
    assert "nvidia/cuda:" in text


@pytest.mark.parametrize("role", ROLES)
def test_each_role_target_runs_its_service_on_its_port(repo, default_ports, role):
    stages = _stages(_dockerfile(repo).read_text())
    port = default_ports[role]
    for target in [role] + ([f"{role}-gpu"] if role in GPU_ROLES else []):
        body = stages[target]
        assert f"EXPOSE {port}\n" in body and f"FP8RL_PORT={port}" in body, target
        assert f'ENTRYPOINT ["python", "-m", "services.{role}"]' in body, target


def test_a_gpu_target_built_with_the_other_engine_refuses(repo):
    stages = _stages(_dockerfile(repo).read_text())
    assert 'import vllm" || { echo "rollout-gpu needs --build-arg GPU_ENGINE=vllm"' in stages["rollout-gpu"]
    assert 'import megatron.core" || { echo "trainer-gpu needs --build-arg GPU_ENGINE=megatron"' in \
        stages["trainer-gpu"]


def test_dockerignore_keeps_the_context_small(repo):
    text = (repo / ".dockerignore").read_text().splitlines()
    assert text[text.index("**") + 1:].count("!libs/") == 1 and "**/__pycache__" in text
