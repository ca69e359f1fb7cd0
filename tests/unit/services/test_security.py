"""services.common.security: which token each scope gets, and the refusal to listen openly off loopback."""

from __future__ import annotations

import argparse
import os

import pytest

from fp8rl.rpc import channel
from fp8rl.rpc.server import SCOPE_CLIENT, SCOPE_SERVICE
from services.common import security

VARS = ("FP8RL_AUTH_TOKEN", "FP8RL_TOKEN_FILE", "FP8RL_TLS_CA", "FP8RL_INSECURE", *security.SECURITY_ENV.values())


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    """Unset every variable ``apply_security_args`` reads or writes, and restore each afterwards: set-then-delete
    makes monkeypatch record the original state, so what the code under test exports (it writes ``os.environ``
    directly) never leaks into later tests or the services they start."""
    for var in VARS:
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    monkeypatch.setattr(channel, "_process_token", channel._UNSET)  # what apply_security_args sets, restored after


def _args(*argv: str, host: str = "127.0.0.1") -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default=host)
    security.add_security_args(p)
    return p.parse_args(list(argv))


def _file(tmp_path, name: str, token: str) -> str:
    path = tmp_path / name
    path.write_text(token + "\n")
    return str(path)


def test_flags_files_and_environment(tmp_path, monkeypatch):
    assert security.resolve_tokens(_args()) == security.ScopedTokens()
    t = security.resolve_tokens(_args("--service-token-file", _file(tmp_path, "s", "S1"), "--token", "C1"))
    assert (t.service, t.client) == ("S1", "C1")  # --token is the client token's old name
    monkeypatch.setenv("FP8RL_AUTH_TOKEN", "C-legacy")
    monkeypatch.setenv("FP8RL_SERVICE_TOKEN_FILE", _file(tmp_path, "s2", "S2"))
    t = security.resolve_tokens(_args())
    assert (t.service, t.client) == ("S2", "C-legacy")
    monkeypatch.setenv("FP8RL_CLIENT_TOKEN", "C2")
    assert security.resolve_tokens(_args()).client == "C2"  # the scoped variable before the legacy one
    assert security.resolve_tokens(_args("--client-token-file", _file(tmp_path, "c", "C3"))).client == "C3"


def test_conflicts_are_refused(tmp_path):
    with pytest.raises(ValueError, match="--service-token and --service-token-file both given"):
        security.resolve_tokens(_args("--service-token", "a", "--service-token-file", _file(tmp_path, "s", "b")))
    with pytest.raises(ValueError, match="are equal"):
        security.resolve_tokens(_args("--service-token", "same", "--client-token", "same"))
    with pytest.raises(FileNotFoundError, match="--client-token-file"):
        security.resolve_tokens(_args("--client-token-file", str(tmp_path / "missing")))


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.3.0.1", True), ("localhost", True), ("[::1]", True), ("::1", True),
    ("[::]", False), ("0.0.0.0", False), ("", False), ("10.1.2.3", False), ("trainer", False)])
def test_loopback_hosts(host, loopback):
    assert security.is_loopback_host(host) is loopback


def test_an_open_scope_off_loopback_refuses_to_start_unless_insecure(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"refusing to listen on '\[::\]'.*without the service token") as err:
        security.apply_security_args(_args(host="[::]"))
    assert "--service-token-file" in str(err.value) and "--insecure" in str(err.value)
    with pytest.raises(ValueError, match="without the client token"):  # the controller serves the client scope
        security.apply_security_args(_args("--service-token", "s", host="[::]"), (SCOPE_CLIENT,))
    assert security.apply_security_args(_args("--service-token", "s", host="[::]")).service == "s"
    assert security.apply_security_args(_args("--insecure", host="0.0.0.0")).service is None
    monkeypatch.setenv("FP8RL_INSECURE", "1")
    assert security.apply_security_args(_args(host="0.0.0.0"), (SCOPE_SERVICE, SCOPE_CLIENT)).client is None
    assert security.apply_security_args(_args(host="127.0.0.1")).service is None  # loopback: allowed, warned


def test_the_service_token_becomes_the_outgoing_one(monkeypatch, tmp_path):
    monkeypatch.setenv("FP8RL_AUTH_TOKEN", "client-token-of-a-user")
    monkeypatch.setenv("FP8RL_TOKEN_FILE", _file(tmp_path, "c", "client-from-file"))
    args = _args("--service-token", "S", "--tls-ca", "/ca.pem")
    monkeypatch.setenv("FP8RL_SERVICE_TOKEN_FILE", _file(tmp_path, "s", "unused-because-the-flag-wins"))
    security.apply_security_args(args)
    assert args.tokens.service == "S"
    assert channel.resolve_token() == "S"  # what this process's channels send
    # no token variable is left for the processes a service starts (grading workers parse untrusted output)
    assert not [v for v in security.SECRET_ENV if v in os.environ]
    assert os.environ["FP8RL_TLS_CA"] == "/ca.pem"
    monkeypatch.setenv("FP8RL_AUTH_TOKEN", "client-token-of-a-user")
    security.apply_security_args(_args())
    assert channel.resolve_token() is None  # no service token: send none, never the client's
    assert channel.resolve_token("explicit") == "explicit"


def test_tls_half_configured_is_refused():
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        security.apply_security_args(_args("--tls-cert", "c.pem"))
