"""The measurements: one rollout batch, then its logprobs recomputed under one divergence source at a time.

Every number here comes from the engines' and the model's own code: the rollout is
:class:`~fp8rl.engines.torch_rollout.TorchRolloutEngine` (decode with a KV cache), the trainer's recompute
is :meth:`~fp8rl.engines.torch_trainer.TorchTrainer.compute_logprobs`, and each variant is a deep copy
of the high-precision model converted by :func:`fp8rl.fp8.convert_model` with a recipe that turns one
source on. The two attention sources are split with quantizers that switch part of
:class:`~fp8rl.fp8.QKVQuantizer` off (its own rounding otherwise): nothing re-implements the numerics.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from fp8rl.engines.base import SamplingParams, TrainBatch
from fp8rl.engines.batch import build_train_batch
from fp8rl.engines.calibrator import QKVCalibrator
from fp8rl.engines.logprob_pass import sequence_logprobs
from fp8rl.engines.torch_rollout import TorchRolloutEngine
from fp8rl.engines.torch_trainer import TorchTrainer, TrainerConfig
from fp8rl.fp8 import (
    DEFAULT_SCALING,
    RECIPES,
    SCALINGS,
    Fp8Recipe,
    QKVQuantizer,
    QKVScales,
    convert_model,
    load_qkv_scales,
    recipe_for_role,
)
from fp8rl.model import CausalLM
from fp8rl.rl.metrics import max_abs_logprob_diff, token_mult_prob_error, token_mult_prob_error_stderr

from .result import LayerRow, SourceRow

__all__ = ["ObservatoryConfig", "Probe", "full_forward_logprobs"]

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ObservatoryConfig:
    """What to observe: the job-level recipe, the rollout's sampling, and the suggestion's target and budget.

    Attributes:
        recipe: ``bf16`` | ``fp8_gen_only`` | ``fp8_e2e`` (mapped per engine by :func:`fp8rl.fp8.recipe_for_role`).
        kv_cache_dtype: the rollout's KV cache, ``auto`` | ``fp8``.
        fp8_recipe: the FP8 linears' scaling, both engines: ``blockwise`` | ``mxfp8`` | ``tensorwise``
            (:mod:`fp8rl.fp8.formats`).
        fp8_attention: with an FP8 KV cache, round Q and the softmax probabilities to E4M3 too.
        num_first_layers_in_bf16, num_last_layers_in_bf16: the observed recipe's bf16 layers.
        batch_invariant: both engines in batch-invariant numerics.
        n: samples per prompt.
        max_tokens: most generated tokens per sample.
        temperature: sampling temperature (0: greedy, temperature-1 logprobs), also the recompute's.
        seed: the sampler's seed (every candidate of the suggestion samples with it).
        micro_batch_size: rows per full-forward pass.
        target: the mismatch the suggestion must reach (DESIGN §4: 1.03–1.05 is the usual acceptable
            ``token_mult_prob_error``; the default takes the strict end).
        max_bf16_layers: the suggestion's budget: it tries ``first + last`` = 0, 1, ... up to this.
        layer_logprobs: also measure, per layer, the mismatch with only that layer's linears in FP8 (one
            full forward per layer; the suggestion ranks layers by it, else by their relative error).
    """

    recipe: str = "fp8_e2e"
    kv_cache_dtype: str = "fp8"
    fp8_recipe: str = DEFAULT_SCALING
    fp8_attention: bool = True
    num_first_layers_in_bf16: int = 0
    num_last_layers_in_bf16: int = 0
    batch_invariant: bool = False
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    seed: int = 0
    micro_batch_size: int = 16
    target: float = 1.03
    max_bf16_layers: int = 4
    layer_logprobs: bool = True

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"ObservatoryConfig.recipe must be one of {', '.join(RECIPES)}, got {self.recipe!r}")
        if self.fp8_recipe not in SCALINGS:
            raise ValueError(f"ObservatoryConfig.fp8_recipe must be one of {', '.join(SCALINGS)}, got "
                             f"{self.fp8_recipe!r}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"ObservatoryConfig.kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        for key in ("n", "max_tokens", "micro_batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"ObservatoryConfig.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("num_first_layers_in_bf16", "num_last_layers_in_bf16", "max_bf16_layers"):
            if getattr(self, key) < 0:
                raise ValueError(f"ObservatoryConfig.{key} must be >= 0, got {getattr(self, key)}")
        if not self.target >= 1.0:
            raise ValueError(f"ObservatoryConfig.target is a token_mult_prob_error, >= 1.0; got {self.target}")
        if self.temperature < 0:
            raise ValueError(f"ObservatoryConfig.temperature must be >= 0, got {self.temperature}")

    def recipe_for(self, role: str, first: int | None = None, last: int | None = None) -> Fp8Recipe:
        """The role's :class:`Fp8Recipe`, with ``first`` / ``last`` bf16 layers (default: the observed ones)."""
        return recipe_for_role(
            self.recipe, role, kv_cache_dtype=self.kv_cache_dtype, fp8_attention=self.fp8_attention,
            num_first_layers_in_bf16=self.num_first_layers_in_bf16 if first is None else first,
            num_last_layers_in_bf16=self.num_last_layers_in_bf16 if last is None else last,
            batch_invariant=self.batch_invariant, scaling=self.fp8_recipe)


