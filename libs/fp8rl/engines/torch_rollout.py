"""The embedded rollout engine (``engine: torch``): batched sampling with a static KV cache.

Numerics follow the job's recipe through :func:`fp8rl.fp8.convert_model` in inference mode:
FP8 layers hold E4M3 weights + FP32 128×128 block scales (prepared once per weight version) and
quantize activations 1×128 at run time; with ``kv_cache_dtype: fp8`` the cache stores E4M3 K/V
under per-tensor scales calibrated for the served weight version, and FP8 attention rounds Q and
the softmax probabilities to E4M3.

Invariants: :meth:`generate` serves only the version it holds (a pinned request for another gets
:class:`VersionMismatchError`) and, with an FP8 KV cache, only with the QKV scales of that same
version; :meth:`load_weights` runs the payload lifecycle of :mod:`fp8rl.fp8.payload` (validate and
quantize everything, then overwrite the live tensors in place), the apply step under the same lock
``generate`` holds, so a refit lands between batches. ``generate`` polls its
``should_stop`` check before every decode step, so an abandoned call releases that lock within one step.

Shared weights (``shared_with``, the in-process synchronous loop): the engine's high-precision tensors *are* the
trainer's (no copy), and its FP8 layers take their E4M3 forms from the trainer's FP8 weight caches where the trainer
has them (``fp8_e2e``: the same 128x128 quantization of the same weights, so the same numbers) or quantize them
from the shared weights (``fp8_gen_only``). The trainer's optimizer step then changes what the engine computes
with at once; the engine's *label* stays the old version until :meth:`follow` (the refit of this mode: the FP8
forms and the scales of the new version, no copy), and :meth:`load_weights` is refused (it would write into the
trainer's weights). Its FP8 layers hold their FP32 dequantizations (the reference backend's GEMM operand) only
while :meth:`generate` runs, so the trainer's step between two generations does not carry them. Only a caller
that never generates between a train step and its refit may share: the synchronous loop. Asynchronous GRPO
generates beside training and keeps its own copy.

Logprobs: ``log_softmax(logits / temperature)`` of the sampled token — the temperature-scaled
distribution the token was drawn from, before top-p renormalisation (the trainer computes the
same quantity, so ratios compare like with like; with top_p = 1 it is exactly the sampling
distribution). Greedy (temperature 0) reports temperature-1 logprobs.

KV sessions (multi-turn trajectories, issue 48; :mod:`.kv_sessions`): ``generate(..., sessions=keys)`` keeps each
keyed row's K/V after the call and prefills only the part of the next prompt they do not cover — bitwise the
re-prefill under batch invariance. Refits and ``load_scales`` drop every session.

Repeated prompts: a prompt that several rows of one call start from (a GRPO group's ``n`` samples, the first turn
of a group's trajectories) is prefilled once and its rows seeded from that K/V as from a session — the same
mechanism, the same bits under batch invariance; the trainer runs a micro-batch's shared leading tokens once too
(:mod:`fp8rl.model.shared_prefix`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
from collections.abc import Mapping, Sequence

import torch

from fp8rl.fp8 import (
    E4M3,
    Fp8InferenceLinear,
    Fp8Linear,
    Fp8Recipe,
    PayloadSpec,
    QKVScales,
    RefitPayload,
    WeightCache,
    check_qkv_scales,
    convert_model,
    load_qkv_scales,
)
from fp8rl.model import CausalLM, KVCache, Routing, routing
from fp8rl.model.lora import LoraSettings, apply_lora, share_adapters
from fp8rl.model.moe import SparseMoeBlock
from fp8rl.model.mrope import mrope_positions
from fp8rl.model.vision import ImageBatch

from .base import RolloutEngine, Sample, SamplingParams, ShouldStop, WeightLoadError, check_stop, served_version
from .kv_sessions import KVSession, SessionStore, seed_cache

log = logging.getLogger(__name__)

__all__ = ["TorchRolloutEngine", "sample_next"]


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from ``logits`` ``(B, V)``; return ``(tokens, logprobs)`` both ``(B,)``."""
    if params.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logits.argmax(dim=-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits / params.temperature, dim=-1)  # (B, V)
    probs = logp.exp()
    if params.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always survives)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        # a top_p below FP32's smallest value compares as 0 >= 0: keep the top token whatever top_p is
        drop[..., 0] = False
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


