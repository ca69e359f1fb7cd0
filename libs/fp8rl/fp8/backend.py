"""Choosing how an FP8 GEMM runs: the pure-PyTorch reference everywhere, fast paths where they exist.

``select_backend(device)`` is the one place that decides, and it logs its choice once per device.

* ``reference`` — dequantize both operands to FP32 and multiply. Numerically this *is* an FP8
  GEMM with FP32 accumulation (the products of E4M3 values scaled by FP32 scales are exact in
  FP32 up to the summation order), so it is the yardstick every fast path is tested against.
  Runs on any device, including CPU.
* ``scaled_mm`` — ``torch.nn.functional.scaled_mm`` with ``BlockWise1x128`` activations and
  ``BlockWise128x128`` weights, FP32 scales, FP32 accumulation. Chosen only on CUDA devices of
  compute capability 9.0 (Hopper) where that API exists; on anything else it is never picked.

Set ``FP8RL_FP8_BACKEND=reference`` to force the reference (for debugging a fast path).
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

__all__ = ["select_backend", "fp8_gemm_supported", "BACKENDS"]

BACKENDS = ("reference", "scaled_mm")


def fp8_gemm_supported(device: torch.device | str) -> tuple[bool, str]:
    """Whether block-scaled FP8 GEMMs run natively on ``device``, with the reason when not."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"{device.type} has no FP8 tensor cores (using the dequantize-and-multiply reference)"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (9, 0) or major >= 10:
        # Blockwise-scaled FP8 GEMMs in torch target sm90; other archs use other scale layouts.
        return False, f"compute capability {major}.{minor}: blockwise FP8 scaled_mm needs sm90 (Hopper)"
    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return False, f"torch {torch.__version__} lacks torch.nn.functional.scaled_mm"
    return True, "sm90 with torch.nn.functional.scaled_mm"


@functools.cache
def _select(device_key: str) -> str:
    forced = os.environ.get("FP8RL_FP8_BACKEND")
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"FP8RL_FP8_BACKEND={forced!r}: expected one of {', '.join(BACKENDS)}")
        if forced == "scaled_mm" and not fp8_gemm_supported(device_key)[0]:
            raise RuntimeError(
                f"FP8RL_FP8_BACKEND=scaled_mm but {device_key} cannot run it: {fp8_gemm_supported(device_key)[1]}"
            )
        log.info("fp8 GEMM backend on %s: %s (forced by FP8RL_FP8_BACKEND)", device_key, forced)
        return forced
    ok, why = fp8_gemm_supported(device_key)
    choice = "scaled_mm" if ok else "reference"
    log.info("fp8 GEMM backend on %s: %s (%s)", device_key, choice, why)
    return choice


def select_backend(device: torch.device | str = "cpu") -> str:
    """The FP8 GEMM backend for ``device`` (``"reference"`` or ``"scaled_mm"``), decided once."""
    device = torch.device(device)
    key = f"{device.type}:{device.index or 0}" if device.type == "cuda" else device.type
    return _select(key)
