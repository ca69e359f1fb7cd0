"""The calibrator's copy of the policy, kept at a published version by refit (DESIGN §5).

Invariant: a load applies every tensor or none (staged, then applied), so the model calibrated on is
always exactly one published version.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch

from fp8rl.fp8 import E4M3, Fp8InferenceLinear, QKVScales, convert_model, dequantize_blockwise

from .weights import apply_staged, stage_weights

__all__ = ["CalibrationModel"]


class CalibrationModel:
    """The calibrator's model as a :class:`fp8rl.refit.RefitTarget`: validate-then-apply loads, forward passes
    only (``model``), no sampling.

    Linears the calibrator recipe runs in FP8 take the shipped E4M3 + block scales as they are. A
    linear it keeps in high precision (``fp8_gen_only``: the trainer's numerics are BF16) but that
    arrives in E4M3 is dequantized (``x ≈ q.float() * scale``) — the weights the rollout computes with.
    """

    def __init__(self, policy: torch.nn.Module, recipe) -> None:
        self.model = convert_model(copy.deepcopy(policy), recipe, mode="inference").eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self._fp8 = {n for n, m in self.model.named_modules() if isinstance(m, Fp8InferenceLinear)}
        self._version: int | None = None

    @property
    def weight_version(self) -> int | None:
        return self._version

    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor], qkv_scales: QKVScales | None = None):
        tensors = dict(tensors)
        for name in [n for n, t in tensors.items() if t.dtype == E4M3 and n.endswith(".weight")]:
            prefix = name.removesuffix(".weight")
            if prefix not in self._fp8 and f"{prefix}.weight_scale" in tensors:
                tensors[name] = dequantize_blockwise(tensors[name], tensors.pop(f"{prefix}.weight_scale"))
        staged = stage_weights(self.model, tensors)  # raises WeightLoadError; nothing applied then
        apply_staged(self.model, staged)
        self._version = version
