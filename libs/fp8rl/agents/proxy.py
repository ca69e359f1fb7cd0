"""The only way out of an agent's sandbox: one HTTP proxy per agent run, on a Unix socket bound into it.

A sandboxed agent (:mod:`fp8rl.agents.sandboxed`) has no network; its ``openai`` client speaks HTTP over the
socket :meth:`AgentProxy.open` serves, and the proxy forwards each call to the agent's replica endpoint
(:class:`~fp8rl.endpoint.OpenAIEndpoint`). On the way it

* sets the call's session id (``X-Session-Id``: the agent's own, whatever the agent sent) and the endpoint's
  bearer token (which the agent never sees);
* pins the job's sampling: a call naming another ``temperature`` / ``top_p`` is refused (400, OpenAI's error
  shape), one naming none samples at the job's — the trainer's logprobs are of them; likewise a call asking for
  more than ``max_tokens`` tokens (one naming none gets ``max_tokens``);
* lets through ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` only (not the session routes: an
  agent reads or ends no session), bodies of at most ``max_body_bytes``;
* streams the endpoint's answer back as it comes (SSE included).

:meth:`AgentProxy.close` stops the socket and ends the session on the endpoint, returning what it recorded.
All sockets share one event loop on a daemon thread; every method is called from other threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from fp8rl.endpoint import SESSION_HEADER

__all__ = ["AgentProxy", "SOCKET_NAME", "base_url_problem"]

SOCKET_NAME = "agent.sock"
_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models")
_TAKE_TIMEOUT_S = 60.0  # ending a session on the endpoint: no engine work waits before it


@dataclass
class _Open:
    runner: web.AppRunner
    directory: str
    origin: str


def base_url_problem(base_url: str) -> str | None:
    """Why ``base_url`` is not a replica endpoint's base URL (``http(s)://host:port/v1``, at most 512 characters),
    or None."""
    if (base_url.startswith(("http://", "https://")) and base_url.rstrip("/").endswith("/v1")
            and len(base_url) <= 512):
        return None
    return f"an endpoint's base URL is http(s)://host:port/v1 (at most 512 characters), got {base_url[:200]!r}"


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": None}},
                             status=status)


class AgentProxy:
    """Unix-socket proxies to replica endpoints (module docstring).

    Args:
        token: the endpoints' bearer token (None: they take none).
        timeout_s: the longest one forwarded call may take.
        max_body_bytes: the largest request body forwarded (larger: 413).
    """

    def __init__(self, token: str | None = None, *, timeout_s: float = 600.0, max_body_bytes: int = 4 << 20) -> None:
        self.token, self.timeout_s, self.max_body_bytes = token, timeout_s, max_body_bytes
        self._open: dict[str, _Open] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="agent-proxy", daemon=True)
        self._thread.start()
        self._client: aiohttp.ClientSession = self._call(self._new_client())

    async def _new_client(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s), auto_decompress=False)

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def open(self, session_id: str, base_url: str, *, temperature: float, top_p: float, max_tokens: int) -> str:
        """Serve a socket for one agent run whose calls go to ``base_url`` (``http://host:port/v1``) as session
        ``session_id``; returns the directory holding it (:data:`SOCKET_NAME`). The directory is this process's
        alone (0700) until :func:`give_to` hands it to the uid the agent runs as: no other local user can reach
        the endpoint through it."""
        if problem := base_url_problem(base_url):
            raise ValueError(problem)
        with self._lock:
            if session_id in self._open:
                raise ValueError(f"session {session_id!r} has a proxy open already")
        directory = tempfile.mkdtemp(prefix="fp8rl-agent-")  # 0700
        origin = base_url.rstrip("/")[: -len("/v1")]
        pins = {"temperature": float(temperature), "top_p": float(top_p), "max_tokens": int(max_tokens)}
        try:
            runner = self._call(self._serve(os.path.join(directory, SOCKET_NAME), session_id, origin, pins), 30)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        with self._lock:
            self._open[session_id] = _Open(runner, directory, origin)
        return directory

    async def _serve(self, path: str, sid: str, origin: str, pins: dict[str, float]) -> web.AppRunner:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._forward(request, sid, origin, pins)

        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.UnixSite(runner, path).start()
        os.chmod(path, 0o600)
        return runner

    async def _forward(self, request: web.Request, sid: str, origin: str, pins: dict[str, float]
                       ) -> web.StreamResponse:
        if request.path not in _ROUTES:
            return _error(404, f"{request.method} {request.path[:200]}: an agent may call {', '.join(_ROUTES)}",
                          "not_found_error")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"the request body is larger than {self.max_body_bytes} bytes")
        if request.method == "POST":
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError) as exc:
                return _error(400, f"the request body is not JSON: {str(exc)[:120]}")
            if not isinstance(body, dict):
                return _error(400, "the request body must be a JSON object")
            cap = pins["max_tokens"]
            for key in ("max_tokens", "max_completion_tokens"):
                got = body.get(key)
                if got is not None and (isinstance(got, bool) or not isinstance(got, int) or got > cap):
                    return _error(400, f"{key}: an agent's call may ask for at most {cap} tokens "
                                       f"(agent.max_tokens_per_call); the call asked for {str(got)[:40]}")
            if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
                body["max_tokens"] = cap
            for key in ("temperature", "top_p"):
                pinned = pins[key]
                got = body.get(key)
                if got is not None and (isinstance(got, bool) or not isinstance(got, int | float)
                                        or float(got) != pinned):
                    return _error(400, f"{key}: this job samples at {key}={pinned:g} (its logprobs are trained "
                                       f"at it); the call asked for {str(got)[:40]}")
                body[key] = pinned
            raw = json.dumps(body).encode()
        headers = {"Content-Type": "application/json", SESSION_HEADER: sid}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            async with self._client.request(request.method, origin + request.path_qs, data=raw or None,
                                            headers=headers) as up:
                resp = web.StreamResponse(status=up.status, headers={
                    "Content-Type": up.headers.get("Content-Type", "application/json")})
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except (aiohttp.ClientError, TimeoutError) as exc:
            return _error(502, f"the model endpoint could not be reached: {type(exc).__name__}: {exc}"[:300],
                          "api_error")

    def give_to(self, session_id: str, uid: int | None) -> None:
        """Let ``uid`` (the sandbox's, once its slot is known) and no other reach ``session_id``'s socket: the
        directory and the socket become its (the service, root, still reaches them). None: the sandbox runs as
        this process's own uid, which owns them already."""
        with self._lock:
            o = self._open[session_id]
        if uid is not None:
            for p in (o.directory, os.path.join(o.directory, SOCKET_NAME)):
                os.chown(p, uid, uid)

    def close(self, session_id: str) -> dict[str, Any] | None:
        """Stop ``session_id``'s socket and end its session on the endpoint: the session's record
        (:meth:`~fp8rl.endpoint.sessions.SessionRecord.to_json`), None when the agent made no call.

        Raises:
            RuntimeError: the endpoint did not answer (the record is lost with it: the caller counts the run failed).
        """
        with self._lock:
            o = self._open.pop(session_id, None)
        if o is None:
            return None
        try:
            self._call(o.runner.cleanup(), 30)
        finally:
            shutil.rmtree(o.directory, ignore_errors=True)
        return self._call(self._take(o.origin, session_id), _TAKE_TIMEOUT_S + 5)

    async def _take(self, origin: str, sid: str) -> dict[str, Any] | None:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            async with self._client.delete(f"{origin}/v1/fp8rl/sessions/{sid}", headers=headers,
                                           timeout=aiohttp.ClientTimeout(total=_TAKE_TIMEOUT_S)) as r:
                if r.status == 404:
                    return None
                body = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"ending session {sid!r} at {origin}: HTTP {r.status}: {body[:300]!r}")
                return json.loads(body)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RuntimeError(f"ending session {sid!r} at {origin}: {type(exc).__name__}: {exc}") from None

    def shutdown(self) -> None:
        """Stop every socket (their sessions are left to the endpoint's idle expiry) and the loop."""
        with self._lock:
            opened, self._open = list(self._open.values()), {}
        for o in opened:
            with contextlib.suppress(Exception):
                self._call(o.runner.cleanup(), 10)
            shutil.rmtree(o.directory, ignore_errors=True)
        with contextlib.suppress(Exception):
            self._call(self._client.close(), 10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
