"""The OpenAI-compatible HTTP endpoint of a rollout engine (aiohttp), token-carrying.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``, and the
session record ``GET`` / ``DELETE /v1/fp8rl/sessions/{id}``. Each choice's message carries
``prompt_token_ids``, ``generation_token_ids``, ``generation_log_probs`` and ``weight_version``; sent back, the
assistant turn is spliced as those exact tokens (:mod:`.chat`). ``X-Session-Id`` binds a trajectory's calls: its
K/V stay in the engine between calls (the engine's session of the same key) and its tokens are recorded
(:mod:`.sessions`).

Bounds, each refused in OpenAI's error shape before any work: a body over ``max_body_bytes`` (413) or slower than
``body_timeout_s`` (408), bad JSON or fields (400), a full queue (429: at most ``max_queue`` calls waiting or
running). Concurrent calls are batched: calls waiting while the engine runs go in its next call, grouped by equal
sampling parameters (a call with a seed runs alone: its seed makes it reproducible). With a ``token`` every route
(health and models too) wants ``Authorization: Bearer <token>``; without one the endpoint must listen on loopback
(the caller — :mod:`services.rollout.server` — refuses anything else).

``stream: true`` answers as server-sent events in OpenAI's chunk shape; the engine samples a call's tokens as one
batch, so the chunks are sent when the turn is complete (one per token), not while it decodes.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from fp8rl.engines.base import Sample, SamplingParams
from fp8rl.envs.render import ChatRenderer
from fp8rl.model.tokenizer import stop_token_ids

from .chat import CompletionRequest, EndpointError, EndpointLimits, SessionView, parse_chat, parse_completion
from .choices import choice_text, make_choice, stream_chunks
from .sessions import SESSION_HEADER, SessionBook, check_extends, check_session_id

__all__ = ["EndpointConfig", "OpenAIEndpoint", "Generate"]

log = logging.getLogger(__name__)

_TASKS = web.AppKey("tasks", list)

Generate = Callable[[list[list[int]], SamplingParams, "list[str | None] | None"], list[Sample]]
"""``generate(prompts, params, session_keys)`` → samples, prompt-major (the engine's call, blocking)."""


@dataclass(frozen=True)
class EndpointConfig:
    """The endpoint's bounds and identity (the rollout service's ``--openai-*`` flags)."""

    model_name: str = "fp8rl"
    token: str | None = None
    max_body_bytes: int = 4 << 20
    body_timeout_s: float = 30.0
    max_queue: int = 256
    max_batch_prompts: int = 64
    batch_window_s: float = 0.002
    limits: EndpointLimits = EndpointLimits()
    max_sessions: int = 1024
    session_idle_s: float = 3600.0
    session_max_tokens: int = 1 << 20


@dataclass
class _Job:
    prompts: list[list[int]]
    params: SamplingParams
    keys: list[str | None] | None
    future: asyncio.Future


class OpenAIEndpoint:
    """The aiohttp application over one engine; :meth:`start` serves it on a thread of its own."""

    def __init__(self, generate: Generate, tokenizer, *, vocab_size: int, max_len: int,
                 config: EndpointConfig = EndpointConfig(), weight_version: Callable[[], int | None] = lambda: None,
                 drop_session: Callable[[str], Any] = lambda key: None,
                 ready: Callable[[], bool] | None = None) -> None:
        self.generate, self.tok, self.cfg = generate, tokenizer, config
        self.ready = ready if ready is not None else (lambda: weight_version() is not None)
        self.vocab_size, self.max_len = vocab_size, max_len
        self.weight_version, self.drop_session = weight_version, drop_session
        try:
            self.renderer: ChatRenderer | None = ChatRenderer(tokenizer)
            self._no_chat = ""
        except ValueError as exc:  # a base model's tokenizer: /v1/completions only
            self.renderer, self._no_chat = None, str(exc)
        self.stop_ids = tuple(stop_token_ids(tokenizer))
        self.sessions = SessionBook(max_sessions=config.max_sessions, idle_s=config.session_idle_s,
                                    max_tokens=config.session_max_tokens)
        self._queue: list[_Job] = []
        self._pending = 0  # calls admitted and not answered (bounded by max_queue)
        self._wake: asyncio.Event | None = None
        self._engine = ThreadPoolExecutor(max_workers=1, thread_name_prefix="endpoint-engine")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None
        self.stats = {"calls": 0, "engine_calls": 0, "refused": 0, "tokens": 0}

    # -- lifecycle ---------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self._errors, self._auth])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/fp8rl/sessions/{sid}", self._session_get)
        app.router.add_delete("/v1/fp8rl/sessions/{sid}", self._session_delete)
        app.on_startup.append(self._on_startup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self._wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        app[_TASKS] = [loop.create_task(self._batcher()), loop.create_task(self._expiry())]

    def start(self, host: str = "127.0.0.1", port: int = 0, *, timeout_s: float = 30.0) -> int:
        """Serve on ``host:port`` (0: a free port) from a thread of its own; returns the bound port."""
        ready, failed = threading.Event(), []

        def run() -> None:
            loop = self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                self._runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=2.0)
                loop.run_until_complete(self._runner.setup())
                site = web.TCPSite(self._runner, host, port, reuse_address=True)
                loop.run_until_complete(site.start())
                self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            except BaseException as exc:  # noqa: BLE001 - reported to start()'s caller
                failed.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            try:  # stopped: the server's connections closed, then every task of ours ended, then the loop
                loop.run_until_complete(self._runner.cleanup())
                pending = asyncio.all_tasks(loop)
                for t in pending:
                    t.cancel()
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="openai-endpoint", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s):
            raise RuntimeError(f"the OpenAI endpoint did not start on {host}:{port} within {timeout_s:g} s")
        if failed:
            raise failed[0]
        log.info("OpenAI-compatible endpoint on http://%s:%d/v1 (model %r%s)", host, self.port, self.cfg.model_name,
                 ", token required" if self.cfg.token else ", no token: loopback only")
        return self.port  # type: ignore[return-value]

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._engine.shutdown(wait=False, cancel_futures=True)

    # -- middlewares -------------------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except EndpointError as exc:
            self.stats["refused"] += 1
            return web.json_response(exc.body(), status=exc.status)
        except web.HTTPRequestEntityTooLarge:
            self.stats["refused"] += 1
            return web.json_response(EndpointError(
                f"the request body is larger than {self.cfg.max_body_bytes} bytes", status=413).body(), status=413)
        except web.HTTPException as exc:  # 404 / 405 from the router, in OpenAI's shape
            return web.json_response(EndpointError(f"{request.method} {request.path}: {exc.reason}",
                                                   status=exc.status).body(), status=exc.status)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        token = self.cfg.token
        if token is not None:
            got = request.headers.get("Authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
                raise EndpointError("missing or wrong bearer token (Authorization: Bearer <token>)", status=401,
                                    code="invalid_api_key")
        return await handler(request)

    # -- routes ------------------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "weight_version": self.weight_version(),
                                  "sessions": len(self.sessions), "queued": self._pending, **self.stats})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.cfg.model_name, "object": "model", "created": 0, "owned_by": "fp8rl"}]})

    async def _session_get(self, request: web.Request) -> web.Response:
        sid = check_session_id(request.match_info["sid"])
        rec = self.sessions.get(sid)
        if rec is None:
            raise EndpointError(f"no session {sid!r}", status=404, code="session_not_found")
        return web.json_response({"id": sid, **rec.to_json()})

    def close_session(self, sid: str) -> dict[str, Any] | None:
        """End session ``sid`` from any thread: its record (None when it never existed), its engine K/V dropped."""
        rec = self.sessions.drop(sid)
        if rec is not None:
            self.drop_session(_key(sid))
        return None if rec is None else rec.to_json()

    async def _session_delete(self, request: web.Request) -> web.Response:
        sid = check_session_id(request.match_info["sid"])
        rec = await asyncio.get_running_loop().run_in_executor(self._engine, self.close_session, sid)
        if rec is None:
            raise EndpointError(f"no session {sid!r}", status=404, code="session_not_found")
        return web.json_response({"id": sid, "deleted": True, **rec})

    async def _body(self, request: web.Request) -> Any:
        try:
            raw = await asyncio.wait_for(request.read(), self.cfg.body_timeout_s)
        except TimeoutError:
            raise EndpointError(f"the request body did not arrive within {self.cfg.body_timeout_s:g} s",
                                status=408) from None
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise EndpointError(f"the request body is not JSON: {str(exc)[:120]}") from None

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        self.stats["calls"] += 1
        body = await self._body(request)
        sid = check_session_id(request.headers.get(SESSION_HEADER))
        if not self.ready():
            raise EndpointError(f"the engine holds no servable weights yet (version {self.weight_version()}); "
                                f"retry once the first version is applied", status=503, type="server_error",
                                code="not_ready")
        if self._pending >= self.cfg.max_queue:
            raise EndpointError(f"the endpoint has {self._pending} calls in flight (the limit is "
                                f"{self.cfg.max_queue}); retry later", status=429, type="rate_limit_error",
                                code="queue_full")
        self._pending += 1
        view = self.sessions.begin(sid) if sid is not None else None
        recorded = False
        try:
            loop = asyncio.get_running_loop()
            req, tools = await loop.run_in_executor(None, self._parse, body, chat, view)
            if view is not None:
                check_extends(list(view.ids), req.prompts[0])
            samples = await self._submit(req, None if sid is None else [_key(sid)])
            choices = [make_choice(i, s, req, self._decode, self._text_of) for i, s in enumerate(samples)]
            if sid is not None:
                c = choices[0]
                self.sessions.record(sid, req.prompts[0], c["_ids"], c["_lps"], samples[0].weight_version,
                                     n_messages=req.n_messages, reply=c.get("message"))
                recorded = True
            self.stats["tokens"] += sum(len(c["_ids"]) for c in choices)
            return await self._answer(request, req, choices, samples)
        finally:
            self._pending -= 1
            if sid is not None and not recorded:
                self.sessions.end(sid)

    def _parse(self, body: Any, chat: bool, view: SessionView | None) -> tuple[CompletionRequest, Any]:
        lim = self.cfg.limits
        if chat:
            if self.renderer is None:
                raise EndpointError(f"/v1/chat/completions: {self._no_chat}; use /v1/completions with token ids or "
                                    f"text", status=400, code="no_chat_template")
            return parse_chat(body, self.renderer, vocab_size=self.vocab_size, max_len=self.max_len, lim=lim,
                              session=view)
        return parse_completion(body, lambda s: self.tok.encode(s, add_bos=False), vocab_size=self.vocab_size,
                                max_len=self.max_len, lim=lim, session=view), None

    # -- batching ----------------------------------------------------------------------------------
    async def _submit(self, req: CompletionRequest, keys: list[str] | None) -> list[Sample]:
        fut = asyncio.get_running_loop().create_future()
        self._queue.append(_Job(req.prompts, req.sampling, keys, fut))
        assert self._wake is not None
        self._wake.set()
        return await fut

    async def _batcher(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.cfg.batch_window_s > 0:  # calls that arrive together (agents of one step) go in one engine call
                await asyncio.sleep(self.cfg.batch_window_s)
            while self._queue:
                first = self._queue.pop(0)
                batch = [first]
                if first.params.seed is None:
                    rows = len(first.prompts)
                    for job in list(self._queue):
                        if job.params == first.params and rows + len(job.prompts) <= self.cfg.max_batch_prompts:
                            batch.append(job)
                            self._queue.remove(job)
                            rows += len(job.prompts)
                prompts = [p for j in batch for p in j.prompts]
                keys = ([k for j in batch for k in (j.keys or [None] * len(j.prompts))]
                        if any(j.keys for j in batch) else None)
                self.stats["engine_calls"] += 1
                try:
                    samples = await loop.run_in_executor(self._engine, self.generate, prompts, first.params, keys)
                except Exception as exc:  # noqa: BLE001 - each caller gets the engine's error
                    for j in batch:
                        if not j.future.done():
                            j.future.set_exception(_engine_error(exc))
                    continue
                at = 0
                for j in batch:
                    want = range(at, at + len(j.prompts))
                    mine = [s for s in samples if s.prompt_index in want]
                    mine = [_reindex(s, s.prompt_index - at) for s in mine]
                    at += len(j.prompts)
                    if not j.future.done():
                        j.future.set_result(mine)

    async def _expiry(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(60.0, self.cfg.session_idle_s / 2))
            for sid in self.sessions.expire():
                await loop.run_in_executor(self._engine, self.drop_session, _key(sid))

    # -- answers -----------------------------------------------------------------------------------
    def _text_of(self, ids: Sequence[int]) -> str:
        return choice_text(self._decode, ids, self.stop_ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids, skip_special=False)

    async def _answer(self, request: web.Request, req: CompletionRequest, choices: list[dict], samples: list[Sample]
                      ) -> web.StreamResponse:
        cid = f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        usage = {"prompt_tokens": sum(len(p) for p in req.prompts),
                 "completion_tokens": sum(len(c["_ids"]) for c in choices)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        head = {"id": cid, "created": created, "model": self.cfg.model_name}
        public = [{k: v for k, v in c.items() if not k.startswith("_")} for c in choices]
        if not req.stream:
            obj = "chat.completion" if req.chat else "text_completion"
            return web.json_response({**head, "object": obj, "choices": public, "usage": usage,
                                      "weight_version": samples[0].weight_version if samples else None})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if req.chat else "text_completion"

        async def send(choice: dict[str, Any]) -> None:
            await resp.write(f"data: {json.dumps({**head, 'object': obj, 'choices': [choice]})}\n\n".encode())

        for chunk in stream_chunks(req, choices, public, self._text_of):
            await send(chunk)
        if req.include_usage:
            await resp.write(f"data: {json.dumps({**head, 'object': obj, 'choices': [], 'usage': usage})}\n\n"
                             .encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _key(sid: str) -> str:
    return f"openai:{sid}"


def _reindex(s: Sample, index: int) -> Sample:
    return replace(s, prompt_index=index)


def _engine_error(exc: Exception) -> EndpointError:
    if isinstance(exc, ValueError):  # e.g. a prompt the engine refuses
        return EndpointError(str(exc))
    log.exception("the engine failed a batch", exc_info=exc)
    return EndpointError(f"the engine failed: {type(exc).__name__}: {exc}", status=500, type="server_error")
