"""The agent proxy's rules over a real Unix socket, and agents run in the real bubblewrap sandbox.

The upstream here is a small aiohttp app that records what reaches it (a test double of the replica endpoint: the
real path — the reward service's sandbox, its proxy and the replicas' endpoints — is
``tests/integration/controller/test_env_stack.py``'s agent jobs)."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from aiohttp import web

from fp8rl.agents.proxy import SOCKET_NAME, AgentProxy
from fp8rl.agents.sandboxed import run_sandboxed_agent, sandbox_python_problem
from fp8rl.endpoint import SESSION_HEADER
from fp8rl.envs.sandbox import PYTHON, SandboxPool, sandbox_problem

RECORD = {"token_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "logprobs": [0.0, -0.25, -1.5],
          "weight_versions": [-1, 3, 3], "turns": 1, "tool_calls": 0}


class Upstream:
    """Records each call's headers and JSON body; answers chat completions and the session DELETE."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict, dict | None]] = []
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        threading.Thread(target=self._run, args=(started,), daemon=True).start()
        assert started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def chat(req: web.Request) -> web.Response:
            self.calls.append((req.path, dict(req.headers), await req.json()))
            return web.json_response({"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                                      "choices": [{"index": 0, "finish_reason": "stop",
                                                   "message": {"role": "assistant", "content": "42"}}]})

        async def models(req: web.Request) -> web.Response:
            self.calls.append((req.path, dict(req.headers), None))
            return web.json_response({"object": "list", "data": [{"id": "m", "object": "model", "created": 0,
                                                                  "owned_by": "t"}]})

        async def delete(req: web.Request) -> web.Response:
            self.calls.append((req.path, dict(req.headers), None))
            return web.json_response({"id": req.match_info["sid"], "deleted": True, **RECORD})

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/v1/models", models)
        app.router.add_delete("/v1/fp8rl/sessions/{sid}", delete)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"
        started.set()
        self.loop.run_forever()


class _Unix(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=30)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self._path)


def _call(sock: str, method: str, path: str, body=None, headers: dict | None = None) -> tuple[int, dict]:
    conn = _Unix(sock)
    try:
        raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request(method, path, body=raw, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


@pytest.fixture(scope="module")
def upstream() -> Upstream:
    return Upstream()


@pytest.fixture
def proxy():
    p = AgentProxy("the-endpoint-token", timeout_s=30)
    yield p
    p.shutdown()


def test_the_proxy_sets_the_session_token_and_sampling_and_refuses_the_rest(upstream, proxy):
    d = proxy.open("sess-1", upstream.url, temperature=0.7, top_p=0.9, max_tokens=8)
    sock = os.path.join(d, SOCKET_NAME)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700 and stat.S_IMODE(os.stat(sock).st_mode) == 0o600
    before = len(upstream.calls)
    # the agent's own session id and token are replaced; the job's sampling filled in
    status, body = _call(sock, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]},
                         {SESSION_HEADER: "someone-elses", "Authorization": "Bearer forged"})
    assert status == 200 and body["choices"][0]["message"]["content"] == "42"
    path, headers, sent = upstream.calls[-1]
    assert headers[SESSION_HEADER] == "sess-1" and headers["Authorization"] == "Bearer the-endpoint-token"
    assert (sent["temperature"], sent["top_p"], sent["max_tokens"]) == (0.7, 0.9, 8)
    # the same values are accepted; other ones, more tokens, session routes and non-JSON are refused here
    assert _call(sock, "POST", "/v1/chat/completions", {"messages": [], "temperature": 0.7, "max_tokens": 4})[0] == 200
    for bad, fragment in (({"messages": [], "temperature": 1.0}, "temperature=0.7"),
                          ({"messages": [], "top_p": 1}, "top_p=0.9"),
                          ({"messages": [], "max_tokens": 9}, "at most 8 tokens"),
                          ({"messages": [], "max_completion_tokens": True}, "at most 8 tokens"),
                          (b"{not json", "not JSON"), ([1, 2], "JSON object")):
        status, body = _call(sock, "POST", "/v1/chat/completions", bad)
        assert status == 400 and fragment in body["error"]["message"], (bad, body)
    for method in ("GET", "DELETE"):
        status, body = _call(sock, method, "/v1/fp8rl/sessions/sess-1")
        assert status == 404 and "an agent may call" in body["error"]["message"]
    assert _call(sock, "GET", "/v1/models")[0] == 200
    assert [c[0] for c in upstream.calls[before:]] == ["/v1/chat/completions"] * 2 + ["/v1/models"]
    # closing ends the session upstream (with the token) and returns its record; the socket is gone
    assert proxy.close("sess-1") == {"id": "sess-1", "deleted": True, **RECORD}
    assert upstream.calls[-1][0] == "/v1/fp8rl/sessions/sess-1"
    assert upstream.calls[-1][1]["Authorization"] == "Bearer the-endpoint-token"
    assert not os.path.exists(d) and proxy.close("sess-1") is None


