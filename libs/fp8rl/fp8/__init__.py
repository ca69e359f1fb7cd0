"""FP8 numerics for fp8rl — the one home of all FP8 math (see FP8.md beside this file).

Convention: ``x ≈ q.float() * scale``, ``scale = amax / 448`` in FP32 (E4M3), 1.0 for all-zero
blocks, optionally rounded up to a power of two.

:mod:`.payload` is the refit payload lifecycle every engine runs (create → process after loading → apply).

Invariant: no other fp8rl package is imported here, and every FP8 rounding in the project happens in this
package, so the rollout engines and the trainer round the same way.
"""

from .backend import fp8_gemm_supported, select_backend
from .convert import convert_model, fp8_linear_names, quantize_state_dict, transformer_layers
from .formats import DEFAULT_SCALING, SCALINGS, LinearFormat, format_names, linear_format
from .kv import QKVQuantizer, QKVScales, calibrated_scale, scales_from_amax_history
from .linear import Fp8InferenceLinear, Fp8Linear, WeightCache, fp8_gemm, fp8_linear
from .mxfp8 import MX_BLOCK, dequantize_mxfp8, quantize_mxfp8
from .payload import (
    Fp8LinearSpec,
    PayloadSpec,
    ProcessedPayload,
    RefitPayload,
    TensorSpec,
    WeightLoadError,
    check_qkv_scales,
    load_qkv_scales,
    qkv_quantizers,
)
from .quant import (
    BLOCK,
    E4M3,
    E4M3_MAX,
    check_finite,
    compute_scale,
    dequantize_blockwise,
    dequantize_per_tensor,
    dequantize_per_token_group,
    quantize_blockwise,
    quantize_per_tensor,
    quantize_per_token_group,
)
from .recipe import RECIPES, Fp8Recipe, recipe_for_role
from .tensorwise import dequantize_tensorwise, quantize_tensorwise

__all__ = [
    "BLOCK", "E4M3", "E4M3_MAX", "RECIPES",
    "Fp8Recipe", "recipe_for_role",
    "compute_scale", "check_finite",
    "quantize_blockwise", "dequantize_blockwise",
    "quantize_per_token_group", "dequantize_per_token_group",
    "quantize_per_tensor", "dequantize_per_tensor",
    "MX_BLOCK", "quantize_mxfp8", "dequantize_mxfp8", "quantize_tensorwise", "dequantize_tensorwise",
    "DEFAULT_SCALING", "SCALINGS", "LinearFormat", "format_names", "linear_format",
    "fp8_gemm", "fp8_linear", "Fp8Linear", "Fp8InferenceLinear", "WeightCache",
    "convert_model", "fp8_linear_names", "quantize_state_dict", "transformer_layers",
    "QKVQuantizer", "QKVScales", "calibrated_scale", "scales_from_amax_history",
    "select_backend", "fp8_gemm_supported",
    "WeightLoadError", "TensorSpec", "Fp8LinearSpec", "PayloadSpec", "RefitPayload", "ProcessedPayload",
    "check_qkv_scales", "load_qkv_scales", "qkv_quantizers",
]
