"""The blockwise-FP8 checkpoint layout of the Hub (``--format hf-fp8``): what DeepSeek-V3, Qwen3-FP8 and vLLM's
``fp8`` method with ``weight_block_size`` read.

* each linear the recipe runs in FP8 (every transformer layer's projections and experts, but the layers
  ``num_first_layers_in_bf16`` / ``num_last_layers_in_bf16`` keep) is stored as ``X.weight`` in
  ``float8_e4m3fn`` plus ``X.weight_scale_inv``: FP32, one per 128×128 block, ``ceil(N/128) × ceil(K/128)``;
* everything else — embeddings, norms, biases, ``lm_head``, the MoE router (``mlp.gate``) and the linears
  of the high-precision layers — as it is, in the checkpoint's dtype, and named in ``modules_to_not_convert``;
* ``config.json`` gets ``quantization_config``: ``{"quant_method": "fp8", "fmt": "e4m3",
  "activation_scheme": "dynamic", "weight_block_size": [128, 128], "modules_to_not_convert": [...]}``
  (activations are quantized 1×128 at run time by the reader, as the rollout does).

Scale convention: the Hub's ``weight_scale_inv`` is the *dequantization multiplier* — DeepSeek's
``weight_dequant`` and transformers' ``Fp8Dequantize`` compute ``w = q.float() * weight_scale_inv`` — which is
exactly fp8rl's ``weight_scale`` (``x ≈ q.float() * scale``, :mod:`fp8rl.fp8.quant`). So it is stored as it
is, never inverted; the name is the Hub's (the inverse of the *quantization* scale ``448 / amax``).

Invariant: the E4M3 bytes and scales are :func:`fp8rl.fp8.quantize_state_dict` of the master weights with the
recipe's ``pow2_weight_scaling_factors`` — bit for bit what the trainer's :class:`~fp8rl.fp8.Fp8Linear` and the
rollout's refit compute for the same version. Dimensions that are not multiples of 128 get a partial last
block, as the trainer's do; readers are stricter — transformers' dequantize-on-load needs whole blocks, vLLM 0.32
whole blocks in every part of a merged linear but the last (SmolLM2's 576-row ``q_proj`` is refused by both) — so
such an export logs a warning naming the linears (``--format hf`` has no such limit).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping

import torch
from torch import nn
from tqdm import tqdm

from fp8rl.fp8 import BLOCK, Fp8Recipe, fp8_linear_names, quantize_state_dict
from fp8rl.model import CausalLM, ModelConfig

log = logging.getLogger(__name__)

__all__ = ["SCALE_SUFFIX", "fp8_recipe_for_export", "hub_fp8_tensors", "quantization_config"]

SCALE_SUFFIX = "weight_scale_inv"  # the Hub's name of the per-block dequantization multiplier


def fp8_recipe_for_export(recipe: Fp8Recipe | None) -> Fp8Recipe:
    """The recipe whose FP8 linears an hf-fp8 export quantizes: the trainer's (its high-precision layers and
    power-of-two scales) with FP8 linears on — a ``bf16`` / ``fp8_gen_only`` trainer's rollout runs those
    same layers in FP8 (:func:`fp8rl.fp8.recipe_for_role` shares them); every layer in FP8 when None. Always
    blockwise, whatever the run's ``fp8_recipe`` (the layout is the Hub's 128x128 one: an mxfp8 or tensorwise run's
    master weights are quantized into it)."""
    recipe = recipe or Fp8Recipe()
    return Fp8Recipe(linear="fp8", num_first_layers_in_bf16=recipe.num_first_layers_in_bf16,
                     num_last_layers_in_bf16=recipe.num_last_layers_in_bf16,
                     pow2_weight_scaling_factors=recipe.pow2_weight_scaling_factors)


def _kept_modules(model: nn.Module, fp8: set[str], config: ModelConfig) -> list[str]:
    """Module names the reader must leave in high precision: every linear-like module not in ``fp8`` (the
    output head, the routers, the high-precision layers' projections) and, for a high-precision MoE layer,
    its ``mlp.experts`` (what transformers and vLLM call the fused experts module)."""
    kept = []
    for name, mod in model.named_modules():
        linear_like = isinstance(mod, nn.Linear) or name.endswith(".mlp.gate")  # the router is not nn.Linear
        if linear_like and name not in fp8:
            kept.append(name)
    for i in config.moe_layers:
        if not any(p.startswith(f"model.layers.{i}.mlp.experts.") for p in fp8):
            kept.append(f"model.layers.{i}.mlp.experts")
    return kept


def quantization_config(modules_to_not_convert: list[str]) -> dict:
    """The ``config.json`` entry of the layout (module docstring)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": list(modules_to_not_convert)}


@torch.no_grad()
def hub_fp8_tensors(tensors: Mapping[str, torch.Tensor], config: ModelConfig, recipe: Fp8Recipe | None, *,
                    progress: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    """HF-named master weights in the hf-fp8 layout, and its ``quantization_config``.

    Args:
        tensors: the model's HF-named high-precision weights (as :meth:`TrainerCheckpoint.hf_tensors` gives).
        config: their model.
        recipe: the trainer's recipe (:func:`fp8_recipe_for_export` picks the FP8 linears from it).
        progress: a progress bar over the quantized linears (stderr).

    Raises:
        ValueError: a weight to quantize holds NaN/Inf (:func:`quantize_state_dict` names it).
    """
    recipe = fp8_recipe_for_export(recipe)
    with torch.device("meta"):
        meta = CausalLM(config)
    prefixes = fp8_linear_names(meta, recipe)
    bar = tqdm(prefixes, desc="quantize e4m3 128x128", unit="linear", disable=not progress, file=sys.stderr)
    quantized = quantize_state_dict(dict(tensors), bar, pow2_scale=recipe.pow2_weight_scaling_factors)
    # fp8rl's weight_scale is the dequantization multiplier: the Hub's weight_scale_inv as it is (docstring)
    out = {f"{k.removesuffix('weight_scale')}{SCALE_SUFFIX}" if k.endswith(".weight_scale") else k: v
           for k, v in quantized.items()}
    partial = [p for p in prefixes if any(d % BLOCK for d in tensors[f"{p}.weight"].shape)]
    if partial:
        shape = tuple(tensors[f"{partial[0]}.weight"].shape)
        log.warning("%d of %d FP8 linears have a dimension that is not a multiple of %d (e.g. %s %s): their last "
                    "blocks are partial, which transformers' and vLLM's FP8 loaders may refuse; --format hf has no "
                    "such limit", len(partial), len(prefixes), BLOCK, partial[0], shape)
    return out, quantization_config(_kept_modules(meta, set(prefixes), config))