def test_the_proxy_refuses_bad_base_urls_and_a_second_open_of_a_session(upstream, proxy):
    for url in ("ftp://x/v1", "http://127.0.0.1:1/v2", "127.0.0.1:1/v1"):
        with pytest.raises(ValueError, match="base URL"):
            proxy.open("s", url, temperature=1.0, top_p=1.0, max_tokens=4)
    proxy.open("s", upstream.url, temperature=1.0, top_p=1.0, max_tokens=4)
    with pytest.raises(ValueError, match="open already"):
        proxy.open("s", upstream.url, temperature=1.0, top_p=1.0, max_tokens=4)
    proxy.close("s")


_NO_SANDBOX = sandbox_problem() or sandbox_python_problem()
AGENT = '''
import os

def answer(task, client):
    client.models.list()
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["question"]}])
    return r.choices[0].message.content

def environment(task, client):
    client.models.list()
    return float(set(os.environ) <= {"PATH", "HOME", "PWD", "LC_CTYPE"})

def not_a_reward(task, client):
    return [1.0]

def sleeps(task, client):
    import time
    time.sleep(60)
'''


@pytest.mark.skipif(_NO_SANDBOX is not None and not os.environ.get("CI"), reason=f"no agent sandbox: {_NO_SANDBOX}")
def test_agents_run_in_the_sandbox_through_the_proxy(upstream, proxy, monkeypatch):
    # a directory the sandbox's uid may read (pytest's tmp_path is 0700: bwrap as that uid could not mount it)
    home = tempfile.mkdtemp(prefix="fp8rl-agent-module-")
    os.chmod(home, 0o755)
    with open(os.path.join(home, "proxy_test_agent.py"), "w") as f:
        f.write(AGENT)
    os.chmod(os.path.join(home, "proxy_test_agent.py"), 0o644)
    monkeypatch.syspath_prepend(home)  # the service can import it: its file is mounted into the sandbox
    pool = SandboxPool(2, uid_base=61000)

    def run(name: str, timeout_s: float = 30.0):
        d = proxy.open(f"s-{name}", upstream.url, temperature=1.0, top_p=1.0, max_tokens=4)
        try:
            return run_sandboxed_agent(pool, f"proxy_test_agent:{name}", {"question": "q"}, d, timeout_s=timeout_s,
                                       give=lambda uid: proxy.give_to(f"s-{name}", uid))
        finally:
            proxy.close(f"s-{name}")

    r = run("answer")
    assert (r.end, r.value) == ("done", "42"), r
    assert run("environment").value == 1.0  # nothing of this process's environment reaches the agent
    r = run("not_a_reward")
    assert r.end == "env_error" and "reward (a number) or a text" in r.error
    t0 = time.monotonic()
    r = run("sleeps", timeout_s=3)
    assert r.end == "env_timeout" and time.monotonic() - t0 < 20
    assert sys.modules.get("proxy_test_agent") is None  # nothing of the agent ran in this process
    shutil.rmtree(home)


def _connects_as(uid: int, path: str) -> bool:
    """Whether a process of ``uid`` can connect to the Unix socket ``path`` (run as that uid: root is needed)."""
    code = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\n"
            "try:\n    s.connect(sys.argv[1])\nexcept OSError:\n    sys.exit(1)\n")
    return subprocess.run([PYTHON, "-I", "-S", "-c", code, path], user=uid, group=uid, extra_groups=[], cwd="/",
                          timeout=30).returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="changing uids needs root")
def test_only_the_sandboxs_uid_reaches_an_agents_socket(upstream, proxy):
    """Another local user cannot drive the endpoint through an agent's socket (it would write into the agent's
    trajectory with the service's token): the socket is the service's until handed to the sandbox's uid, then that
    uid's alone."""
    d = proxy.open("sess-uid", upstream.url, temperature=1.0, top_p=1.0, max_tokens=4)
    sock = os.path.join(d, SOCKET_NAME)
    assert not _connects_as(61007, sock) and not _connects_as(65534, sock)
    proxy.give_to("sess-uid", 61007)  # the slot's uid, as the sandbox pool hands it over before the start
    assert _connects_as(61007, sock) and not _connects_as(65534, sock)
    assert _call(sock, "GET", "/v1/models")[0] == 200  # the service (root) still reaches it
    proxy.close("sess-uid")
