"""Hugging Face ↔ Megatron-Core weight layout for Llama / Qwen2 / Qwen3 / Qwen3-MoE / DeepSeek-V3 GPT models (the TP = 1
layout).

The rollout side only ever sees Hugging Face names and layouts; this module is the one place that
knows Megatron's. Both directions are pure index moves (no arithmetic), so a round trip is exact.

Megatron fuses two groups of HF tensors into one weight each:

* ``self_attention.linear_qkv`` — Q, K and V *grouped by KV head*: for each of the ``Hkv`` query
  groups ``g``, its ``rep = H / Hkv`` query heads (``rep·D`` rows), then K head ``g`` (``D`` rows),
  then V head ``g`` (``D`` rows)::

      rows: [q(g=0, r=0..rep-1) | k(0) | v(0) | q(g=1, ...) | k(1) | v(1) | ...]   (Hkv·(rep+2)·D, C)

  (biases of Qwen2 follow the same row order).
* ``mlp.linear_fc1`` — ``[gate; up]`` stacked along the output rows (``(2F, C)``); Megatron's GLU
  takes ``silu(first half) * second half``. With TP > 1 each rank holds ``[gate_r; up_r]``: the
  slicing of this TP = 1 layout is :mod:`.tensor_parallel`'s.

A mixture-of-experts layer (``qwen3_moe``; :attr:`~fp8rl.model.ModelConfig.moe_layers`) is Megatron's ``MoELayer``
with ``SequentialMLP`` experts: HF's router ``mlp.gate.weight`` (``(E, C)``) is ``mlp.router.weight``, expert ``j``'s
``gate_proj`` / ``up_proj`` are stacked into ``mlp.experts.local_experts.{j}.linear_fc1.weight`` as a dense layer's
are (rows of ``moe_intermediate_size``), its ``down_proj`` is ``...linear_fc2.weight``. Disk and refit names stay
HF's per-expert ones.

A ``deepseek_v3`` model (multi-head latent attention; :attr:`~fp8rl.model.ModelConfig.is_mla`) fuses nothing in
attention: each HF projection is one Megatron linear of ``MLASelfAttention`` under ``self_attention.`` —
``q_proj`` → ``linear_q_proj`` (or ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` → ``linear_q_down_proj`` /
``q_layernorm`` / ``linear_q_up_proj`` with ``q_lora_rank``), ``kv_a_proj_with_mqa`` → ``linear_kv_down_proj`` (the
latent's ``kv_lora_rank`` rows, then the rotary key's, as HF splits it), ``kv_a_layernorm`` → ``kv_layernorm``,
``kv_b_proj`` → ``linear_kv_up_proj`` (per head: ``qk_nope_head_dim`` key rows, then ``v_head_dim`` value rows, as
HF views it). Its MoE layers add the router's ``e_score_correction_bias`` (``mlp.router.expert_bias``, an FP32
buffer) and the shared experts (``mlp.shared_experts.linear_fc1`` = ``[gate_proj; up_proj]``, ``linear_fc2`` =
``down_proj``).

Norm names differ between the local spec (``input_layernorm``, ``pre_mlp_layernorm``) and the
Transformer Engine spec, where the norms are fused into the following linear
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``): pass ``fused_norms=True`` for
the latter. ``*._extra_state`` entries (Megatron/TE bookkeeping, no weights) are dropped on export.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fp8rl.model import ModelConfig

__all__ = ["qkv_rows", "gate_up_rows", "expert_gate_up_rows", "shared_gate_up_rows", "hf_to_megatron", "megatron_to_hf",
           "megatron_names"]


def qkv_rows(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row indices of HF ``q_proj``, ``k_proj``, ``v_proj`` inside Megatron's fused ``linear_qkv``.

    ``fused[q] == q_proj.weight`` (and likewise for K and V), rows in HF order.
    """
    h, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    rep = h // hkv
    group = torch.arange(hkv)[:, None] * (rep + 2) * d  # (Hkv, 1): first row of each query group
    q = (group[:, None] + torch.arange(rep)[None, :, None] * d + torch.arange(d)).reshape(-1)  # (H·D,)
    k = (group + rep * d + torch.arange(d)).reshape(-1)  # (Hkv·D,)
    v = (group + (rep + 1) * d + torch.arange(d)).reshape(-1)  # (Hkv·D,)
    return q, k, v


