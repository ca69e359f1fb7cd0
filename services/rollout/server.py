"""RolloutService: one rollout replica (``policy.generation.backend``: ``torch``; ``vllm`` not yet).

Wiring only — proto ↔ :class:`SamplingParams` / :class:`Sample`, plus the engine and the refit library:

* The engine starts holding *no* version. Every version it serves, v0 included, arrives through the
  refit protocol (:class:`RefitFollower` → ``RefitSubscriber.sync_to``), so weights and QKV scales
  always land together, verified, and a replica never serves weights the trainer did not publish.
* With an FP8 KV cache a version is applied only once its scales are published. The controller calls
  ``Calibrate(0, prompts)`` before the first step; until then the replica stays NOT_SERVING.
* Health is SERVING only while the engine holds a version (and, for FP8 KV, that version's scales).
  ``Status`` also names a newer published version the replica has seen but not applied, and why
  (``pending_version`` / ``pending_reason``: its scales are not published yet, or the refit failed).
* ``Generate`` is pinned: a request for any other version than the held one is FAILED_PRECONDITION,
  naming both; a refit waits for the batch in flight (the engine's lock), so it lands between batches.
* ``Generate`` is bounded before any work (INVALID_ARGUMENT naming the limit and the value): at most
  ``--max-prompts`` prompts, ``--max-n`` samples per prompt and ``--max-generated-tokens`` tokens
  (prompts × n × max_tokens); temperature finite in [0, 100], below 1e-5 greedy (``fp8rl.limits``).
  The engine checks the call between decode steps: a call cancelled or past its deadline stops at
  once and frees the engine for the next one.
* Multi-turn trajectories: ``session_keys`` (one per prompt, ``n`` = 1) keep each trajectory's K/V on this
  replica between its turns (:mod:`fp8rl.engines.kv_sessions`: reused only as a prefix at the same weights and
  scales, bitwise the re-prefill under batch invariance; bounded, LRU); ``ReleaseSessions`` drops them when the
  trajectories end. The controller sends all turns of a trajectory here while this replica lives (sticky); a
  replica that never saw a key (another took over) recomputes it. Only the embedded engine keeps sessions.
  Asynchronous GRPO (``env.partial: finish``): a newer version is not applied while trajectories of the held one
  are in flight here (:class:`OpenSessions`, bounded by the job's ``max_weight_lag`` and ``--session-hold-s``);
  ``Status.pending_reason`` then says ``held: ...``.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import grpc

from fp8rl import limits, memory
from fp8rl.config import JobConfig
from fp8rl.endpoint import EndpointConfig, OpenAIEndpoint
from fp8rl.engines import Cancelled, RolloutEngine, SamplingParams, VersionMismatchError, make_rollout_engine
from fp8rl.model.tokenizer import load_tokenizer, stop_token_ids
from fp8rl.presets import PRESETS, load_policy, prepare_preset
from fp8rl.refit import RefitFollower, RefitHeld
from fp8rl.rpc import rollout_pb2, rollout_pb2_grpc
from fp8rl.rpc.channel import read_token_file
from fp8rl.rpc.routes import routes_to_proto
from services.common.compute import OnComputeThread
from services.common.pictures import RequestPictures
from services.common.refit import build_subscriber
from services.common.runtime import (
    Abort,
    Context,
    Service,
    ServiceSpec,
    StartupError,
    check_token_ids,
    env_default,
    optional_port,
    require,
    rpc_method,
)
from services.common.security import is_loopback_host

log = logging.getLogger(__name__)

__all__ = ["RolloutService", "RolloutServicer", "SPEC"]


def build_engine(job: JobConfig, args: argparse.Namespace) -> tuple[RolloutEngine, Any, int, int, RequestPictures]:
    """``(engine, tokenizer, vocab_size, max_positions, pictures)`` for ``policy.generation.backend``
    (:func:`make_rollout_engine`); ``pictures`` reads a vision-language policy's prompt images."""
    name = job.policy.model
    if job.policy.generation.backend == "vllm":  # vLLM loads the checkpoint itself
        from fp8rl.engines.vllm.launch import Fp8UnsupportedError, VllmUnavailableError

        path = prepare_preset(name) if name in PRESETS else Path(name)
        tok = load_tokenizer(path)
        try:
            engine = make_rollout_engine(job, None, path, eos_token_ids=stop_token_ids(tok), pad_token_id=tok.pad_id,
                                         max_batch_size=args.max_batch_size)
        except (Fp8UnsupportedError, VllmUnavailableError) as exc:
            raise StartupError(f"policy.generation.backend: 'vllm': {exc}") from None
        return engine, tok, engine.config.vocab_size, engine.config.max_position_embeddings, \
            RequestPictures(engine.config, None)  # (a vision-language policy is refused with vLLM)
    policy, tok, path = load_policy(name, language_model_only=job.policy.language_model_only)
    config = policy.config
    try:  # the loaded model is the engine's own (converted in place): never two copies in this process
        engine = make_rollout_engine(job, policy, path, eos_token_ids=stop_token_ids(tok), pad_token_id=tok.pad_id,
                                     max_batch_size=args.max_batch_size, take_model=True)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    return engine, tok, config.vocab_size, config.max_position_embeddings, RequestPictures(config, path)


