"""Which parts of a model compute in FP8: the per-engine view of a job's precision recipe.

Job-level recipes (DESIGN §4) map to one :class:`Fp8Recipe` per role with :func:`recipe_for_role`:

=============  =============  =============
recipe         rollout        trainer
=============  =============  =============
bf16           bf16 linears   bf16 linears
fp8_gen_only   fp8 linears    bf16 linears
fp8_e2e        fp8 linears    fp8 linears
=============  =============  =============

``scaling`` (the job key ``policy.training.megatron_cfg.fp8_cfg.fp8_recipe``: ``blockwise``, ``mxfp8`` or
``tensorwise``, :mod:`fp8rl.fp8.formats`) is the same for every role: rollout and trainer quantize the same master
weights the same way.

``kv_cache_dtype: fp8`` applies to the rollout engine only (the trainer computes attention in high
precision, as the reference does); the calibrator computes the scales the rollout uses. With
``batch_invariant`` the trainer quantizes Q/K/V too, with the scales the rollout used for the version
it recomputes (so its logprobs are bitwise the rollout's); the calibrator still runs high precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .formats import DEFAULT_SCALING, SCALINGS, LinearFormat, linear_format

__all__ = ["Fp8Recipe", "RECIPES", "recipe_for_role"]

RECIPES = ("bf16", "fp8_gen_only", "fp8_e2e")
Role = Literal["rollout", "trainer", "calibrator"]


@dataclass(frozen=True)
class Fp8Recipe:
    """FP8 settings of one engine.

    Attributes:
        linear: ``"fp8"`` quantizes the transformer layers' linear projections; ``"bf16"`` leaves them alone.
        scaling: how FP8 linears scale their operands: a registered format's name (:mod:`fp8rl.fp8.formats`;
            :attr:`format` is the format itself).
        num_first_layers_in_bf16: keep this many leading transformer layers in high precision.
        num_last_layers_in_bf16: keep this many trailing transformer layers in high precision.
        pow2_weight_scaling_factors: round weight block scales up to powers of two.
        pow2_activation_scaling_factors: same for activation (and gradient) group scales.
        kv_cache_dtype: ``"fp8"`` stores K/V in E4M3 with calibrated per-tensor scales.
        fp8_attention: with an FP8 KV cache, also round Q and the softmax probabilities to E4M3.
        batch_invariant: GEMMs over whole row tiles and split-KV attention with a fixed chunk
            (:mod:`fp8rl.model.invariant`), so a token's numbers do not depend on the batch, on decode
            vs full forward or on padding: the rollout's and the trainer's logprobs are bitwise equal.
        fp8_vision_encoder: a vision-language model's encoder linears (its blocks' attention and MLP, the
            mergers) in FP8 too, in the same format; off, the encoder stays in high precision whatever the recipe.
        mla_absorbed: multi-head latent attention in its absorbed form (:mod:`fp8rl.model.mla`; the default) or
            the expanded one — which a job whose trainer is Megatron-Core's (expanded) MLA runs on every side.
    """

    linear: Literal["bf16", "fp8"] = "fp8"
    scaling: str = DEFAULT_SCALING
    num_first_layers_in_bf16: int = 0
    num_last_layers_in_bf16: int = 0
    pow2_weight_scaling_factors: bool = False
    pow2_activation_scaling_factors: bool = False
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    fp8_attention: bool = True
    batch_invariant: bool = False
    fp8_vision_encoder: bool = False
    mla_absorbed: bool = True

    @property
    def format(self) -> LinearFormat:
        """The FP8 format of :attr:`scaling` (:func:`~fp8rl.fp8.formats.linear_format`)."""
        return linear_format(self.scaling)

    def __post_init__(self) -> None:
        if self.linear not in ("bf16", "fp8"):
            raise ValueError(f"Fp8Recipe.linear must be 'bf16' or 'fp8', got {self.linear!r}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"Fp8Recipe.scaling must be one of {', '.join(SCALINGS)}, got {self.scaling!r}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"Fp8Recipe.kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        for key in ("num_first_layers_in_bf16", "num_last_layers_in_bf16"):
            if getattr(self, key) < 0:
                raise ValueError(f"Fp8Recipe.{key} must be >= 0, got {getattr(self, key)}")

    @property
    def fp8_linears(self) -> bool:
        return self.linear == "fp8"

    @property
    def fp8_kv(self) -> bool:
        return self.kv_cache_dtype == "fp8"

    def layer_in_fp8(self, index: int, num_layers: int) -> bool:
        """Whether transformer layer ``index`` (0-based) of ``num_layers`` uses FP8 linears."""
        if not self.fp8_linears:
            return False
        return self.num_first_layers_in_bf16 <= index < num_layers - self.num_last_layers_in_bf16


def recipe_for_role(
    recipe: str,
    role: Role,
    *,
    kv_cache_dtype: str = "auto",
    num_first_layers_in_bf16: int = 0,
    num_last_layers_in_bf16: int = 0,
    pow2_weight_scaling_factors: bool = False,
    pow2_activation_scaling_factors: bool = False,
    fp8_attention: bool = True,
    batch_invariant: bool = False,
    scaling: str = DEFAULT_SCALING,
    fp8_vision_encoder: bool = False,
    mla_absorbed: bool = True,
) -> Fp8Recipe:
    """The :class:`Fp8Recipe` one role runs under a job-level ``recipe`` (see the module table)."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}: expected one of {', '.join(RECIPES)}")
    if role not in ("rollout", "trainer", "calibrator"):
        raise ValueError(f"unknown role {role!r}")
    fp8_lin = recipe == "fp8_e2e" or (recipe == "fp8_gen_only" and role == "rollout")
    return Fp8Recipe(
        linear="fp8" if fp8_lin else "bf16",
        scaling=scaling,
        num_first_layers_in_bf16=num_first_layers_in_bf16,
        num_last_layers_in_bf16=num_last_layers_in_bf16,
        pow2_weight_scaling_factors=pow2_weight_scaling_factors,
        pow2_activation_scaling_factors=pow2_activation_scaling_factors,
        # the trainer quantizes Q/K/V as the rollout did only when it computes the rollout's numbers exactly
        kv_cache_dtype=kv_cache_dtype if role == "rollout" or (role == "trainer" and batch_invariant)
        else "auto",  # type: ignore[arg-type]
        fp8_attention=fp8_attention,
        batch_invariant=batch_invariant,
        fp8_vision_encoder=fp8_vision_encoder,
        mla_absorbed=mla_absorbed,
    )