class _QKVOnly(QKVQuantizer):
    """Source (b): Q (with FP8 attention), K and V rounded as the rollout rounds them; the probabilities not."""

    def round_probs(self, p: torch.Tensor) -> torch.Tensor:
        return p


class _ProbsOnly(QKVQuantizer):
    """Source (c): only the softmax probabilities rounded to E4M3 (with FP8 attention); Q/K/V untouched."""

    def fake_quantize_q(self, q: torch.Tensor) -> torch.Tensor:
        return q

    def fake_quantize_kv(self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v


@torch.no_grad()
def full_forward_logprobs(model: CausalLM, batch: TrainBatch, *, temperature: float = 1.0,
                          micro_batch_size: int = 16) -> torch.Tensor:
    """``(B, T)`` logprobs of every token from full-sequence forwards (the trainer's order), ``micro_batch_size``
    rows at a time."""
    rows = batch.input_ids.shape[0]
    return torch.cat([sequence_logprobs(model, batch.input_ids[a:a + micro_batch_size],
                                        batch.attention_mask[a:a + micro_batch_size], temperature)
                      for a in range(0, rows, micro_batch_size)])


def compare(name: str, on: bool, compared: str, logprobs: torch.Tensor, baseline: torch.Tensor,
            mask: torch.Tensor) -> SourceRow:
    """A :class:`SourceRow` of ``logprobs`` against ``baseline`` over the generated tokens ``mask``."""
    m = mask.bool()
    d = (logprobs.double() - baseline.double())[m].abs()  # (num_tokens,)
    se, seqs, tokens = token_mult_prob_error_stderr(logprobs, baseline, m)
    return SourceRow(name, on, compared, float(token_mult_prob_error(logprobs, baseline, m)),
                     float(d.mean()) if d.numel() else 0.0, max_abs_logprob_diff(logprobs, baseline, m), se, seqs,
                     tokens)


class Probe:
    """Runs the engines and the source variants on one model and one set of prompts.

    Args:
        model: the high-precision policy (never modified: every engine and variant works on a deep copy).
        prompts: token ids of each prompt.
        config: what to observe.
        pad_token_id: filler for padding.
        eos_token_ids: tokens that end a sample.
        progress: called with a line per phase (e.g. ``print``), or None.
    """

    def __init__(self, model: CausalLM, prompts: Sequence[Sequence[int]], config: ObservatoryConfig, *,
                 pad_token_id: int = 0, eos_token_ids: Sequence[int] = (2,), progress: Progress | None = None) -> None:
        if not prompts:
            raise ValueError("the observatory needs at least one prompt")
        self.model, self.prompts, self.cfg = model, [list(p) for p in prompts], config
        self.pad, self.eos = pad_token_id, tuple(eos_token_ids)
        self.say = progress or (lambda _msg: None)
        self.num_layers = model.num_layers
        self.scales: QKVScales | None = None
        if config.kv_cache_dtype == "fp8":  # the loop's first calibration: the prompts, high precision
            self.scales = QKVCalibrator(model, pad_token_id=pad_token_id).calibrate(0, self.prompts)

    # ------------------------------------------------------------------ the engines
    def rollout(self, first: int | None = None, last: int | None = None) -> tuple[TorchRolloutEngine, TrainBatch]:
        """Sample the prompts with the rollout engine under the recipe with ``first`` / ``last`` bf16 layers."""
        cfg = self.cfg
        engine = TorchRolloutEngine(self.model, cfg.recipe_for("rollout", first, last), eos_token_ids=self.eos,
                                    pad_token_id=self.pad, max_batch_size=max(1, len(self.prompts) * cfg.n),
                                    record_routes=True)  # a mixture-of-experts model's routes: the routing source
        if self.scales is not None:
            engine.load_scales(self.scales)
        samples = engine.generate(self.prompts, SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens,
                                                               n=cfg.n, seed=cfg.seed))
        batch = build_train_batch(samples, None, cfg.n, self.pad, advantages=torch.zeros(len(samples)),
                                  route_shape=self.model.config.route_shape)
        return engine, batch

    def trainer_logprobs(self, batch: TrainBatch, first: int | None = None, last: int | None = None, *,
                         replay: bool = False) -> torch.Tensor:
        """The trainer's recompute of ``batch`` under the recipe with ``first`` / ``last`` bf16 layers (with
        ``replay``, using the experts the rollout routed each token to)."""
        cfg = self.cfg
        trainer = TorchTrainer(self.model, cfg.recipe_for("trainer", first, last),
                               TrainerConfig(micro_batch_size=cfg.micro_batch_size, temperature=cfg.temperature,
                                             router_replay=replay, measure_unreplayed=False))
        if trainer.needs_qkv_scales:  # batch-invariant FP8 KV: the rollout's scales
            trainer.load_qkv_scales(self.scales)
        return trainer.compute_logprobs(batch)

    def total(self, first: int | None = None, last: int | None = None) -> tuple[TorchRolloutEngine, TrainBatch,
                                                                                 SourceRow]:
        """Rollout then trainer recompute under one bf16-layer setting: the mismatch a training step sees."""
        engine, batch = self.rollout(first, last)
        lp = self.trainer_logprobs(batch, first, last)
        row = compare("total", True, "rollout as it ran vs trainer recompute", lp, batch.gen_logprobs,
                      batch.loss_mask)
        return engine, batch, row

    # ------------------------------------------------------------------ the variants
    def variant(self, recipe: Fp8Recipe, quantizer: type[QKVQuantizer] = QKVQuantizer) -> CausalLM:
        """A converted deep copy of the high-precision model; with an FP8 KV recipe its layers hold
        ``quantizer`` instances with the calibrated scales."""
        model = convert_model(copy.deepcopy(self.model), recipe, mode="inference").eval()
        if recipe.fp8_kv:
            for layer in model.model.layers:
                layer.self_attn.kv_quant = quantizer(recipe.fp8_attention)
            load_qkv_scales(model, self.scales)
        return model

    def reference_recipe(self) -> Fp8Recipe:
        """High precision: bf16 linears, model-dtype attention, the observed batch invariance (so a source that is
        off leaves every number as it was)."""
        return Fp8Recipe(linear="bf16", kv_cache_dtype="auto", batch_invariant=self.cfg.batch_invariant)

    def linear_recipe(self) -> Fp8Recipe:
        """Source (a): the rollout's linears (its bf16 layers kept), high-precision attention."""
        rr = self.cfg.recipe_for("rollout")
        return replace(self.reference_recipe(), linear=rr.linear, num_first_layers_in_bf16=rr.num_first_layers_in_bf16,
                       num_last_layers_in_bf16=rr.num_last_layers_in_bf16)

    def logprobs(self, model: CausalLM, batch: TrainBatch) -> torch.Tensor:
        return full_forward_logprobs(model, batch, temperature=self.cfg.temperature,
                                     micro_batch_size=self.cfg.micro_batch_size)

    def sources(self, engine: TorchRolloutEngine, batch: TrainBatch, total: SourceRow,
                ref: CausalLM, lin: CausalLM) -> tuple[list[SourceRow], torch.Tensor]:
        """Per-source rows (``linear``, ``qkv``, ``probs``, ``decode``, ``rollout_numerics``, for a mixture-of-experts
        model ``routing``, then ``total``) and the high-precision logprobs of ``batch``."""
        rr, mask = engine.recipe, batch.loss_mask
        ref_lp = self.logprobs(ref, batch)
        hp = "high-precision full forward"
        rows = [compare("linear", rr.fp8_linears, f"FP8 linears ({rr.format.label}) vs {hp}",
                        self.logprobs(lin, batch), ref_lp, mask)]
        self.say("  source linear done")
        kv = replace(self.reference_recipe(), kv_cache_dtype=rr.kv_cache_dtype, fp8_attention=rr.fp8_attention)
        for name, quantizer, on, what in (
                ("qkv", _QKVOnly, rr.fp8_kv, "E4M3 Q/K/V (per-tensor scales)"),
                ("probs", _ProbsOnly, rr.fp8_kv and rr.fp8_attention, "E4M3 softmax probabilities")):
            rows.append(compare(name, on, f"{what} vs {hp}", self.logprobs(self.variant(kv, quantizer), batch),
                                ref_lp, mask))
            self.say(f"  source {name} done")
        rollout_ff = self.logprobs(engine.model, batch)  # the rollout's own converted model, full forward
        rows.append(compare("decode", not rr.batch_invariant, "rollout decode (KV cache) vs its full forward",
                            batch.gen_logprobs, rollout_ff, mask))
        rows.append(compare("rollout_numerics", True, f"rollout recipe, full forward vs {hp}", rollout_ff, ref_lp,
                            mask))
        if batch.routes is not None:  # a mixture-of-experts model: what routing flips alone cost the trainer
            rows.append(compare("routing", True, "trainer recompute, its own routing vs the rollout's experts "
                                "(replayed)", self.trainer_logprobs(batch), self.trainer_logprobs(batch, replay=True),
                                mask))
            self.say("  source routing done")
        rows.append(total)
        return rows, ref_lp

    # ------------------------------------------------------------------ per layer
    @torch.no_grad()
    def layers(self, batch: TrainBatch, ref: CausalLM, lin: CausalLM, ref_lp: torch.Tensor) -> list[LayerRow]:
        """Per-layer rows (see :mod:`fp8rl.observatory`): hidden-state relative errors from forward hooks, and
        the mismatch with only one layer's linears in FP8 when ``layer_logprobs``."""
        lin_all = self.variant(replace(self.reference_recipe(), linear="fp8"))  # every layer FP8: "if FP8"
        L, mb = self.num_layers, self.cfg.micro_batch_size
        sums = {k: torch.zeros(L, dtype=torch.float64) for k in ("den", "local", "alone", "cum")}
        for a in range(0, batch.input_ids.shape[0], mb):
            ids, attn = batch.input_ids[a:a + mb], batch.attention_mask[a:a + mb]
            valid = attn.bool()  # (B, T): real tokens only
            seen = _capture(ref, ids, attn, inputs=True)  # per layer: (args, output)
            cum = _capture(lin, ids, attn, inputs=False)
            for i, (args, out) in enumerate(seen):
                sums["den"][i] += _sq(out, valid)
                sums["local"][i] += _sq(lin.model.layers[i](*args) - out, valid)
                sums["alone"][i] += _sq(lin_all.model.layers[i](*args) - out, valid)
                sums["cum"][i] += _sq(cum[i][1] - out, valid)
        den = sums["den"].clamp_min(torch.finfo(torch.float64).tiny)
        rel = {k: (sums[k] / den).sqrt().tolist() for k in ("local", "alone", "cum")}
        alone_tmpe, alone_se = [float("nan")] * L, [float("nan")] * L
        if self.cfg.layer_logprobs:
            for i in range(L):
                hp_layer = ref.model.layers[i]
                ref.model.layers[i] = lin_all.model.layers[i]  # only layer i with FP8 linears
                try:
                    lp = self.logprobs(ref, batch)
                finally:
                    ref.model.layers[i] = hp_layer
                alone_tmpe[i] = float(token_mult_prob_error(lp, ref_lp, batch.loss_mask.bool()))
                alone_se[i] = token_mult_prob_error_stderr(lp, ref_lp, batch.loss_mask.bool())[0]
            self.say(f"  per-layer logprobs done ({L} forwards)")
        rr = self.cfg.recipe_for("rollout")
        return [LayerRow(i, rr.layer_in_fp8(i, L), rel["local"][i], rel["cum"][i], rel["alone"][i], alone_tmpe[i],
                         alone_se[i])
                for i in range(L)]


def _capture(model: CausalLM, ids: torch.Tensor, attn: torch.Tensor, *,
             inputs: bool) -> list[tuple[tuple, torch.Tensor]]:
    """One forward of ``model``; per decoder layer its positional inputs (when ``inputs``) and its output."""
    seen: list[tuple[tuple, torch.Tensor]] = []
    hooks = [layer.register_forward_hook(lambda _m, args, out: seen.append((args if inputs else (), out)))
             for layer in model.model.layers]
    try:
        model(ids, attention_mask=attn)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _sq(x: torch.Tensor, valid: torch.Tensor) -> float:
    """Sum of squares of ``x`` ``(B, T, C)`` over the real tokens ``valid`` ``(B, T)``, in FP64."""
    return float(x[valid].double().pow(2).sum())
