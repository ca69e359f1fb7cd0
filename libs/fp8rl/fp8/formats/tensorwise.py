"""Per-tensor current scaling: one FP32 scale per GEMM operand, E4M3 elements — per token for forward activations
under batch-invariant numerics (a tensor-wide amax would depend on the batch). The torch engines and Megatron (one
tensor-parallel rank per layer) run it; fp8rl's vLLM rollout does not load it."""

from __future__ import annotations

from ..tensorwise import dequantize_tensorwise, fake_quantize_tensorwise, quantize_tensorwise
from .base import VLLM_BLOCKWISE_ONLY, LinearFormat
from .registry import register


class Tensorwise(LinearFormat):
    name = "tensorwise"
    label = "per-tensor"
    summary = ("current scaling: one FP32 scale per tensor per GEMM operand, per token for forward activations "
               "under batch invariance")
    refusals = {"vllm": VLLM_BLOCKWISE_ONLY}

    def refusal(self, engine, *, tensor_parallel=1):
        if engine == "megatron" and tensor_parallel > 1:
            return ("each rank holds a slice of every weight and of its activations, and one tensor-wide scale would "
                    "need an amax all-reduce over the tensor-parallel group that the local spec does not run; use "
                    "blockwise or mxfp8 (whole blocks per slice), or tensor_model_parallel_size=1")
        return super().refusal(engine, tensor_parallel=tensor_parallel)

    def scale_shape(self, n, k):
        return (1, 1)

    def block_size(self, n, k):
        return (n, k)

    def quantize_weight(self, w, *, pow2=False, name=None, out=None):
        q, s = quantize_tensorwise(w, pow2_scale=pow2, name=name)
        if out is not None:
            out[0].copy_(q)
            out[1].copy_(s)
            return out
        return q, s

    def dequantize_weight(self, q, s, out=None):
        return self._into(dequantize_tensorwise(q, s), out)

    groups_experts = False  # a tensor-wide amax per expert: the MoE block's per-expert loop

    def fake_act(self, x, pow2, invariant):
        return fake_quantize_tensorwise(x, pow2_scale=pow2, rows=invariant)

    def save_act(self, x, pow2):
        return quantize_tensorwise(x, pow2_scale=pow2)

    def load_act(self, saved):
        return dequantize_tensorwise(*saved)

    def fake_grad_dgrad(self, g, pow2):
        return fake_quantize_tensorwise(g, pow2_scale=pow2)

    def fake_grad_wgrad(self, g, pow2):
        return fake_quantize_tensorwise(g, pow2_scale=pow2)  # one scale: the same numbers in either orientation

    def weight_for_dgrad(self, weight, q, s, pow2):
        return dequantize_tensorwise(q, s)


register(Tensorwise())
