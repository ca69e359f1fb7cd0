"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention with softmax top-k routed SwiGLU experts on the layers
HF's rule picks (``decoder_sparse_step``, ``mlp_only_layers``).

Its keys keep HF's names (``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``,
``decoder_sparse_step``, ``mlp_only_layers``, ``router_aux_loss_coef``); transformers 5 *writes*
``num_local_experts`` instead of ``num_experts`` (its ``attribute_map``), so both are read and both are written (a
reader of either generation sees the same number of experts)."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from ..family import register
from .standard import StandardFamily

# transformers 5's Qwen3MoeConfig defaults, for the keys a config.json may omit
_DEFAULTS = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False,
             "decoder_sparse_step": 1, "router_aux_loss_coef": 0.001}


class Qwen3Moe(StandardFamily):
    name, hf_class, max_position_default = "qwen3_moe", "Qwen3MoeForCausalLM", 32768
    qk_norm = experts = True

    def from_hf(self, d: dict[str, Any]) -> dict[str, Any]:
        experts = d.get("num_experts", d.get("num_local_experts"))
        if d.get("num_experts") is not None and d.get("num_local_experts") is not None \
                and d["num_experts"] != d["num_local_experts"]:
            raise ValueError(f"config.json says num_experts={d['num_experts']} but num_local_experts="
                             f"{d['num_local_experts']}")
        get = {k: d.get(k) if d.get(k) is not None else v for k, v in _DEFAULTS.items()}
        return {**super().from_hf(d),
                **dict(num_experts=experts if experts is not None else get["num_experts"],
                       num_experts_per_tok=get["num_experts_per_tok"],
                       moe_intermediate_size=get["moe_intermediate_size"], norm_topk_prob=bool(get["norm_topk_prob"]),
                       decoder_sparse_step=get["decoder_sparse_step"],
                       mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
                       router_aux_loss_coef=float(get["router_aux_loss_coef"]))}

    def to_hf(self, config: ModelConfig, d: dict[str, Any]) -> None:
        super().to_hf(config, d)
        d.update(num_experts=config.num_experts, num_local_experts=config.num_experts,
                 num_experts_per_tok=config.num_experts_per_tok, moe_intermediate_size=config.moe_intermediate_size,
                 norm_topk_prob=config.norm_topk_prob, decoder_sparse_step=config.decoder_sparse_step,
                 mlp_only_layers=list(config.mlp_only_layers), router_aux_loss_coef=config.router_aux_loss_coef,
                 output_router_logits=False)

    def is_moe_layer(self, config: ModelConfig, i: int) -> bool:
        """HF's rule: not in ``mlp_only_layers``, experts configured, and ``(i + 1) % decoder_sparse_step == 0``."""
        return (config.num_experts > 0 and i not in config.mlp_only_layers
                and (i + 1) % config.decoder_sparse_step == 0)


register(Qwen3Moe())
