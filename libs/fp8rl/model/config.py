"""Model configuration for the Llama / Qwen2 / Qwen3 / Qwen3-MoE decoder-only family, and its HF config.json mapping.

One :class:`ModelConfig` describes every architecture we run. The families differ only in a few
switches, which the architecture pins down (HF hard-codes them, so a config that disagrees with its
architecture could not round-trip through ``config.json``):

| architecture | q/k/v bias         | o_proj bias        | QK-norm | MLP of layer ``i``                         |
|--------------|--------------------|--------------------|---------|--------------------------------------------|
| llama        | ``attention_bias`` | ``attention_bias`` | no      | dense                                      |
| qwen2        | always             | never              | no      | dense                                      |
| qwen3        | ``attention_bias`` | ``attention_bias`` | yes     | dense                                      |
| qwen3_moe    | ``attention_bias`` | ``attention_bias`` | yes     | experts when :meth:`ModelConfig.is_moe_layer` |
| deepseek_v3  | MLA (:mod:`.mla`)  | ``attention_bias`` | no      | experts (+ shared) from ``first_k_dense_replace`` |

``deepseek_v3`` (DeepSeek-V3, Moonlight) keeps HF's names too: multi-head latent attention (``q_lora_rank`` — None
for a plain ``q_proj`` —, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``,
``rope_interleave``; ``head_dim`` is the rotary width ``qk_rope_head_dim``, as transformers sets it), sigmoid routing
with a per-expert score-correction bias for selection only (``topk_method: noaux_tc``), group-limited top-k
(``n_group``, ``topk_group``), ``norm_topk_prob`` and ``routed_scaling_factor``, ``n_shared_experts`` shared experts
added to every token, and dense first ``first_k_dense_replace`` layers. ``n_routed_experts`` is read into
``num_experts`` and written back under both names.

Mixture-of-experts keys keep HF's names (``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
``norm_topk_prob``, ``decoder_sparse_step``, ``mlp_only_layers``, ``router_aux_loss_coef``); transformers 5
*writes* ``num_local_experts`` instead of ``num_experts`` (its ``attribute_map``), so both are read and both
are written (a reader of either generation sees the same number of experts).

``from_hf_dict`` reads both the transformers-4 layout (``rope_theta`` + ``rope_scaling``) and
the transformers-5 layout (``rope_parameters``); ``to_hf_dict`` writes both so that readers of
either generation (transformers, vLLM) load the same model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["MOE_ARCHITECTURES", "ModelConfig", "SUPPORTED_ARCHITECTURES"]

# architecture -> HF class name written into config.json "architectures"
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
QK_NORM_ARCHITECTURES = frozenset({"qwen3", "qwen3_moe"})
MOE_ARCHITECTURES = frozenset({"qwen3_moe", "deepseek_v3"})
MLA_ARCHITECTURES = frozenset({"deepseek_v3"})
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# HF config defaults for keys a config.json may omit (values of the transformers classes).
_HF_MAX_POS_DEFAULT = {"llama": 2048, "qwen2": 32768, "qwen3": 32768, "qwen3_moe": 32768, "deepseek_v3": 4096}
# transformers 5's DeepseekV3Config defaults, for the keys a config.json may omit
_DEEPSEEK_DEFAULTS = {"n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
                      "n_shared_experts": 1, "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4,
                      "routed_scaling_factor": 2.5, "norm_topk_prob": True, "kv_lora_rank": 512, "q_lora_rank": 1536,
                      "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_interleave": True}
# transformers 5's Qwen3MoeConfig defaults, for the keys a config.json may omit
_QWEN3_MOE_DEFAULTS = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                       "norm_topk_prob": False, "decoder_sparse_step": 1, "router_aux_loss_coef": 0.001}


@dataclass
class ModelConfig:
    """Shape and numerics of a decoder-only causal LM (HF Llama / Qwen2 / Qwen3 / Qwen3-MoE compatible).

    Attributes:
        architecture: ``"llama"``, ``"qwen2"``, ``"qwen3"`` or ``"qwen3_moe"``.
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
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
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
        if self.architecture in MLA_ARCHITECTURES:
            self._check_mla()
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

        # The architecture fixes the bias / QK-norm layout (HF hard-codes it per class).
        if self.attention_bias is None:
            self.attention_bias = self.architecture == "qwen2"
        if self.architecture == "qwen2" and not self.attention_bias:
            raise ValueError("qwen2 always has q/k/v biases (HF Qwen2Attention); attention_bias must be True")
        want_qk_norm = self.architecture in QK_NORM_ARCHITECTURES
        if self.qk_norm is None:
            self.qk_norm = want_qk_norm
        if self.qk_norm != want_qk_norm:
            raise ValueError(
                f"qk_norm={self.qk_norm} contradicts architecture {self.architecture!r} (only "
                f"{'/'.join(sorted(QK_NORM_ARCHITECTURES))} have q_norm/k_norm)"
            )
        self._check_moe()
        eos = self.eos_token_id
        if eos is not None and not isinstance(eos, int):
            if not (isinstance(eos, list | tuple) and all(isinstance(e, int) for e in eos)):
                raise ValueError(f"eos_token_id must be an int or a list of ints, got {eos!r}")
            self.eos_token_id = list(eos)

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (``deepseek_v3``)."""
        return self.architecture in MLA_ARCHITECTURES

    @property
    def shared_expert_intermediate_size(self) -> int:
        """DeepSeek's shared experts as one SwiGLU MLP: ``n_shared_experts x moe_intermediate_size`` wide (0: none;
        only ``deepseek_v3`` has them)."""
        return self.n_shared_experts * self.moe_intermediate_size if self.is_mla else 0

    @property
    def qk_head_dim(self) -> int:
        """MLA: a query's and a key's width per head, ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def _check_mla(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int for {self.architecture}, got {val!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise ValueError(f"ModelConfig.q_lora_rank must be None or a positive int, got {self.q_lora_rank!r}")
        # every query head reads its own key and value, expanded from the one latent (MLA): no GQA grouping
        self.num_key_value_heads = self.num_attention_heads
        if self.head_dim not in (None, self.qk_rope_head_dim):
            raise ValueError(f"{self.architecture}: head_dim is the rotary width qk_rope_head_dim "
                             f"({self.qk_rope_head_dim}), got {self.head_dim}")
        self.head_dim = self.qk_rope_head_dim
        if self.num_experts:
            if self.n_group < 1 or self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"n_group={self.n_group} must divide n_routed_experts={self.num_experts} and "
                                 f"1 <= topk_group={self.topk_group} <= n_group")
            if self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts of "
                                 f"topk_group={self.topk_group} groups")
            if (self.num_experts // self.n_group) < 2:
                raise ValueError("deepseek_v3 group scores sum each group's top 2 experts: groups need >= 2 experts")
        if not (math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0):
            raise ValueError(f"routed_scaling_factor must be finite and > 0, got {self.routed_scaling_factor}")
        if self.n_shared_experts < 0 or self.first_k_dense_replace < 0:
            raise ValueError("n_shared_experts and first_k_dense_replace must be >= 0")

    def _check_moe(self) -> None:
        self.mlp_only_layers = tuple(int(i) for i in self.mlp_only_layers or ())
        if self.architecture not in MOE_ARCHITECTURES:
            if self.num_experts:
                raise ValueError(f"num_experts={self.num_experts} on architecture {self.architecture!r}: only "
                                 f"{'/'.join(sorted(MOE_ARCHITECTURES))} have experts")
            return
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int for {self.architecture}, got {val!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts={self.num_experts}")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"mlp_only_layers {bad} are not layers of a {self.num_hidden_layers}-layer model")
        if not (math.isfinite(self.router_aux_loss_coef) and self.router_aux_loss_coef >= 0):
            raise ValueError(f"router_aux_loss_coef must be finite and >= 0, got {self.router_aux_loss_coef}")

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
        """o_proj carries a bias: Llama and Qwen3 tie it to ``attention_bias``; Qwen2 never has one."""
        return bool(self.attention_bias) and self.architecture != "qwen2"

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer ``i`` holds experts: HF's rule — not in ``mlp_only_layers``, experts configured,
        and ``(i + 1) % decoder_sparse_step == 0``."""
        if self.is_mla:  # deepseek_v3: dense first layers, experts after
            return self.num_experts > 0 and i >= self.first_k_dense_replace
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

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
        """Build from a parsed HF ``config.json``.

        Raises:
            ValueError: unknown ``model_type``, a missing required key, or a feature we do not
                implement (sliding window, non-SiLU activation, MLP bias, partial rotary,
                RoPE scaling other than llama3).
        """
        arch = d.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {arch!r} in config.json; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        missing = [k for k in required if d.get(k) is None]
        if missing:
            raise ValueError(f"config.json ({arch}) lacks required key(s) {missing}")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"only hidden_act='silu' (SwiGLU) is supported, got {d['hidden_act']!r}")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        if d.get("use_sliding_window"):
            raise ValueError(f"{arch} with use_sliding_window=True is not supported (full attention only)")

        theta, scaling = _rope_from_hf(d)
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads"),
            head_dim=d.get("head_dim"),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", _HF_MAX_POS_DEFAULT[arch]),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bool(d.get("attention_bias", False)),
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            initializer_range=d.get("initializer_range", 0.02),
            **(_deepseek_from_hf(d) if arch in MLA_ARCHITECTURES else
               _moe_from_hf(d) if arch in MOE_ARCHITECTURES else {}),
        )

    def to_hf_dict(self, torch_dtype: str = "float32") -> dict[str, Any]:
        """The HF ``config.json`` dict (``architectures``, ``model_type``, both RoPE layouts).

        Args:
            torch_dtype: dtype name of the saved weights (``"float32"``, ``"bfloat16"``, ...).
        """
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters = {**self.rope_scaling, "rope_theta": self.rope_theta}
        d: dict[str, Any] = {
            "architectures": [SUPPORTED_ARCHITECTURES[self.architecture]],
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
        if self.architecture == "qwen2":
            d["use_sliding_window"] = False  # q/k/v bias is implied by the class, no key for it
        else:
            d["attention_bias"] = bool(self.attention_bias)
        if self.architecture in QK_NORM_ARCHITECTURES:
            d["use_sliding_window"] = False
        if self.is_mla:
            d.update(n_routed_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size, n_shared_experts=self.n_shared_experts,
                     first_k_dense_replace=self.first_k_dense_replace, n_group=self.n_group,
                     topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor,
                     norm_topk_prob=self.norm_topk_prob, topk_method="noaux_tc", scoring_func="sigmoid",
                     q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                     qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                     v_head_dim=self.v_head_dim, rope_interleave=self.rope_interleave,
                     attention_bias=bool(self.attention_bias))
            d.pop("use_sliding_window", None)
        elif self.architecture in MOE_ARCHITECTURES:
            d.update(num_experts=self.num_experts, num_local_experts=self.num_experts,
                     num_experts_per_tok=self.num_experts_per_tok, moe_intermediate_size=self.moe_intermediate_size,
                     norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=self.decoder_sparse_step,
                     mlp_only_layers=list(self.mlp_only_layers), router_aux_loss_coef=self.router_aux_loss_coef,
                     output_router_logits=False)
        if self.architecture == "llama":
            d["mlp_bias"] = False
        return d


def _moe_from_hf(d: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts keys of a qwen3_moe ``config.json`` (``num_experts`` or transformers 5's
    ``num_local_experts``; the class defaults for keys it omits)."""
    experts = d.get("num_experts", d.get("num_local_experts"))
    if d.get("num_experts") is not None and d.get("num_local_experts") is not None \
            and d["num_experts"] != d["num_local_experts"]:
        raise ValueError(f"config.json says num_experts={d['num_experts']} but num_local_experts="
                         f"{d['num_local_experts']}")
    get = {k: d.get(k) if d.get(k) is not None else v for k, v in _QWEN3_MOE_DEFAULTS.items()}
    return dict(num_experts=experts if experts is not None else get["num_experts"],
                num_experts_per_tok=get["num_experts_per_tok"], moe_intermediate_size=get["moe_intermediate_size"],
                norm_topk_prob=bool(get["norm_topk_prob"]), decoder_sparse_step=get["decoder_sparse_step"],
                mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
                router_aux_loss_coef=float(get["router_aux_loss_coef"]))


def _deepseek_from_hf(d: dict[str, Any]) -> dict[str, Any]:
    """The MLA and routing keys of a deepseek_v3 ``config.json`` (the class defaults for keys it omits).

    Raises:
        ValueError: a routing rule fp8rl does not compute (``scoring_func`` other than sigmoid, ``topk_method``
            other than noaux_tc), named.
    """
    if d.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"deepseek_v3 scoring_func {d['scoring_func']!r} is not supported (sigmoid only)")
    if d.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(f"deepseek_v3 topk_method {d['topk_method']!r} is not supported (noaux_tc only)")
    get = {k: d[k] if k in d else v for k, v in _DEEPSEEK_DEFAULTS.items()}
    experts = d.get("n_routed_experts", d.get("num_local_experts", get["n_routed_experts"]))
    return dict(num_experts=experts or 0, num_experts_per_tok=get["num_experts_per_tok"],
                moe_intermediate_size=get["moe_intermediate_size"], n_shared_experts=get["n_shared_experts"] or 0,
                first_k_dense_replace=get["first_k_dense_replace"], n_group=get["n_group"] or 1,
                topk_group=get["topk_group"] or 1, routed_scaling_factor=float(get["routed_scaling_factor"]),
                norm_topk_prob=bool(get["norm_topk_prob"]), q_lora_rank=get["q_lora_rank"],
                kv_lora_rank=get["kv_lora_rank"], qk_nope_head_dim=get["qk_nope_head_dim"],
                qk_rope_head_dim=get["qk_rope_head_dim"], v_head_dim=get["v_head_dim"],
                rope_interleave=bool(get["rope_interleave"]))


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the transformers-5 or the transformers-4 layout."""
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
