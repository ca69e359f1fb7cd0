"""Validate-then-apply weight loading shared by the embedded engines (rollout and calibrator).

A refit payload is checked *completely* — every expected tensor present, no unknown names,
shapes and dtypes right, no NaN/Inf, FP8 linears quantized — into a staging dict before a single
live tensor is touched. Only then are the live tensors overwritten in place with ``copy_`` (so
their identity, and any pointer a kernel captured, survives the refit). A failure anywhere leaves
the engine serving its previous weights.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from fp8rl.fp8 import E4M3, Fp8InferenceLinear, check_finite, quantize_blockwise

from .base import WeightLoadError

__all__ = ["stage_weights", "apply_staged", "expected_weight_names", "check_payload_names"]


def _fp8_modules(model: nn.Module) -> dict[str, Fp8InferenceLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Fp8InferenceLinear)}


def expected_weight_names(model: nn.Module) -> set[str]:
    """HF tensor names a full refit of ``model`` must provide (tied ``lm_head`` excluded)."""
    names = {n for n, _ in model.named_parameters()}
    for prefix, mod in _fp8_modules(model).items():
        names.add(f"{prefix}.weight")
        if mod.bias is not None:
            names.add(f"{prefix}.bias")
    return names


def check_payload_names(tensors: Mapping[str, torch.Tensor], expected: set[str], scale_names: set[str]) -> None:
    """:class:`WeightLoadError` unless ``tensors`` holds every ``expected`` name and nothing but those + scales."""
    missing = sorted(expected - set(tensors))
    unknown = sorted(set(tensors) - expected - scale_names)
    if missing:
        raise WeightLoadError(f"refit payload is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    if unknown:
        raise WeightLoadError(f"refit payload has {len(unknown)} unknown tensor(s), e.g. {unknown[:3]}")


def stage_weights(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Check ``tensors`` against ``model`` and return ``{live_name: new_value}`` ready to copy.

    FP8 linears accept ``X.weight`` in high precision (quantized here 128×128, exactly as the
    trainer quantizes it) or ``X.weight`` in E4M3 plus ``X.weight_scale``.

    Raises:
        WeightLoadError: naming the first bad tensor.
    """
    fp8 = _fp8_modules(model)
    params = dict(model.named_parameters())
    scale_names = {f"{p}.weight_scale" for p in fp8}
    check_payload_names(tensors, expected_weight_names(model), scale_names)
    staged: dict[str, torch.Tensor] = {}
    try:
        for name, live in params.items():
            new = tensors[name]
            if tuple(new.shape) != tuple(live.shape):
                raise WeightLoadError(f"{name}: shape {tuple(new.shape)} != expected {tuple(live.shape)}")
            if not new.is_floating_point() or new.dtype == E4M3:
                raise WeightLoadError(f"{name}: dtype {new.dtype} is not a high-precision float")
            check_finite(new, name)
            staged[name] = new.to(device=live.device, dtype=live.dtype)
        for prefix, mod in fp8.items():
            w = tensors[f"{prefix}.weight"]
            shape = (mod.out_features, mod.in_features)
            if tuple(w.shape) != shape:
                raise WeightLoadError(f"{prefix}.weight: shape {tuple(w.shape)} != expected {shape}")
            if w.dtype == E4M3:
                s = tensors.get(f"{prefix}.weight_scale")
                if s is None:
                    raise WeightLoadError(f"{prefix}.weight is E4M3 but {prefix}.weight_scale is missing")
                if tuple(s.shape) != tuple(mod.weight_scale.shape):
                    raise WeightLoadError(
                        f"{prefix}.weight_scale: shape {tuple(s.shape)} != expected {tuple(mod.weight_scale.shape)}"
                    )
                check_finite(s, f"{prefix}.weight_scale")
                if not bool((s > 0).all()):
                    raise WeightLoadError(f"{prefix}.weight_scale: scales must be > 0")
                q = w
            else:
                q, s = quantize_blockwise(w, pow2_scale=mod.pow2_weight_scale, name=f"{prefix}.weight")
            staged[f"{prefix}.weight"] = q.to(mod.weight.device)
            staged[f"{prefix}.weight_scale"] = s.to(mod.weight_scale.device, torch.float32)
            if mod.bias is not None:
                b = tensors[f"{prefix}.bias"]
                if tuple(b.shape) != tuple(mod.bias.shape):
                    raise WeightLoadError(f"{prefix}.bias: shape {tuple(b.shape)} != {tuple(mod.bias.shape)}")
                check_finite(b, f"{prefix}.bias")
                staged[f"{prefix}.bias"] = b.to(mod.bias.device, mod.bias.dtype)
    except ValueError as e:  # check_finite / quantize_blockwise name the tensor
        if isinstance(e, WeightLoadError):
            raise
        raise WeightLoadError(str(e)) from e
    return staged


@torch.no_grad()
def apply_staged(model: nn.Module, staged: Mapping[str, torch.Tensor]) -> None:
    """Copy staged tensors into the live ones in place (never rebinds a parameter or buffer)."""
    params = dict(model.named_parameters())
    fp8 = _fp8_modules(model)
    for name, p in params.items():
        p.copy_(staged[name])
    for prefix, mod in fp8.items():
        mod.load_quantized(staged[f"{prefix}.weight"], staged[f"{prefix}.weight_scale"],
                           staged.get(f"{prefix}.bias"), name=f"{prefix}.weight")
