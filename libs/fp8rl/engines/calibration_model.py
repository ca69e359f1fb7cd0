"""The calibrator's copy of the policy, kept at a published version by refit (DESIGN §5).

Invariant: a load applies every tensor or none (the payload lifecycle of :mod:`fp8rl.fp8.payload`:
checked and processed, then applied), so the model calibrated on is always exactly one published version.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch

from fp8rl.fp8 import PayloadSpec, QKVScales, RefitPayload, convert_model
from fp8rl.model.lora import LoraSettings, apply_lora

__all__ = ["CalibrationModel"]


class CalibrationModel:
    """The calibrator's model as a :class:`fp8rl.refit.RefitTarget`: validate-then-apply loads, forward passes
    only (``model``), no sampling.

    Linears the calibrator recipe runs in FP8 take the shipped E4M3 + block scales as they are. A
    linear it keeps in high precision (``fp8_gen_only``: the trainer's numerics are BF16) but that
    arrives in E4M3 is dequantized (``x ≈ q.float() * scale``) — the weights the rollout computes with.
    """

    def __init__(self, policy: torch.nn.Module, recipe, *, take_model: bool = False,
                 lora: LoraSettings | None = None) -> None:
        """Converts a deep copy of ``policy`` (``take_model``: ``policy`` itself, handed over by a caller that does
        not use it again: the service's freshly loaded model, never held twice); ``lora``: the job's adapters
        (``policy.lora``), applied as the rollout applies them — the QKV scales depend on them."""
        self.model = convert_model(policy if take_model else copy.deepcopy(policy), recipe, mode="inference").eval()
        if lora is not None:
            apply_lora(self.model, lora)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self._spec = PayloadSpec.for_model(self.model, dequantize_fp8=True)
        self._version: int | None = None

    @property
    def weight_version(self) -> int | None:
        return self._version

    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor], qkv_scales: QKVScales | None = None):
        # raises WeightLoadError before anything is applied; the calibrator computes scales, it holds none
        spec = self._spec.for_payload(tensors, self._version)  # LoRA: the adapters alone on the base held
        RefitPayload.create(spec, version, tensors, qkv_scales).process().apply(self.model)
        self._version = version