def _stacked_rows(f: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``[gate; up]`` stacked along the output rows, ``f`` each."""
    return torch.arange(f), f + torch.arange(f)


def gate_up_rows(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices of HF ``gate_proj`` and ``up_proj`` inside Megatron's fused ``linear_fc1``."""
    return _stacked_rows(config.intermediate_size)


def expert_gate_up_rows(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices of one expert's HF ``gate_proj`` and ``up_proj`` inside its Megatron ``linear_fc1``."""
    return _stacked_rows(config.moe_intermediate_size)


def shared_gate_up_rows(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices of the shared experts' HF ``gate_proj`` and ``up_proj`` inside Megatron's ``linear_fc1``."""
    return _stacked_rows(config.shared_expert_intermediate_size)


# multi-latent attention: one Megatron module per HF tensor (HF suffix under self_attn., Megatron's under
# self_attention.); the query's low-rank pair replaces q_proj when q_lora_rank is set
_MLA_QUERY = (("q_proj.weight", "linear_q_proj.weight"),)
_MLA_LOW_RANK_QUERY = (("q_a_proj.weight", "linear_q_down_proj.weight"), ("q_a_layernorm.weight", "q_layernorm.weight"),
                       ("q_b_proj.weight", "linear_q_up_proj.weight"))
_MLA_LATENT = (("kv_a_proj_with_mqa.weight", "linear_kv_down_proj.weight"),
               ("kv_a_layernorm.weight", "kv_layernorm.weight"), ("kv_b_proj.weight", "linear_kv_up_proj.weight"))


def _layer_tables(config: ModelConfig, fused_norms: bool, layer: int = 0):
    """Layer ``layer``'s ``(renames, fused)``: ``(hf_suffix, mg_suffix)`` pairs and ``(mg, [hf...], rows)``."""
    moe = config.is_moe_layer(layer)
    if moe and fused_norms:
        raise ValueError("a mixture-of-experts layer on the Transformer Engine spec is not mapped (its pre-MLP norm is "
                         "not fused into an expert linear)")
    renames = [
        ("input_layernorm.weight",
         "self_attention.linear_qkv.layer_norm_weight" if fused_norms else "input_layernorm.weight"),
        ("post_attention_layernorm.weight",
         "mlp.linear_fc1.layer_norm_weight" if fused_norms else "pre_mlp_layernorm.weight"),
        ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
    ]
    if config.is_mla:
        query = _MLA_QUERY if config.q_lora_rank is None else _MLA_LOW_RANK_QUERY
        renames += [(f"self_attn.{h}", f"self_attention.{m}") for h, m in query + _MLA_LATENT]
    if moe:
        renames.append(("mlp.gate.weight", "mlp.router.weight"))
        renames += [(f"mlp.experts.{j}.down_proj.weight", f"mlp.experts.local_experts.{j}.linear_fc2.weight")
                    for j in range(config.num_experts)]
        if config.is_mla:  # DeepSeek's selection bias (an FP32 buffer) and shared experts
            renames.append(("mlp.gate.e_score_correction_bias", "mlp.router.expert_bias"))
            if config.shared_expert_intermediate_size:
                renames.append(("mlp.shared_experts.down_proj.weight", "mlp.shared_experts.linear_fc2.weight"))
    else:
        renames.append(("mlp.down_proj.weight", "mlp.linear_fc2.weight"))
    if config.o_proj_bias:
        renames.append(("self_attn.o_proj.bias", "self_attention.linear_proj.bias"))
    if config.qk_norm:
        renames += [("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
                    ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight")]
    fused = []
    if not config.is_mla:
        qkv = qkv_rows(config)
        fused.append(("self_attention.linear_qkv.weight", [f"self_attn.{p}_proj.weight" for p in "qkv"], qkv))
    if moe:
        rows = expert_gate_up_rows(config)
        fused += [(f"mlp.experts.local_experts.{j}.linear_fc1.weight",
                   [f"mlp.experts.{j}.gate_proj.weight", f"mlp.experts.{j}.up_proj.weight"], rows)
                  for j in range(config.num_experts)]
        if config.shared_expert_intermediate_size:
            fused.append(("mlp.shared_experts.linear_fc1.weight",
                          ["mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"],
                          shared_gate_up_rows(config)))
    else:
        fused.append(("mlp.linear_fc1.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"], gate_up_rows(config)))
    if config.attention_bias and not config.is_mla:
        fused.append(("self_attention.linear_qkv.bias", [f"self_attn.{p}_proj.bias" for p in "qkv"], qkv))
    return renames, fused


def _global_renames(config: ModelConfig) -> list[tuple[str, str]]:
    out = [("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
           ("model.norm.weight", "decoder.final_layernorm.weight")]
    if not config.tie_word_embeddings:
        out.append(("lm_head.weight", "output_layer.weight"))
    return out


def megatron_names(config: ModelConfig, *, fused_norms: bool = False) -> set[str]:
    """Every weight name of the Megatron GPTModel for ``config`` (no ``_extra_state``)."""
    names = {mg for _, mg in _global_renames(config)}
    for i in range(config.num_hidden_layers):
        renames, fused = _layer_tables(config, fused_norms, i)
        names |= {f"decoder.layers.{i}.{mg}" for _, mg in renames}
        names |= {f"decoder.layers.{i}.{mg}" for mg, _, _ in fused}
    return names


def _check_names(given: set[str], expected: set[str], what: str) -> None:
    missing, unknown = sorted(expected - given), sorted(given - expected)
    if missing or unknown:
        raise ValueError(f"{what}: {len(missing)} missing tensor(s) {missing[:3]}, "
                         f"{len(unknown)} unknown tensor(s) {unknown[:3]}")


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor], config: ModelConfig, *, fused_norms: bool = False
) -> dict[str, torch.Tensor]:
    """Megatron state dict from HF tensors (new tensors; the inputs are not aliased by fused ones).

    A tied ``lm_head.weight`` and legacy ``*.rotary_emb.inv_freq`` entries are ignored.

    Raises:
        ValueError: a tensor is missing, unknown, or has the wrong shape for ``config``.
    """
    hf = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        hf.pop("lm_head.weight", None)
    out: dict[str, torch.Tensor] = {}
    expected_hf = {h for h, _ in _global_renames(config)}
    for i in range(config.num_hidden_layers):
        renames, fused = _layer_tables(config, fused_norms, i)
        expected_hf |= {f"model.layers.{i}.{h}" for h, _ in renames}
        expected_hf |= {f"model.layers.{i}.{h}" for _, hs, _ in fused for h in hs}
    _check_names(set(hf), expected_hf, "HF -> Megatron")
    for h, mg in _global_renames(config):
        out[mg] = hf[h]
    for i in range(config.num_hidden_layers):
        renames, fused = _layer_tables(config, fused_norms, i)
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for h, mg in renames:
            out[dst + mg] = hf[src + h]
        for mg, parts, rows in fused:
            tensors = [hf[src + h] for h in parts]
            for h, t, r in zip(parts, tensors, rows, strict=True):
                if t.shape[0] != r.numel():
                    raise ValueError(f"{src + h}: {t.shape[0]} rows, expected {r.numel()} for this config")
            first = tensors[0]
            merged = first.new_empty((sum(r.numel() for r in rows), *first.shape[1:]))
            for t, r in zip(tensors, rows, strict=True):
                merged[r] = t
            out[dst + mg] = merged
    return out


def megatron_to_hf(
    mg: Mapping[str, torch.Tensor], config: ModelConfig, *, fused_norms: bool = False
) -> dict[str, torch.Tensor]:
    """HF state dict (names and layout) from a Megatron one; the tied ``lm_head`` is omitted, as HF files do.

    Raises:
        ValueError: a Megatron weight is missing or unknown for ``config``.
    """
    mg = {k: v for k, v in mg.items() if not k.endswith("_extra_state")}
    _check_names(set(mg), megatron_names(config, fused_norms=fused_norms), "Megatron -> HF")
    out = {h: mg[m] for h, m in _global_renames(config)}
    for i in range(config.num_hidden_layers):
        renames, fused = _layer_tables(config, fused_norms, i)
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for h, m in renames:
            out[dst + h] = mg[src + m]
        for m, parts, rows in fused:
            whole = mg[src + m]
            for h, r in zip(parts, rows, strict=True):
                out[dst + h] = whole.index_select(0, r.to(whole.device))
    return out