class OpenSessions:
    """The multi-turn trajectories in flight on this replica (``env.partial: finish``): session keys seen in
    Generate and not yet released, with the version that served them and when they were last used.

    :meth:`hold` keeps a newer version from being applied while a trajectory of the held version is in flight, so
    every trajectory is sampled by one version and none is restarted by a refit — bounded: never past the
    ``max_weight_lag`` its Generate calls carried (the job's; 0, a synchronous job, never holds: its refits come
    between steps, when no trajectory is open) and never for a session idle longer than ``idle_s`` (a controller
    that went away stops holding the replica back).
    """

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self._open: dict[str, tuple[int, int, float]] = {}  # key -> (version, max_weight_lag, last used)
        self._lock = threading.Lock()
        self._logged: tuple[int, int] | None = None  # the (held, latest) pair last logged as held back

    def used(self, keys, version: int, max_lag: int) -> None:
        if max_lag < 1:
            return
        now = time.monotonic()
        with self._lock:
            for k in keys:
                if k is not None:
                    self._open[k] = (version, max_lag, now)

    def release(self, keys) -> None:
        with self._lock:
            for k in keys:
                self._open.pop(k, None)

    def hold(self, held: int | None, latest: int) -> str | None:
        if held is None:
            return None
        now = time.monotonic()
        with self._lock:
            for k in [k for k, (_, _, t) in self._open.items() if now - t > self.idle_s]:
                del self._open[k]
            n = sum(v == held and latest - held <= lag for v, lag, _ in self._open.values())
            if n and self._logged != (held, latest):
                self._logged = (held, latest)
                log.info("holding weight version %d back: %d multi-turn trajectories of version %d in flight", latest,
                         n, held)
        return f"{n} multi-turn trajectories of version {held} in flight" if n else None


class HoldingTarget:
    """The engine as the refit target, its apply asking :meth:`OpenSessions.hold` once more where it runs.

    The follower asks the hold before it fetches a version; a Generate that opens trajectories of the held version
    after that look would otherwise see the refit land between their turns (the trajectory's version gone, the step
    retried). The apply runs on the compute thread, after every Generate queued before it — and a Generate marks
    its sessions before it queues — so this second look sees every trajectory sampled at the old version: the
    apply raises :class:`RefitHeld` and the engine keeps its version. A Generate marked after this look runs after
    the apply and is refused (FAILED_PRECONDITION: pinned to the old version); the controller's pool sends its
    trajectories, none sampled yet, to a replica of the new one.
    """

    def __init__(self, engine: RolloutEngine, sessions: OpenSessions) -> None:
        self._engine, self._sessions = engine, sessions

    def load_weights(self, version, tensors, qkv_scales=None) -> None:
        if why := self._sessions.hold(self._engine.weight_version, version):
            raise RefitHeld(why)
        self._engine.load_weights(version, tensors, qkv_scales)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


