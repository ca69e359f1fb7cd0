"""Model configuration for the Llama / Qwen2 / Qwen3 decoder-only family, and its HF config.json mapping.

One :class:`ModelConfig` describes every architecture we run. The three families differ only in
a few switches, which the architecture pins down (HF hard-codes them, so a config that disagrees
with its architecture could not round-trip through ``config.json``):

| architecture | q/k/v bias            | o_proj bias           | QK-norm |
|--------------|-----------------------|-----------------------|---------|
| llama        | ``attention_bias``    | ``attention_bias``    | no      |
| qwen2        | always                | never                 | no      |
| qwen3        | ``attention_bias``    | ``attention_bias``    | yes     |

``from_hf_dict`` reads both the transformers-4 layout (``rope_theta`` + ``rope_scaling``) and
the transformers-5 layout (``rope_parameters``); ``to_hf_dict`` writes both so that readers of
either generation (transformers, vLLM) load the same model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelConfig", "SUPPORTED_ARCHITECTURES"]

# architecture -> HF class name written into config.json "architectures"
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# HF config defaults for keys a config.json may omit (values of the transformers classes).
_HF_MAX_POS_DEFAULT = {"llama": 2048, "qwen2": 32768, "qwen3": 32768}


@dataclass
class ModelConfig:
    """Shape and numerics of a decoder-only causal LM (HF Llama / Qwen2 / Qwen3 compatible).

    Attributes:
        architecture: ``"llama"``, ``"qwen2"`` or ``"qwen3"``.
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
        want_qk_norm = self.architecture == "qwen3"
        if self.qk_norm is None:
            self.qk_norm = want_qk_norm
        if self.qk_norm != want_qk_norm:
            raise ValueError(
                f"qk_norm={self.qk_norm} contradicts architecture {self.architecture!r} (only qwen3 has q_norm/k_norm)"
            )
        eos = self.eos_token_id
        if eos is not None and not isinstance(eos, int):
            if not (isinstance(eos, list | tuple) and all(isinstance(e, int) for e in eos)):
                raise ValueError(f"eos_token_id must be an int or a list of ints, got {eos!r}")
            self.eos_token_id = list(eos)

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
            qk_norm=arch == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            initializer_range=d.get("initializer_range", 0.02),
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
        if self.architecture == "qwen3":
            d["use_sliding_window"] = False
        if self.architecture == "llama":
            d["mlp_bias"] = False
        return d


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
