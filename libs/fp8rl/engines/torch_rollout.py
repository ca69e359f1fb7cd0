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

from .base import RolloutEngine, Sample, SamplingParams, ShouldStop, WeightLoadError, check_stop, served_version

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

    def load_scales(self, qkv_scales: QKVScales) -> None:
        """Install QKV scales for the version already held (the first calibration, before any refit)."""
        with self._lock:
            if check_qkv_scales(qkv_scales, self._version, self._spec.num_kv_layers, holder="the engine holds") is None:
                raise WeightLoadError("QKV scales given, but this engine's KV cache is not FP8")
            load_qkv_scales(self.model, qkv_scales)

    # ------------------------------------------------------------------ generation
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, weight_version: int | None = None,
        should_stop: ShouldStop | None = None,
    ) -> list[Sample]:
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
                for start in range(0, len(rows), self.max_batch_size):
                    out += self._generate_rows(rows[start:start + self.max_batch_size], params, gen, held,
                                               should_stop)
            return out

    @torch.no_grad()
    def _generate_rows(self, rows, params: SamplingParams, gen, version: int,
                       should_stop: ShouldStop | None) -> list[Sample]:
        B = len(rows)
        P = max(len(p) for _, p in rows)
        ids = torch.full((B, P), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(B, P + params.max_tokens, dtype=torch.long)
        for b, (_, p) in enumerate(rows):  # left padding: every row's last prompt token at slot P-1
            ids[b, P - len(p):] = torch.tensor(p)
            mask[b, P - len(p):] = 1
        cache = KVCache.for_model(self.model, B, P + params.max_tokens)
        routes: list[torch.Tensor] = []  # per forward: (B, T, L, K) experts used (record_routes)
        logits = self._forward(ids, mask[:, :P], cache, routes)  # (B, V)
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
            logits = self._forward(tok[:, None], mask[:, :P + t + 1], cache, routes)
        fed = torch.cat(routes, dim=1) if routes else None  # (B, P + steps, L, K): slot order
        samples = []
        for b, (pi, p) in enumerate(rows):
            n = int(lengths[b])
            samples.append(Sample(
                prompt_index=pi, prompt_ids=p, token_ids=tuple(tokens[b, :n].tolist()),
                logprobs=tuple(logps[b, :n].tolist()),
                finish_reason="stop" if bool(done[b]) else "length",
                weight_version=version,
                # the row's prompt (left padding dropped) and its generated tokens but the last (never fed)
                routes=None if fed is None else fed[b, P - len(p):P + n - 1].clone(),
            ))
        return samples

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, cache: KVCache, routes: list[torch.Tensor]
                 ) -> torch.Tensor:
        """One prefill or decode forward: the ``(B, V)`` logits of the last position (the head runs there only);
        with ``record_routes`` the ``(B, T, L, K)`` experts of every fed token appended to ``routes``."""
        if not self.record_routes:
            return self.model(ids, attention_mask=mask, kv_cache=cache, logits_to_keep=1)[:, -1]
        with routing(self.model, Routing(self.model.num_moe_layers, record=True)) as plan:
            logits = self.model(ids, attention_mask=mask, kv_cache=cache, logits_to_keep=1)[:, -1]
        used = plan.routes()  # (N, L, K)
        routes.append(used.view(*ids.shape, *used.shape[1:]).to(self._route_dtype))
        return logits
