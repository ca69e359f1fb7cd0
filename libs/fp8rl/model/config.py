"""Model configuration: one :class:`ModelConfig` for every decoder-only family, and its HF ``config.json`` mapping.

What differs between architectures lives in their families (:mod:`fp8rl.model.family`, one module each under
:mod:`fp8rl.model.families`): the keys of ``config.json`` beyond the common ones, defaults, checks, which blocks each
layer composes, and the engines that run them. This module holds the fields, the common checks and the common
``config.json`` keys, and asks the family (``config.family``) for the rest. A family with settings of its own gives a
subclass (``Family.config_class``): :meth:`ModelConfig.from_hf_dict` builds that class.

``from_hf_dict`` reads both the transformers-4 layout (``rope_theta`` + ``rope_scaling``) and the transformers-5
layout (``rope_parameters``); ``to_hf_dict`` writes both so that readers of either generation (transformers, vLLM)
load the same model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .family import Family, family_names, get_family

__all__ = ["ModelConfig", "rope_from_hf"]

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass
class ModelConfig:
    """Shape and numerics of a decoder-only causal LM of a registered family (:mod:`fp8rl.model.family`).

    Attributes:
        architecture: a registered family's name (:func:`fp8rl.model.family.family_names`: ``"llama"``,
            ``"qwen2"``, ``"qwen3"``, ``"qwen3_moe"``, ``"deepseek_v3"``, ...).
        vocab_size: rows of the embedding and of ``lm_head``.
        hidden_size: model width.
        intermediate_size: SwiGLU inner width.
        num_hidden_layers: number of decoder layers.
        num_attention_heads: query heads ``H``.
        num_key_value_heads: key/value heads ``Hkv`` (GQA); must divide ``H``.
        head_dim: per-head width ``D``; ``hidden_size // num_attention_heads`` when None. Even (RoPE).
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: RoPE base.
        rope_scaling: None, or HF's llama3 dict with ``factor``, ``low_freq_factor``,
            ``high_freq_factor``, ``original_max_position_embeddings`` (``rope_type`` optional).
        max_position_embeddings: longest context the model was trained for (informational).
        tie_word_embeddings: ``lm_head`` shares the embedding matrix (and is absent from saved files).
        attention_bias: q/k/v projections carry a bias. None picks the architecture's value
            (qwen2: True, others: False).
        qk_norm: RMSNorm over ``head_dim`` of q and k before RoPE. None picks the architecture's
            value (qwen3: True, others: False).
        bos_token_id, eos_token_id, pad_token_id: special token ids (eos may be a list).
        initializer_range: std of the normal init used when a model is built from scratch.
        num_experts: routed experts of a mixture-of-experts layer (0: every layer dense). Only ``qwen3_moe``.
        num_experts_per_tok: experts each token is routed to (top-k).
        moe_intermediate_size: SwiGLU inner width of one expert.
        norm_topk_prob: renormalise the top-k routing weights to sum to 1.
        decoder_sparse_step: layer ``i`` is a mixture-of-experts layer when ``(i + 1) % decoder_sparse_step == 0``
            (and it is not in ``mlp_only_layers``).
        mlp_only_layers: layer indices kept dense whatever ``decoder_sparse_step`` says.
        router_aux_loss_coef: weight of the load-balancing loss added to the training loss (0: none).
        n_shared_experts, first_k_dense_replace, n_group, topk_group, routed_scaling_factor: ``deepseek_v3``
            routing (module docstring).
        q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, rope_interleave: ``deepseek_v3``'s
            multi-head latent attention (:mod:`fp8rl.model.mla`).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool | None = None
    qk_norm: bool | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    initializer_range: float = 0.02
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] | tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False

    def __post_init__(self) -> None:
        fam = get_family(self.architecture)
        if fam.config_class is not None and not isinstance(self, fam.config_class):
            raise ValueError(f"a {self.architecture} config is a {fam.config_class.__name__} (its own settings): "
                             f"build it with that class or ModelConfig.from_hf_dict")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
        ):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {val!r}")
        fam.fix_shape(self)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.num_key_value_heads <= 0 or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} must be > 0 and divide "
                f"num_attention_heads={self.num_attention_heads} (GQA groups)"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}; set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even int (RoPE rotates pairs), got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        self._check_rope_scaling()
        self.mlp_only_layers = tuple(int(i) for i in self.mlp_only_layers or ())
        fam.check(self)  # the family's layout (biases, QK-norm, experts): its defaults filled, contradictions refused
        eos = self.eos_token_id
        if eos is not None and not isinstance(eos, int):
            if not (isinstance(eos, list | tuple) and all(isinstance(e, int) for e in eos)):
                raise ValueError(f"eos_token_id must be an int or a list of ints, got {eos!r}")
            self.eos_token_id = list(eos)

    @property
    def family(self) -> Family:
        """The registered :class:`~fp8rl.model.family.Family` of ``architecture``."""
        return get_family(self.architecture)

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (the family's ``latent_attention``: ``deepseek_v3``)."""
        return self.family.latent_attention

    @property
    def shared_expert_intermediate_size(self) -> int:
        """Shared experts as one SwiGLU MLP: ``n_shared_experts x moe_intermediate_size`` wide (0: none; only a
        family with ``shared_experts`` has them)."""
        return self.n_shared_experts * self.moe_intermediate_size if self.family.shared_experts else 0

    @property
    def qk_head_dim(self) -> int:
        """MLA: a query's and a key's width per head, ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def _check_rope_scaling(self) -> None:
        rs = self.rope_scaling
        if rs is None:
            return
        rope_type = rs.get("rope_type", rs.get("type", "llama3"))
        if rope_type != "llama3":
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: None or 'llama3'")
        missing = [k for k in _LLAMA3_KEYS if k not in rs]
        if missing:
            raise ValueError(f"llama3 rope_scaling lacks {missing}; it needs {list(_LLAMA3_KEYS)}")
        if not (rs["factor"] > 0 and rs["high_freq_factor"] > rs["low_freq_factor"] > 0):
            raise ValueError(
                f"llama3 rope_scaling needs factor > 0 and high_freq_factor > low_freq_factor > 0, got {rs}"
            )
        self.rope_scaling = {"rope_type": "llama3", **{k: rs[k] for k in _LLAMA3_KEYS}}

    # -----------------------------------------------------------------------------------------
    # derived
    # -----------------------------------------------------------------------------------------

    @property
    def o_proj_bias(self) -> bool:
        """o_proj carries a bias (the family says: Llama and Qwen3 tie it to ``attention_bias``; Qwen2 never)."""
        return self.family.o_proj_bias(self)

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer ``i`` holds experts (the family's rule)."""
        return self.family.is_moe_layer(self, i)

    @property
    def moe_layers(self) -> list[int]:
        """The indices of the layers with experts, in order (a route's layer axis follows it)."""
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def route_shape(self) -> tuple[int, int, int] | None:
        """``(L, K, E)`` of a route: mixture-of-experts layers, experts per token, experts per layer (None: dense)."""
        layers = self.moe_layers
        return (len(layers), self.num_experts_per_tok, self.num_experts) if layers else None

    @property
    def eos_token_ids(self) -> list[int]:
        """``eos_token_id`` as a (possibly empty) list."""
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    # -----------------------------------------------------------------------------------------
    # HF config.json
    # -----------------------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF ``config.json``: the common keys here, the rest by the ``model_type``'s family
        (into its ``config_class`` where it has one).

        Raises:
            ValueError: unknown ``model_type``, a missing required key, or a feature the family does not
                implement (its message names the key).
        """
        arch = d.get("model_type")
        try:
            fam = get_family(arch if isinstance(arch, str) else "")
        except ValueError:
            raise ValueError(f"unsupported model_type {arch!r} in config.json; supported: {family_names()}") from None
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        t = fam.text_dict(d)  # a multimodal model's text part holds the common keys
        missing = [k for k in required if t.get(k) is None]
        if missing:
            raise ValueError(f"config.json ({arch}) lacks required key(s) {missing}")
        common = dict(
            architecture=arch,
            vocab_size=t["vocab_size"],
            hidden_size=t["hidden_size"],
            intermediate_size=t["intermediate_size"],
            num_hidden_layers=t["num_hidden_layers"],
            num_attention_heads=t["num_attention_heads"],
            num_key_value_heads=t.get("num_key_value_heads"),
            head_dim=t.get("head_dim"),
            rms_norm_eps=t.get("rms_norm_eps", 1e-6),
            max_position_embeddings=t.get("max_position_embeddings", fam.max_position_default),
            tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
            attention_bias=bool(t.get("attention_bias", False)),
            bos_token_id=t.get("bos_token_id"),
            eos_token_id=t.get("eos_token_id"),
            pad_token_id=t.get("pad_token_id"),
            initializer_range=t.get("initializer_range", 0.02),
        )
        return (fam.config_class or cls)(**{**common, **fam.from_hf(d)})

    def to_hf_dict(self, torch_dtype: str = "float32") -> dict[str, Any]:
        """The HF ``config.json`` dict (``architectures``, ``model_type``, both RoPE layouts), the family's keys
        added by it.

        Args:
            torch_dtype: dtype name of the saved weights (``"float32"``, ``"bfloat16"``, ...).
        """
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters = {**self.rope_scaling, "rope_theta": self.rope_theta}
        fam = self.family
        d: dict[str, Any] = {
            "architectures": [fam.hf_class],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            # transformers-4 readers (and vLLM) use rope_theta/rope_scaling, transformers-5 rope_parameters
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "use_cache": True,
            "torch_dtype": torch_dtype,
            "dtype": torch_dtype,
        }
        fam.to_hf(self, d)
        return d


def rope_from_hf(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) of a ``config.json`` with one RoPE for every layer, from either the
    transformers-5 (``rope_parameters``) or the transformers-4 layout (``rope_theta`` + ``rope_scaling``)."""
    params = d.get("rope_parameters") or None
    if params is not None and not any(k in params for k in ("rope_type", "type", "rope_theta")):
        raise ValueError(f"per-layer-type rope_parameters {sorted(params)} are not supported")
    legacy = d.get("rope_scaling") or None
    src = params if params is not None else legacy
    theta = float((params or {}).get("rope_theta", d.get("rope_theta", 10000.0)))
    if src is None:
        return theta, None
    if src.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    rope_type = src.get("rope_type", src.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"unsupported RoPE type {rope_type!r} in config.json; supported: 'default', 'llama3'")
    scaling = dict(src)
    # HF fills a missing original length from max_position_embeddings (standardize_rope_params)
    scaling.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    if not math.isfinite(float(scaling.get("factor", math.nan))):
        raise ValueError(f"llama3 rope scaling needs a finite 'factor', got {scaling}")
    return theta, scaling
