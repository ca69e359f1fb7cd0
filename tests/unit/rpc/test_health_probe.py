"""fp8rl.rpc.health_probe against a real loopback gRPC server: the exit status follows grpc.health.v1."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from fp8rl.rpc import reward_pb2_grpc
from fp8rl.rpc.health_probe import EXIT_NOT_SERVING, EXIT_SERVING, EXIT_UNREACHABLE, check, main
from fp8rl.rpc.server import build_server, set_serving

TOKEN = "probe-test-token"


@pytest.fixture
def server(monkeypatch):
    for var in ("FP8RL_AUTH_TOKEN", "FP8RL_TLS_CERT", "FP8RL_TLS_KEY", "FP8RL_TLS_CA", "FP8RL_PORT"):
        monkeypatch.delenv(var, raising=False)
    srv, health, port = build_server([(reward_pb2_grpc.add_RewardServiceServicer_to_server,
                                       reward_pb2_grpc.RewardServiceServicer())], port=0, host="127.0.0.1",
                                     token=TOKEN)  # health must stay reachable without the token
    srv.start()
    yield health, port
    srv.stop(0)


def test_status_follows_health(server, capsys, tmp_path):
    health, port = server
    assert check(f"127.0.0.1:{port}")[0] == EXIT_NOT_SERVING  # servers start NOT_SERVING
    set_serving(health, True)
    assert main(["--port", str(port)]) == EXIT_SERVING
    assert "SERVING" in capsys.readouterr().out
    assert check(f"127.0.0.1:{port}", service="fp8rl.v1.RewardService")[0] == EXIT_SERVING
    # without a token the server answers its overall status and never reads the name; with one it reads it
    assert check(f"127.0.0.1:{port}", service="fp8rl.v1.NoSuchService")[0] == EXIT_SERVING
    code, line = check(f"127.0.0.1:{port}", service="fp8rl.v1.NoSuchService", token=TOKEN)
    assert code == EXIT_UNREACHABLE and "NOT_FOUND" in line
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    assert main(["--port", str(port), "--service", "fp8rl.v1.NoSuchService", "--token-file", str(token_file)]) \
        == EXIT_UNREACHABLE
    health.enter_graceful_shutdown()
    assert check(f"127.0.0.1:{port}")[0] == EXIT_NOT_SERVING


def test_unreachable_port_and_env_default(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connection refused
        monkeypatch.setenv("FP8RL_PORT", str(port))
        code, line = check(f"127.0.0.1:{port}", timeout_s=1.0)
        assert code == EXIT_UNREACHABLE and ("UNAVAILABLE" in line or "DEADLINE" in line)
        out = subprocess.run([sys.executable, "-m", "fp8rl.rpc.health_probe", "--timeout", "1"],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == EXIT_UNREACHABLE, out
    assert f"127.0.0.1:{port}" in out.stderr