class RolloutService(Service):
    """The engine, its refit follower and the RolloutService servicer of one replica."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.engine, self.tok, self.vocab_size, self.max_len, self.pictures = build_engine(ctx.job, ctx.args)
        self.backend = ctx.job.policy.generation.backend
        self.fp8_kv = ctx.job.fp8_recipe("rollout").fp8_kv
        # the refit apply (validate, quantize, copy into the parameters) runs on the compute thread too
        self.sessions = OpenSessions(ctx.args.session_hold_s)
        target = OnComputeThread(HoldingTarget(self.engine, self.sessions), ctx.compute)
        subscriber, self.source = build_subscriber(ctx.store, target, ctx.replica_id, ctx.job.refit,
                                                   requires_scales=self.fp8_kv, metrics=ctx.metrics)
        self.follower = RefitFollower(ctx, subscriber, lock=threading.Lock(), on_change=self._update_health,
                                      hold=lambda latest: self.sessions.hold(self.engine.weight_version, latest))

    def servicers(self):
        return [(rollout_pb2_grpc.add_RolloutServiceServicer_to_server, RolloutServicer(self))]

    def ready(self) -> bool:
        held = self.engine.weight_version
        return held is not None and (not self.fp8_kv or self.engine.scales_version == held)

    def _update_health(self) -> None:
        self.ctx.set_serving(self.ready())

    def start(self, ctx: Context) -> None:
        self.follower.start()  # registers the lease (version None), then pulls weights:latest when applicable
        self.endpoint = start_endpoint(ctx, self.engine, self.tok, self.vocab_size, self.max_len, self.ready)
        if self.endpoint is not None:  # where an agent job's calls reach this replica (services.controller.agents)
            host = ctx.args.openai_host
            if host in ("", "0.0.0.0", "::", "[::]"):
                host = ctx.endpoint.rsplit(":", 1)[0]  # the address the gRPC server is advertised at
            self.agent_url = f"http://{host}:{self.endpoint.port}/v1"
            try:
                ctx.store.set_agent_endpoint(ctx.replica_id, self.agent_url)
            except Exception as exc:  # noqa: BLE001 - Redis away: the endpoint serves its own callers meanwhile
                log.warning("cannot record the OpenAI endpoint %s in Redis (%s): agent jobs will not find this "
                            "replica", self.agent_url, exc)

    def stop(self) -> None:
        if getattr(self, "endpoint", None) is not None:
            try:
                self.ctx.store.set_agent_endpoint(self.ctx.replica_id, None)
            except Exception:  # noqa: BLE001, S110 - best effort: a replica without a live lease is not used
                pass
            self.endpoint.stop()
        self.follower.stop()
        self.source.close()


def start_endpoint(ctx: Context, engine: RolloutEngine, tok, vocab_size: int, max_len: int, ready
                   ) -> OpenAIEndpoint | None:
    """The OpenAI-compatible endpoint (``--openai-port``; off when unset) over this replica's engine, its calls on
    the compute thread like Generate's. Loopback unless ``--openai-token-file`` names its bearer token (or
    ``--insecure``); the embedded engine only (the vLLM backend keeps no sessions here: refused, naming why)."""
    a = ctx.args
    if a.openai_port is None:
        return None
    if ctx.job.policy.generation.backend != "torch":
        raise StartupError("--openai-port: the OpenAI-compatible endpoint runs on the embedded engine "
                           "(policy.generation.backend: torch); with vLLM use vLLM's own OpenAI server, which does "
                           "not splice the returned token ids")
    token = read_token_file(a.openai_token_file, "--openai-token-file") if a.openai_token_file else None
    if token is None and not is_loopback_host(a.openai_host) and not a.insecure:
        raise StartupError(f"refusing to serve the OpenAI endpoint on {a.openai_host!r} (not a loopback address) "
                           f"without a token: give --openai-token-file FILE, listen on --openai-host 127.0.0.1, or "
                           f"pass --insecure")
    cfg = EndpointConfig(model_name=a.openai_model_name or ctx.job.policy.model, token=token,
                         max_queue=a.openai_max_queue, max_body_bytes=a.openai_max_body_bytes)
    ep = OpenAIEndpoint(lambda prompts, params, keys: ctx.compute(engine.generate, prompts, params, sessions=keys),
                        tok, vocab_size=vocab_size, max_len=max_len, config=cfg,
                        weight_version=lambda: engine.weight_version, ready=ready,
                        drop_session=lambda key: ctx.compute(engine.drop_session, key))
    try:
        ep.start(a.openai_host, a.openai_port)
    except OSError as exc:
        raise StartupError(f"--openai-port {a.openai_port}: cannot listen on {a.openai_host}: {exc}") from None
    return ep


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """proto ↔ engine; validation and status codes, nothing else."""

    def __init__(self, service: RolloutService) -> None:
        self.s = service
        self._generating, self._count_lock = 0, threading.Lock()  # Generate calls inside the engine (Status)

    def _params(self, sp: rollout_pb2.SamplingParams) -> SamplingParams:
        try:
            return SamplingParams(
                temperature=sp.temperature if sp.HasField("temperature") else 1.0,
                top_p=sp.top_p if sp.HasField("top_p") else 1.0,
                max_tokens=sp.max_tokens, n=sp.n, seed=sp.seed if sp.HasField("seed") else None,
                stop_token_ids=tuple(sp.stop_token_ids),
            )
        except ValueError as exc:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad sampling parameters: {exc}") from None

    def _check_size(self, request) -> None:
        """The request's size against this replica's limits, before any of it is converted or run."""
        a, sp = self.s.ctx.args, request.sampling
        num = len(request.prompts)
        require(num <= a.max_prompts, f"GenerateRequest.prompts: {num} prompts; the limit is {a.max_prompts} "
                                      f"(--max-prompts)")
        require(sp.n <= a.max_n, f"sampling.n: {sp.n} samples per prompt; the limit is {a.max_n} (--max-n)")
        require(len(request.request_id) <= limits.MAX_REQUEST_ID_CHARS,
                f"request_id: {len(request.request_id)} characters; the limit is {limits.MAX_REQUEST_ID_CHARS}")
        stops = sp.stop_token_ids
        require(len(stops) <= limits.MAX_STOP_TOKEN_IDS,
                f"sampling.stop_token_ids: {len(stops)} ids; the limit is {limits.MAX_STOP_TOKEN_IDS}")
        bad = next((t for t in stops if not 0 <= t < self.s.vocab_size), None)
        require(bad is None, f"sampling.stop_token_ids holds {bad}, outside the model's vocabulary "
                             f"[0, {self.s.vocab_size})")
        tokens = num * max(sp.n, 0) * max(sp.max_tokens, 0)
        require(tokens <= a.max_generated_tokens,
                f"prompts x sampling.n x sampling.max_tokens: {num} x {sp.n} x {sp.max_tokens} = {tokens} tokens; "
                f"the limit is {a.max_generated_tokens} (--max-generated-tokens)")

    @rpc_method
    def Generate(self, request, context):
        s = self.s
        require(request.prompts, "GenerateRequest.prompts is empty")
        self._check_size(request)
        params = self._params(request.sampling)
        prompts = [check_token_ids(p.token_ids, s.vocab_size, s.max_len, f"prompt {i}")
                   for i, p in enumerate(request.prompts)]
        sessions = self._sessions(request, params)
        images = s.pictures.of_prompts([p.images for p in request.prompts], prompts)  # decoded, checked, processed
        require(images is None or sessions is None, "session_keys: KV sessions take no images (a multi-turn "
                                                    "trajectory is text)")
        held = s.engine.weight_version
        if not s.ready():
            raise Abort(grpc.StatusCode.UNAVAILABLE,
                        f"replica {s.ctx.replica_id} is not ready: it holds weight version {held} and QKV scales of "
                        f"version {s.engine.scales_version}; waiting for a published version (and its scales)")
        if sessions is not None:  # trajectories in flight at this version (env.partial finish): marked before the
            s.sessions.used(sessions, request.weight_version, request.max_weight_lag)  # call: no refit between turns
        with self._count_lock:
            self._generating += 1
        t0 = time.perf_counter()
        try:
            with memory.phase("rollout"):
                more = {"sessions": sessions} if sessions is not None else {}
                if images is not None:
                    more["images"] = images
                samples = s.ctx.compute(s.engine.generate, prompts, params, weight_version=request.weight_version,
                                        should_stop=lambda: not context.is_active(), **more)
        except VersionMismatchError as exc:  # pinned to another version (the engine checks the pin, once)
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION, f"replica {s.ctx.replica_id}: {exc}") from None
        except Cancelled as exc:  # the caller is gone; the status is for the log
            raise Abort(grpc.StatusCode.CANCELLED, f"request {request.request_id[:100]!r}: {exc}") from None
        except ValueError as exc:  # e.g. prompt + max_tokens longer than the model's positions
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        finally:
            with self._count_lock:
                self._generating -= 1
        s.ctx.metrics.observe_generation(sum(len(smp.token_ids) for smp in samples), time.perf_counter() - t0)
        s.ctx.metrics.observe_memory(memory.step_memory())
        seen: dict[int, int] = defaultdict(int)
        for smp in samples:
            index = seen[smp.prompt_index]
            seen[smp.prompt_index] += 1
            yield rollout_pb2.GenerateResponse(request_id=request.request_id, sample=rollout_pb2.Sample(
                prompt_index=smp.prompt_index, sample_index=index, token_ids=smp.token_ids, logprobs=smp.logprobs,
                finish_reason=smp.finish_reason, weight_version=smp.weight_version,
                routes=None if smp.routes is None else routes_to_proto(smp.routes),
            ))

    def _sessions(self, request, params: SamplingParams) -> list[str | None] | None:
        """GenerateRequest.session_keys checked: one per prompt ("" = none) with n = 1, on an engine that keeps
        sessions; None when the request names none."""
        keys = list(request.session_keys)
        if not keys:
            return None
        require(hasattr(self.s.engine, "drop_session"),
                f"session_keys: this replica's engine ({self.s.backend}) keeps no KV sessions; multi-turn "
                f"trajectories run on the embedded engine (policy.generation.backend torch)")
        require(len(keys) == len(request.prompts),
                f"session_keys: {len(keys)} keys for {len(request.prompts)} prompts (one per prompt, '' for none)")
        require(params.n == 1, f"session_keys need one sample per prompt (sampling.n = 1), got {params.n}")
        bad = next((i for i, k in enumerate(keys) if len(k) > limits.MAX_ENV_ID_CHARS), None)
        require(bad is None, f"session_keys[{bad}]: longer than {limits.MAX_ENV_ID_CHARS} characters")
        return [k or None for k in keys]

    @rpc_method
    def ReleaseSessions(self, request, context):
        keys = list(request.session_keys)
        require(len(keys) <= limits.MAX_ENV_IDS, f"session_keys: {len(keys)} keys; the limit is {limits.MAX_ENV_IDS}")
        self.s.sessions.release(keys)
        drop = getattr(self.s.engine, "drop_session", None)
        released = sum(bool(drop(k)) for k in keys) if drop is not None else 0
        return rollout_pb2.ReleaseSessionsResponse(released=released)

    @rpc_method
    def Status(self, request, context):
        s = self.s
        resp = rollout_pb2.RolloutStatusResponse(
            replica_id=s.ctx.replica_id, engine=s.backend, recipe=s.ctx.job.recipe,
            kv_cache_dtype=s.ctx.job.kv_cache_dtype, ready=s.ready(), generating=self._generating,
        )
        stats = getattr(s.engine, "session_stats", None)
        if stats is not None:
            st = stats()
            resp.session_reused_tokens, resp.session_prefill_tokens = st["reused_tokens"], st["prefill_tokens"]
            resp.session_evictions = st["evictions"]
        if s.engine.weight_version is not None:
            resp.weight_version = s.engine.weight_version
        if s.fp8_kv and s.engine.scales_version is not None:
            resp.scales_version = s.engine.scales_version
        pending = s.follower.pending  # one read: the follow thread replaces it whole
        if pending is not None:
            resp.pending_version, resp.pending_reason = pending.version, pending.reason
        return resp


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-batch-size", type=int, default=int(env_default("max_batch_size", 256)),
                   help="rows (prompts x n) decoded together (default 256: one GRPO step of 32 prompts x 8 in one "
                        "batch, as the in-process loop decodes it)")
    p.add_argument("--session-hold-s", type=float, default=float(env_default("session_hold_s", 120.0)),
                   help="asynchronous multi-turn jobs: a newer version waits while trajectories of the held one are "
                        "in flight, but not for a trajectory idle this long (default 120 s)")
    p.add_argument("--openai-port", type=optional_port("openai_port"),
                   default=optional_port("openai_port")(env_default("openai_port", "")),
                   help="serve the OpenAI-compatible, token-carrying endpoint (/v1/chat/completions, "
                        "/v1/completions) on this port (0: a free one, logged); off when unset")
    p.add_argument("--openai-host", default=env_default("openai_host", "127.0.0.1"),
                   help="address of the OpenAI endpoint (default loopback; another needs --openai-token-file)")
    p.add_argument("--openai-token-file", default=env_default("openai_token_file"),
                   help="file holding the endpoint's bearer token (its callers send Authorization: Bearer TOKEN)")
    p.add_argument("--openai-model-name", default=env_default("openai_model_name"),
                   help="the model id the endpoint reports (default: policy.model)")
    p.add_argument("--openai-max-queue", type=int, default=int(env_default("openai_max_queue", 256)),
                   help="endpoint calls waiting or running at once; more are refused 429 (default 256)")
    p.add_argument("--openai-max-body-bytes", type=int, default=int(env_default("openai_max_body_bytes", 4 << 20)),
                   help="largest endpoint request body (default 4 MiB; larger: 413)")
    p.add_argument("--max-prompts", type=int, default=int(env_default("max_prompts", limits.MAX_GENERATE_PROMPTS)),
                   help="most prompts in one Generate call")
    p.add_argument("--max-n", type=int, default=int(env_default("max_n", limits.MAX_SAMPLES_PER_PROMPT)),
                   help="most samples per prompt (sampling.n) in one Generate call")
    p.add_argument("--max-generated-tokens", type=int,
                   default=int(env_default("max_generated_tokens", limits.MAX_GENERATED_TOKENS)),
                   help="token budget of one Generate call: prompts x n x max_tokens")


SPEC = ServiceSpec(name="rollout", default_port=50052, build=RolloutService, add_args=_add_args,
                   follows_refit=True, compute_thread=lambda job: job.policy.generation.backend == "torch")