class TorchRolloutEngine(RolloutEngine):
    """Embedded rollout engine.

    Args:
        model: a high-precision :class:`CausalLM`; the engine converts its own deep copy (``take_model``: the
            model itself, which the caller hands over and does not use again — a service's freshly loaded policy,
            so the process never holds two copies of it).
        recipe: the rollout's :class:`Fp8Recipe` (``recipe_for_role(job_recipe, "rollout")``).
        eos_token_ids: tokens that end a sample.
        initial_version: weight version of ``model``'s weights (served once QKV scales for it are
            loaded when the KV cache is FP8).
        max_batch_size: rows decoded together (prompts × n are chunked to this).
        pad_token_id: filler for left padding.
        seed: seeds the engine's RNG for requests without their own seed.
        record_routes: a mixture-of-experts model's samples carry the experts every fed token used
            (:attr:`Sample.routes`: what routing replay gives the trainer).
        shared_with: the trainer's model (same parameter names as ``model``): share its tensors instead of copying
            them (see the module docstring); refits are then :meth:`follow`.
        lora: LoRA adapters on every targeted projection (``policy.lora``; :mod:`fp8rl.model.lora`), computed as the
            trainer computes them; a refit then carries the base and adapters, or the adapters alone. Shared with the
            trainer's model: its adapters are served (the same parameter objects).
        session_cache_bytes: the bound on the K/V (and routes) kept for ``generate(..., sessions=)`` between
            calls; least recently used sessions are evicted past it (:mod:`.kv_sessions`).
    """

    def __init__(
        self,
        model: CausalLM,
        recipe: Fp8Recipe,
        *,
        eos_token_ids: Sequence[int],
        initial_version: int = 0,
        max_batch_size: int = 64,
        pad_token_id: int = 0,
        seed: int = 0,
        record_routes: bool = False,
        shared_with: torch.nn.Module | None = None,
        take_model: bool = False,
        lora: LoraSettings | None = None,
        session_cache_bytes: int = 256 * 2**20,
    ) -> None:
        self.recipe = recipe
        if take_model and shared_with is not None:
            raise ValueError("take_model and shared_with exclude each other: a shared engine keeps the trainer's "
                             "tensors, a taken model is converted in place")
        self._shared = shared_with
        self._shared_caches: dict[str, WeightCache] = {}  # FP8 layer -> the trainer's cache it takes its form from
        # FP8 layer -> (it, the trainer's layer it quantizes, that weight's version counter at the refit)
        self._own_forms: dict[str, tuple[Fp8InferenceLinear, torch.nn.Module, int]] = {}
        if shared_with is None:
            self.model = convert_model(model if take_model else copy.deepcopy(model), recipe,
                                       mode="inference").eval()
            for p in self.model.parameters():
                p.requires_grad_(False)
        else:  # the module structure copied, every parameter the trainer's own object (never its requires_grad)
            theirs = dict(shared_with.named_parameters())
            # a frozen LoRA base's FP8 linears hold their E4M3 form only (Fp8Linear.freeze): served from there below
            frozen = {n for n, b in shared_with.named_buffers() if b.dtype == E4M3}
            missing = sorted(n for n, _ in model.named_parameters() if n not in theirs and n not in frozen)
            if missing:
                raise ValueError(f"shared_with lacks parameters of the model: {missing[:3]}")
            memo = {id(p): theirs.get(n, p) for n, p in model.named_parameters()}
            self.model = convert_model(copy.deepcopy(model, memo), recipe, mode="inference").eval()
            self._take_fp8_forms(first=True)
        if lora is not None:  # after conversion (it swaps the linears); a shared engine serves the trainer's adapters
            apply_lora(self.model, lora, seed=seed, freeze=shared_with is None)
            if shared_with is not None:
                share_adapters(self.model, shared_with)
        # what every refit payload must hold (or, with LoRA, the adapters alone after the base)
        self._spec = PayloadSpec.for_model(self.model)
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_batch_size = max_batch_size
        self.pad_token_id = pad_token_id
        self._version: int | None = initial_version
        self._lock = threading.RLock()
        self._rng = torch.Generator().manual_seed(seed)
        self.max_len = model.config.max_position_embeddings
        self.record_routes = record_routes and self.model.num_moe_layers > 0
        # expert ids as uint8 while they fit (at most 256 experts), else int16
        self._route_dtype = torch.uint8 if model.config.num_experts <= 256 else torch.int16
        self._sessions = SessionStore(session_cache_bytes)

    # ------------------------------------------------------------------ versions and refit
    @property
    def weight_version(self) -> int | None:
        return self._version

    @property
    def scales_version(self) -> int | None:
        qs = self.model.kv_quantizers
        return qs[0].version if qs else None

    def load_weights(
        self, version: int, tensors: Mapping[str, torch.Tensor], qkv_scales: QKVScales | None = None
    ) -> None:
        if self._shared is not None:
            raise WeightLoadError("this engine shares the trainer's weights (shared_with): a refit is follow(version), "
                                  "never a copy into them")
        spec = self._spec.for_payload(tensors, self._version)  # LoRA: the adapters alone on the base held
        payload = RefitPayload.create(spec, version, tensors, qkv_scales, held=self._version).process()
        with self._lock:
            payload.apply(self.model)  # weights and the same version's QKV scales together
            self._version = version
            self._sessions.clear()  # K/V of the old weights: never served with the new ones
        log.info("rollout engine now serves weight version %d", version)

    def follow(self, version: int, qkv_scales: QKVScales | None = None) -> None:
        """The refit of a shared engine: the trainer's tensors hold ``version`` now; take the FP8 forms of its
        weights and the same version's QKV scales (required with an FP8 KV cache), and serve ``version``."""
        if self._shared is None:
            raise WeightLoadError("follow() is the refit of an engine made with shared_with; this one holds its own "
                                  "copy (load_weights)")
        scales = check_qkv_scales(qkv_scales, version, self._spec.num_kv_layers, holder="the refit is")
        if qkv_scales is not None and scales is None:
            raise WeightLoadError("QKV scales given, but this engine's KV cache is not FP8")
        with self._lock:
            self._take_fp8_forms()
            if scales is not None:
                load_qkv_scales(self.model, scales)
            self._version = version
            self._sessions.clear()
        log.info("rollout engine now serves weight version %d (shared weights)", version)

    @torch.no_grad()
    def _take_fp8_forms(self, *, first: bool = False) -> None:
        """Point every FP8 layer at the E4M3 form of the shared weight: the trainer's cached one where its layer
        keeps one (the trainer's recipe quantizes that layer the same way), else the layer's own, quantized here
        from the trainer's weight while the engine generates only (:meth:`_dequantized_while_generating`) — between
        generations the trainer's step needs that memory (issue 30); ``first`` (construction) quantizes them once
        so the payload spec sees their shapes (released when the first generation ends). Biases copied (a few
        floats per layer)."""
        theirs = dict(self._shared.named_modules())
        self._shared_caches, self._own_forms = {}, {}
        for name, mine in self.model.named_modules():
            if not isinstance(mine, Fp8InferenceLinear):
                continue
            src = theirs[name]
            cache = getattr(src, "weight_cache", None)
            if (isinstance(src, Fp8Linear) and cache is not None
                    and (src.pow2_weight_scale, src.scaling) == (mine.pow2_weight_scale, mine.scaling)):
                q, scale = cache.get(src.weight, src.pow2_weight_scale, mine.fmt)
                mine.weight, mine.weight_scale = q, scale
                self._shared_caches[name] = cache
                if src.bias is not None:
                    mine.bias.copy_(src.bias)
            else:  # quantized from the trainer's weight of this version when generating: its version counter now
                self._own_forms[name] = (mine, src, src.weight._version)
                if first:  # held until the first generation ends
                    mine.load_weight(src.weight, src.bias, name=f"{name}.weight")
                else:
                    mine.release_weight()
            mine._w_dequant = None  # taken while generating only (_dequantized_while_generating), not from a refit on

    @contextlib.contextmanager
    def _dequantized_while_generating(self):
        """A shared engine holds its FP8 layers' FP32 dequantizations (reference backend) — and the E4M3 forms it
        quantizes itself (layers whose trainer keeps no FP8 cache: ``fp8_gen_only``) — only while it generates:
        taken from the trainer's cache of the same E4M3 form (or quantized from the trainer's weight, which must
        still be the one the last refit served) at the start, released at the end. The numbers are the same either
        way; an engine with its own copy keeps them (a rollout service generates all the time)."""
        if self._shared is None:
            yield
            return
        layers = [(n, m) for n, m in self.model.named_modules() if isinstance(m, Fp8InferenceLinear)]
        try:
            for name, mine in layers:
                own = self._own_forms.get(name)
                if own is not None:
                    _, src, seen = own
                    if src.weight._version != seen:
                        raise RuntimeError(
                            f"{name}: the trainer's weight changed since the refit to version {self._version}; a "
                            f"shared engine generates only between a refit (follow) and the next train step")
                    mine.load_weight(src.weight, src.bias, name=f"{name}.weight")  # dequantizes too
                elif mine._w_dequant is None:
                    cache = self._shared_caches.get(name)
                    if cache is not None and cache.q is mine.weight:  # still the E4M3 form this engine serves
                        mine._w_dequant = cache.dequantize_held()
                    else:
                        mine._refresh_cache()
            yield
        finally:
            for name, mine in layers:
                if name in self._own_forms:
                    mine.release_weight()
                mine._w_dequant = None
            for m in self.model.modules():  # grouped experts' stacked weights (fp8rl.model.grouped)
                if isinstance(m, SparseMoeBlock):
                    m.drop_stacks()

    def load_scales(self, qkv_scales: QKVScales) -> None:
        """Install QKV scales for the version already held (the first calibration, before any refit)."""
        with self._lock:
            if check_qkv_scales(qkv_scales, self._version, self._spec.num_kv_layers, holder="the engine holds") is None:
                raise WeightLoadError("QKV scales given, but this engine's KV cache is not FP8")
            load_qkv_scales(self.model, qkv_scales)
            self._sessions.clear()  # E4M3 K/V quantized with other scales

    # ------------------------------------------------------------------ KV sessions
    def drop_session(self, key: str) -> bool:
        """Forget the K/V kept for session ``key`` (a finished trajectory); whether any were kept."""
        with self._lock:
            return self._sessions.drop(key)

    def session_stats(self) -> dict[str, int]:
        """Counters of the KV sessions: ``hits``, ``misses``, ``evictions``, ``prefill_tokens``, ``reused_tokens``
        (:class:`~fp8rl.engines.kv_sessions.SessionStore`), and the ``entries`` and ``bytes`` held now. Read without
        the engine lock, so a status call never waits behind a long generation: each counter is one int read, the
        set of them may be a few tokens apart while a call runs."""
        return self._sessions.stats()

    # ------------------------------------------------------------------ generation
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, weight_version: int | None = None,
        should_stop: ShouldStop | None = None, sessions: Sequence[str | None] | None = None,
        images: Sequence[ImageBatch | None] | None = None,
    ) -> list[Sample]:
        """:meth:`RolloutEngine.generate`; with ``sessions`` (one key or None per prompt, ``params.n`` 1), row ``i``
        reuses the K/V kept for ``sessions[i]`` where they cover a prefix of ``prompts[i]`` at the served weight
        and QKV scales versions, and keeps its K/V for every token it fed — the prompt and the generated tokens
        but the last — under that key afterwards (:mod:`.kv_sessions`). Under batch invariance the samples are
        bitwise those of the same call without ``sessions``.

        ``images`` (a vision-language model): per prompt, its images (:class:`~fp8rl.model.vision.ImageBatch`, in
        the order of its image-token runs) or None. Each prompt's images are encoded once and shared by its ``n``
        samples, which carry them (``Sample.images``) to the trainer; a call with images prefills its prompts whole
        (no KV reuse: the reuse keys are token prefixes, which do not tell images apart) and takes no sessions."""
        if images is not None:
            if len(images) != len(prompts):
                raise ValueError(f"images has {len(images)} entries for {len(prompts)} prompts")
            if not any(i is not None for i in images):
                images = None
            elif getattr(self.model, "visual", None) is None:
                raise ValueError(f"{self.model.config.architecture} takes no images")
            elif sessions is not None:
                raise ValueError("KV sessions do not take images yet (a multi-turn trajectory is text)")
        keys: list[str | None] = [None] * (len(prompts) * params.n)
        if sessions is not None:
            if params.n != 1:
                raise ValueError(f"sessions need one sample per prompt (params.n = 1), got n = {params.n}")
            if len(sessions) != len(prompts):
                raise ValueError(f"sessions has {len(sessions)} keys for {len(prompts)} prompts")
            named = [k for k in sessions if k is not None]
            if len(set(named)) != len(named):
                raise ValueError(f"a session key appears twice in one call: {sorted(named)}")
            keys = list(sessions)
        with self._lock:
            check_stop(should_stop, "generation")  # gone while it waited for the engine: never start
            held = served_version(weight_version, self._version)
            for qz in self.model.kv_quantizers:
                qz.require_version(held)
            for i, p in enumerate(prompts):
                if len(p) == 0:
                    raise ValueError(f"prompt {i} is empty")
                if len(p) + params.max_tokens > self.max_len:
                    raise ValueError(
                        f"prompt {i} has {len(p)} tokens; with max_tokens={params.max_tokens} it exceeds the "
                        f"model's {self.max_len} positions"
                    )
            gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else self._rng
            rows = [(pi, tuple(p)) for pi, p in enumerate(prompts) for _ in range(params.n)]
            out: list[Sample] = []
            with self._dequantized_while_generating():
                encoded = None
                if images is not None:  # once per prompt, shared by its samples
                    with torch.no_grad():
                        encoded = [self.model.encode_images(i) if i is not None else None for i in images]
                for start in range(0, len(rows), self.max_batch_size):
                    chunk = slice(start, start + self.max_batch_size)
                    out += self._generate_rows(rows[chunk], params, gen, held, should_stop, keys[chunk],
                                               images, encoded)
            return out

    @torch.no_grad()
    def _generate_rows(self, rows, params: SamplingParams, gen, version: int, should_stop: ShouldStop | None,
                       keys: Sequence[str | None], images=None, encoded=None) -> list[Sample]:
        B = len(rows)
        P = max(len(p) for _, p in rows)
        firsts = [P - len(p) for _, p in rows]  # left padding: every row's last prompt token at slot P-1
        ids = torch.full((B, P), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(B, P + params.max_tokens, dtype=torch.long)
        for b, (_, p) in enumerate(rows):
            ids[b, firsts[b]:] = torch.tensor(p)
            mask[b, firsts[b]:] = 1
        scales = self.scales_version
        found = [self._sessions.lookup(k, p, version, scales) if k is not None else None
                 for k, (_, p) in zip(keys, rows, strict=True)]
        if not self.record_routes and encoded is None:  # (a donor's routes would have to be recorded too: not yet)
            found = self._shared_prompts(rows, found, version, scales)
        # Ragged reuse: one prefill feeds slots [L, P) of every row, L = P - the longest uncovered suffix (a row's
        # last prompt token is always fed: its logits start the sampling). A row whose session covers more than
        # the slots before L has the rest re-fed (bitwise the same K/V under batch invariance); a row without one
        # is fed whole. Reused positions are copied into the cache first (seed_cache).
        covered = [min(len(s.tokens), P - f - 1) if s is not None else 0 for s, f in zip(found, firsts, strict=True)]
        L = P - max(P - f - c for f, c in zip(firsts, covered, strict=True))
        reuse = [max(0, L - f) for f in firsts]  # positions [0, reuse[b]) of row b come from its session
        self._sessions.prefill_tokens += B * P - sum(firsts) - sum(reuse)
        self._sessions.reused_tokens += sum(reuse)
        cache = KVCache.for_model(self.model, B, P + params.max_tokens)
        if L:
            seed_cache(cache, firsts, found, reuse, L, row_aligned=self.model.batch_invariance is not None)
        routes: list[torch.Tensor] = []  # per forward: (B, T, L, K) experts used (record_routes)
        batch_images, positions, delta = None, None, None
        if encoded is not None:  # prefilled whole (L = 0): the image-token runs place the multimodal positions
            batch_images = ImageBatch.concat([encoded[pi] for pi, _ in rows])
            if batch_images is not None:
                positions, delta = mrope_positions(ids, mask[:, :P], batch_images.grid_thw,
                                                   self.model.config.image_token_id, self.model.visual.merge,
                                                   batch_images.rows)
        logits = self._forward(ids[:, L:], mask[:, :P], cache, routes, positions, batch_images)  # (B, V)
        stops = torch.tensor(sorted(set(self.eos_token_ids) | set(params.stop_token_ids)), dtype=torch.long)
        tokens = torch.zeros(B, params.max_tokens, dtype=torch.long)
        logps = torch.zeros(B, params.max_tokens)
        done = torch.zeros(B, dtype=torch.bool)
        lengths = torch.full((B,), params.max_tokens, dtype=torch.long)
        for t in range(params.max_tokens):
            check_stop(should_stop, "generation")  # between decode steps: a gone caller frees the engine now
            tok, lp = sample_next(logits, params, gen)
            tokens[:, t], logps[:, t] = tok, lp
            hit = torch.isin(tok, stops) & ~done
            lengths[hit] = t + 1
            done |= hit
            if bool(done.all()) or t == params.max_tokens - 1:
                break
            mask[:, P + t] = 1
            # text after the images: its position is its index shifted by the row's delta
            step_pos = None if delta is None else (mask[:, :P + t + 1].sum(-1) - 1 + delta)[:, None]
            logits = self._forward(tok[:, None], mask[:, :P + t + 1], cache, routes, step_pos)
        fed = torch.cat(routes, dim=1) if routes else None  # (B, P - L + steps, L, K): slot order from slot L
        samples = []
        for b, (pi, p) in enumerate(rows):
            n = int(lengths[b])
            row_routes = None
            if fed is not None:
                # the row's prompt (left padding dropped) and its generated tokens but the last (never fed); reused
                # positions take the routes recorded when they were fed
                row_routes = fed[b, firsts[b] + reuse[b] - L:P + n - 1 - L].clone()
                if reuse[b]:
                    row_routes = torch.cat([found[b].routes[:reuse[b]], row_routes])
            sample = Sample(
                prompt_index=pi, prompt_ids=p, token_ids=tuple(tokens[b, :n].tolist()),
                logprobs=tuple(logps[b, :n].tolist()),
                finish_reason="stop" if bool(done[b]) else "length",
                weight_version=version, routes=row_routes, images=images[pi] if images is not None else None,
            )
            samples.append(sample)
            if keys[b] is not None:  # every fed token: the prompt and the generated ones but the last
                self._sessions.put(keys[b], KVSession.from_cache(
                    cache, b, firsts[b], p + sample.token_ids[:-1], version, scales, row_routes))
        return samples

    def _shared_prompts(self, rows, found: list[KVSession | None], version: int, scales: int | None
                        ) -> list[KVSession | None]:
        """``found`` with a donor session for every row whose prompt another row of the call repeats (a GRPO
        group's ``n`` samples, the first turn of a group's trajectories) and whose own session covers less of it:
        each such prompt's tokens but the last are prefilled once, in one batch, and its rows are seeded from
        them as from a session hit — under batch invariance bitwise what prefilling every row gives
        (:mod:`.kv_sessions`). The donors are not kept."""
        def uncovered(p, s) -> bool:
            return len(p) >= 2 and (s is None or len(s.tokens) < len(p) - 1)

        count: dict[tuple[int, ...], int] = {}
        for (_, p), s in zip(rows, found, strict=True):
            if uncovered(p, s):
                count[p] = count.get(p, 0) + 1
        shared = [p for p, c in count.items() if c > 1]
        if not shared:
            return found
        fed = [p[:-1] for p in shared]
        G, P = len(fed), max(len(q) for q in fed)
        firsts = [P - len(q) for q in fed]
        ids = torch.full((G, P), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(G, P, dtype=torch.long)
        for g, q in enumerate(fed):
            ids[g, firsts[g]:] = torch.tensor(q)
            mask[g, firsts[g]:] = 1
        cache = KVCache.for_model(self.model, G, P)
        self._forward(ids, mask, cache, [])
        self._sessions.prefill_tokens += sum(len(q) for q in fed)
        donors = {p: KVSession.from_cache(cache, g, firsts[g], fed[g], version, scales, None)
                  for g, p in enumerate(shared)}
        return [donors[p] if p in donors and uncovered(p, s) else s for (_, p), s in zip(rows, found, strict=True)]

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, cache: KVCache, routes: list[torch.Tensor],
                 positions: torch.Tensor | None = None, images: ImageBatch | None = None) -> torch.Tensor:
        """One prefill or decode forward: the ``(B, V)`` logits of the last position (the head runs there only);
        with ``record_routes`` the ``(B, T, L, K)`` experts of every fed token appended to ``routes``. ``positions``
        and ``images``: a vision-language batch's (multimodal RoPE positions, the encoded images)."""
        kw = dict(attention_mask=mask, kv_cache=cache, logits_to_keep=1, position_ids=positions, images=images)
        if not self.record_routes:
            return self.model(ids, **kw)[:, -1]
        with routing(self.model, Routing(self.model.num_moe_layers, record=True)) as plan:
            logits = self.model(ids, **kw)[:, -1]
        used = plan.routes()  # (N, L, K)
        routes.append(used.view(*ids.shape, *used.shape[1:]).to(self._route_dtype))
        return logits
