"""DeepSeek-V3 / Moonlight (``DeepseekV3ForCausalLM``), with HF's key names.

* multi-head latent attention (:mod:`fp8rl.model.mla`): ``q_lora_rank`` (None for a plain ``q_proj``),
  ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``rope_interleave``; ``head_dim`` is
  the rotary width ``qk_rope_head_dim``, as transformers sets it; every query head reads its own key and value
  expanded from the one latent (no GQA grouping);
* sigmoid routing with a per-expert score-correction bias for selection only (``topk_method: noaux_tc``),
  group-limited top-k (``n_group``, ``topk_group``), ``norm_topk_prob`` and ``routed_scaling_factor``;
* ``n_shared_experts`` shared experts added to every token, dense first ``first_k_dense_replace`` layers.

``n_routed_experts`` is read into ``num_experts`` and written back under both names."""

from __future__ import annotations

import math
from typing import Any

from ..config import ModelConfig
from ..family import register
from .standard import StandardFamily

# transformers 5's DeepseekV3Config defaults, for the keys a config.json may omit
_DEFAULTS = {"n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1,
             "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
             "norm_topk_prob": True, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
             "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_interleave": True}


class DeepseekV3(StandardFamily):
    name, hf_class, max_position_default = "deepseek_v3", "DeepseekV3ForCausalLM", 4096
    latent_attention = shared_experts = experts = True
    router_scoring = "sigmoid"
    refusals = {"vllm": "fp8rl's refit into vLLM's DeepSeek model (its MLA weight layout and FP8 latent cache) is "
                        "not mapped yet; use policy.generation.backend: torch"}

    def from_hf(self, d: dict[str, Any]) -> dict[str, Any]:
        """The MLA and routing keys (the class defaults for keys it omits); a routing rule fp8rl does not compute
        (``scoring_func`` other than sigmoid, ``topk_method`` other than noaux_tc) is refused, named."""
        if d.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError(f"deepseek_v3 scoring_func {d['scoring_func']!r} is not supported (sigmoid only)")
        if d.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError(f"deepseek_v3 topk_method {d['topk_method']!r} is not supported (noaux_tc only)")
        get = {k: d[k] if k in d else v for k, v in _DEFAULTS.items()}
        experts = d.get("n_routed_experts", d.get("num_local_experts", get["n_routed_experts"]))
        return {**super().from_hf(d),
                **dict(num_experts=experts or 0, num_experts_per_tok=get["num_experts_per_tok"],
                       moe_intermediate_size=get["moe_intermediate_size"],
                       n_shared_experts=get["n_shared_experts"] or 0,
                       first_k_dense_replace=get["first_k_dense_replace"], n_group=get["n_group"] or 1,
                       topk_group=get["topk_group"] or 1, routed_scaling_factor=float(get["routed_scaling_factor"]),
                       norm_topk_prob=bool(get["norm_topk_prob"]), q_lora_rank=get["q_lora_rank"],
                       kv_lora_rank=get["kv_lora_rank"], qk_nope_head_dim=get["qk_nope_head_dim"],
                       qk_rope_head_dim=get["qk_rope_head_dim"], v_head_dim=get["v_head_dim"],
                       rope_interleave=bool(get["rope_interleave"]))}

    def to_hf(self, config: ModelConfig, d: dict[str, Any]) -> None:
        super().to_hf(config, d)
        d.update(n_routed_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                 moe_intermediate_size=config.moe_intermediate_size, n_shared_experts=config.n_shared_experts,
                 first_k_dense_replace=config.first_k_dense_replace, n_group=config.n_group,
                 topk_group=config.topk_group, routed_scaling_factor=config.routed_scaling_factor,
                 norm_topk_prob=config.norm_topk_prob, topk_method="noaux_tc", scoring_func="sigmoid",
                 q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
                 qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
                 v_head_dim=config.v_head_dim, rope_interleave=config.rope_interleave,
                 attention_bias=bool(config.attention_bias))
        d.pop("use_sliding_window", None)

    def fix_shape(self, config: ModelConfig) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            val = getattr(config, name)
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int for {config.architecture}, got {val!r}")
        q_rank = config.q_lora_rank
        if q_rank is not None and (not isinstance(q_rank, int) or q_rank <= 0):
            raise ValueError(f"ModelConfig.q_lora_rank must be None or a positive int, got {q_rank!r}")
        # every query head reads its own key and value, expanded from the one latent (MLA): no GQA grouping
        config.num_key_value_heads = config.num_attention_heads
        if config.head_dim not in (None, config.qk_rope_head_dim):
            raise ValueError(f"{config.architecture}: head_dim is the rotary width qk_rope_head_dim "
                             f"({config.qk_rope_head_dim}), got {config.head_dim}")
        config.head_dim = config.qk_rope_head_dim
        if config.num_experts:
            n, groups, top = config.num_experts, config.n_group, config.topk_group
            if groups < 1 or n % groups or not 1 <= top <= groups:
                raise ValueError(f"n_group={groups} must divide n_routed_experts={n} and 1 <= topk_group={top} "
                                 f"<= n_group")
            if config.num_experts_per_tok > top * (n // groups):
                raise ValueError(f"num_experts_per_tok={config.num_experts_per_tok} exceeds the experts of "
                                 f"topk_group={top} groups")
            if (n // groups) < 2:
                raise ValueError("deepseek_v3 group scores sum each group's top 2 experts: groups need >= 2 experts")
        if not (math.isfinite(config.routed_scaling_factor) and config.routed_scaling_factor > 0):
            raise ValueError(f"routed_scaling_factor must be finite and > 0, got {config.routed_scaling_factor}")
        if config.n_shared_experts < 0 or config.first_k_dense_replace < 0:
            raise ValueError("n_shared_experts and first_k_dense_replace must be >= 0")

    def is_moe_layer(self, config: ModelConfig, i: int) -> bool:
        """Dense first ``first_k_dense_replace`` layers, experts after."""
        return config.num_experts > 0 and i >= config.first_k_dense_replace


register(DeepseekV3())
