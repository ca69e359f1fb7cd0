"""Turn a high-precision model into its FP8 form for one engine, following an :class:`Fp8Recipe`.

Two verbs (as in gpt-fast): :func:`convert_model` converts a model *for runtime*, in place;
:func:`quantize_state_dict` makes a quantized state dict *offline* (what an FP8 refit ships).

Only the linear projections inside transformer layers are converted — embeddings, norms and the
output head (lm_head) stay in high precision, and the first/last N layers named by the recipe stay
whole in high precision. A vision-language model's encoder (``model.visual``) stays in high precision unless the
recipe opts its linears in (``fp8_vision_encoder``: its blocks' and mergers' linears; the patch embedding stays).
Model code never imports this module; engines call it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Literal

import torch
from torch import nn

from .formats import linear_format
from .linear import Fp8InferenceLinear, Fp8Linear
from .recipe import Fp8Recipe

log = logging.getLogger(__name__)

__all__ = ["convert_model", "transformer_layers", "fp8_linear_names", "quantize_state_dict"]


def transformer_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of transformer layers (``model.model.layers`` in HF layout, or ``model.layers``)."""
    for path in ("model.layers", "layers", "decoder.layers"):
        obj: object = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList):
            return obj
    raise ValueError(f"{type(model).__name__} has no transformer layer list (looked for model.layers, layers)")


def _layer_prefix(model: nn.Module) -> str:
    return "model.layers" if hasattr(model, "model") and hasattr(model.model, "layers") else "layers"


def _linears(layer: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Linear, str]]:
    """(parent, attribute, linear, dotted name within the layer) for every plain nn.Linear in ``layer``."""
    for name, parent in layer.named_modules():
        for attr, child in parent.named_children():
            if type(child) is nn.Linear:
                yield parent, attr, child, f"{name}.{attr}" if name else attr


def fp8_linear_names(model: nn.Module, recipe: Fp8Recipe) -> list[str]:
    """State-dict prefixes (``model.layers.3.self_attn.q_proj``) of the linears ``recipe`` puts in FP8."""
    layers = transformer_layers(model)
    prefix = _layer_prefix(model)
    names = []
    for i, layer in enumerate(layers):
        if recipe.layer_in_fp8(i, len(layers)):
            for name, mod in layer.named_modules():
                if isinstance(mod, nn.Linear | Fp8InferenceLinear):
                    names.append(f"{prefix}.{i}.{name}")
    if _vision_in_fp8(model, recipe):
        names += [f"visual.{name}" for name, mod in model.visual.named_modules()
                  if isinstance(mod, nn.Linear | Fp8InferenceLinear)]
    return names


def _vision_in_fp8(model: nn.Module, recipe: Fp8Recipe) -> bool:
    """Whether ``model``'s vision encoder (a vision-language model's ``visual``) gets FP8 linears."""
    return recipe.fp8_linears and recipe.fp8_vision_encoder and getattr(model, "visual", None) is not None


def convert_model(
    model: nn.Module, recipe: Fp8Recipe, *, mode: Literal["train", "inference"] = "train"
) -> nn.Module:
    """Swap the FP8 layers' linear projections in place and install FP8 KV quantizers if asked.

    Args:
        model: a causal LM whose transformer layers hold ``nn.Linear`` projections.
        recipe: which layers and tensors go FP8.
        mode: ``"train"`` → :class:`Fp8Linear` (master weights kept, same Parameter objects);
            ``"inference"`` → :class:`Fp8InferenceLinear` (frozen E4M3 + scales of the recipe's format).

    Returns:
        ``model`` itself, with ``model.fp8_recipe = recipe``.
    """
    if mode not in ("train", "inference"):
        raise ValueError(f"convert_model mode must be 'train' or 'inference', got {mode!r}")
    layers = transformer_layers(model)
    prefix = _layer_prefix(model)
    kw = dict(pow2_weight_scale=recipe.pow2_weight_scaling_factors,
              pow2_activation_scale=recipe.pow2_activation_scaling_factors, scaling=recipe.scaling)
    groups = [(f"{prefix}.{i}", layer) for i, layer in enumerate(layers) if recipe.layer_in_fp8(i, len(layers))]
    if _vision_in_fp8(model, recipe):
        groups.append(("visual", model.visual))
    n_fp8 = 0
    for where, module in groups:
        for parent, attr, lin, name in list(_linears(module)):
            if mode == "train":
                new: nn.Module = Fp8Linear.from_linear(lin, **kw)
            else:
                new = Fp8InferenceLinear.from_linear(lin, name=f"{where}.{name}.weight", **kw)
            setattr(parent, attr, new)
            n_fp8 += 1
    if recipe.fp8_kv:
        enable = getattr(model, "enable_fp8_kv", None)
        if enable is None:
            raise ValueError(f"kv_cache_dtype=fp8 needs a model with enable_fp8_kv(); {type(model).__name__} has none")
        enable(fp8_attention=recipe.fp8_attention)
    set_mla_absorbed = getattr(model, "set_mla_absorbed", None)  # the form of latent attention, where it has any
    if set_mla_absorbed is not None:
        set_mla_absorbed(recipe.mla_absorbed)
    if recipe.batch_invariant:  # after the swap: it tiles the FP8 linears and the remaining plain ones
        enable_bi = getattr(model, "enable_batch_invariance", None)
        if enable_bi is None:
            raise ValueError(f"batch_invariant needs a model with enable_batch_invariance(); {type(model).__name__} "
                             "has none")
        enable_bi()
    model.fp8_recipe = recipe
    log.debug("convert_model(%s): %d linears in FP8 (%s)", mode, n_fp8, recipe)
    return model


@torch.no_grad()
def quantize_state_dict(
    state_dict: dict[str, torch.Tensor], fp8_prefixes: Iterable[str], *, pow2_scale: bool = False,
    scaling: str = "blockwise",
) -> dict[str, torch.Tensor]:
    """Quantize ``{prefix}.weight`` of every FP8 linear to E4M3 + ``{prefix}.weight_scale`` (``scaling``'s forward
    form, :mod:`fp8rl.fp8.formats`).

    Tensors not named by ``fp8_prefixes`` pass through unchanged. Raises ``ValueError`` naming
    the tensor if a weight holds NaN/Inf.
    """
    out = dict(state_dict)
    fmt = linear_format(scaling)
    for p in fp8_prefixes:
        key = f"{p}.weight"
        if key not in state_dict:
            raise KeyError(f"quantize_state_dict: {key} not in state dict")
        q, s = fmt.quantize_weight(state_dict[key], pow2=pow2_scale, name=key)
        out[key] = q
        out[f"{p}.weight_scale"] = s
    return out
