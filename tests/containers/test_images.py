"""Real images under podman (marker ``containers``, ``make test-containers``): built here from the Debian base,
run with host networking, probed over gRPC health, stopped with SIGTERM.

Skips with one line only where podman cannot run containers on this machine (not installed, no runtime).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from deploy import containers
from fp8rl.metrics import scrape

pytestmark = pytest.mark.containers

# A container whose PID 1 ignored SIGTERM waits out podman's stop timeout (10 s) and is then killed;
# one that handles it exits in well under that.
STOP_TIMEOUT_S = 10


@pytest.fixture(scope="module")
def podman_ok() -> str:
    try:
        return containers.check()
    except containers.PodmanUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def reward_image(podman_ok) -> str:
    containers.build_base()
    containers.build_images(["reward"])
    return containers.image_tag("reward")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _probe(port: int) -> int:
    """The host's view: one grpc.health.v1 check of 127.0.0.1:port (0 = SERVING)."""
    return subprocess.run([sys.executable, "-m", "fp8rl.rpc.health_probe", f"127.0.0.1:{port}"],
                          capture_output=True, text=True, timeout=30).returncode


def test_base_image_trusts_the_hosts_local_cas_and_has_python311(podman_ok):
    containers.build_base()
    p = containers.podman("run", "--rm", "--network", "host", containers.BASE_IMAGE, "sh", "-c",
                          "python3 -c 'import sys; print(sys.version_info[:2])'; "
                          "ls /usr/local/share/ca-certificates | wc -l", timeout=120)
    version, certs = p.stdout.split("\n")[:2]
    assert version == "(3, 11)"
    local = list(containers.LOCAL_CA_DIR.glob("**/*.crt")) if containers.LOCAL_CA_DIR.is_dir() else []
    assert int(certs) == len(local)


def test_reward_container_serves_health_and_metrics_runs_non_root_and_stops_on_sigterm(reward_image):
    port, metrics_port = _free_port(), _free_port()
    name = f"fp8rl-test-reward-{port}"
    job = containers.REPO / "deploy" / "smoke-job.yaml"
    containers.podman("run", "-d", "--name", name, "--network", "host", "-v", f"{job}:/etc/fp8rl/job.yaml:ro",
                      "-e", "FP8RL_CONFIG=/etc/fp8rl/job.yaml", "-e", f"FP8RL_PORT={port}",
                      "-e", f"FP8RL_METRICS_PORT={metrics_port}", reward_image,
                      "--port", str(port), "--host", "127.0.0.1", timeout=120)
    try:
        deadline = time.monotonic() + 120
        while _probe(port) != 0:
            state = containers.podman("inspect", name, "--format", "{{.State.Status}}").stdout.strip()
            assert state == "running", containers.podman("logs", name, check=False).stderr[-2000:]
            assert time.monotonic() < deadline, "the reward container never answered SERVING"
            time.sleep(1)
        # the image's own HEALTHCHECK (the same probe, run inside the container) agrees
        assert containers.podman("healthcheck", "run", name, check=False, timeout=60).returncode == 0
        uid = containers.podman("exec", name, "id", "-u").stdout.strip()
        assert uid == "10001"
        # /metrics from inside the image (prometheus-client installed): the health probes above were RPCs too
        got = scrape(metrics_port)
        probes = got.get(("fp8rl_rpc_requests_total", (("code", "OK"), ("method", "Health/Check"))), 0)
        assert probes >= 2, got
        t0 = time.monotonic()
        containers.podman("stop", "--time", str(STOP_TIMEOUT_S), name, timeout=60)
        took = time.monotonic() - t0
        code = containers.podman("inspect", name, "--format", "{{.State.ExitCode}}").stdout.strip()
        assert took < STOP_TIMEOUT_S / 2, f"stop took {took:.1f} s: SIGTERM was not handled (killed at the timeout)"
        assert code == "0", f"exit code {code} after SIGTERM (want a clean stop)"
    finally:
        containers.podman("rm", "-f", name, check=False)


# Run inside the reward image (where the env workers run): the same probes once in the sandbox and once as the
# service's own process, the negative control. Host networking: the test's listener is on the container's loopback.
_SANDBOX_PROBE = textwrap.dedent("""
    import json, os, socket, sys
    from fp8rl.envs.sandbox import Sandbox, SandboxLimits, proc_mountable, sandbox_problem
    port = int(sys.argv[1])
    connect = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')"
    token = "import os; print(os.environ.get('FP8RL_AUTH_TOKEN', 'absent'))"
    sb = Sandbox(SandboxLimits(wall_seconds=3))
    out = {"problem": sandbox_problem(), "proc": proc_mountable(), "uid": os.getuid()}
    r = sb.run("print(6 * 7)")
    out["answer"] = [r.stdout.strip(), r.exit_status]
    out["net"] = [sb.run(connect).stdout.strip(), None]
    out["token"] = [sb.run(token).stdout.strip(), None]
    out["sleep"] = sb.run("import time; time.sleep(60)").killed
    try:  # the control: the service itself reaches the listener and has the token
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        out["net"][1] = "connected"
    except OSError as e:
        out["net"][1] = repr(e)
    out["token"][1] = os.environ.get("FP8RL_AUTH_TOKEN", "absent")
    print(json.dumps(out))
""")


def test_the_reward_image_runs_model_code_in_its_sandbox(reward_image):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        p = containers.podman("run", "--rm", "--network", "host", "-e", "FP8RL_AUTH_TOKEN=s3cret",
                              "--entrypoint", "python", reward_image, "-c", _SANDBOX_PROBE, str(port),
                              check=False, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["problem"] is None and got["uid"] == 10001  # bubblewrap runs in the image, as its non-root user
    assert got["answer"] == ["42", 0]
    assert got["net"] == ["", "connected"]  # no network in the sandbox; the service itself connects
    assert got["token"] == ["absent", "s3cret"]  # the service's environment stays outside
    assert got["sleep"] == "timeout"
