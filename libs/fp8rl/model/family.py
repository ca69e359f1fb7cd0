"""Model families as plug-ins: what one architecture (an HF ``model_type``) is, registered by name.

A :class:`Family` owns everything that differs between architectures: the keys of its ``config.json`` (their
defaults and the traps), the checks of a :class:`~fp8rl.model.ModelConfig` of it, which blocks each decoder layer
is built from (attention, MLP or experts, norms, the embedding, the RoPE tables), the routing rule of its experts,
and which engines run it (or why not). The shared blocks — attention, latent attention, the MoE block, norms,
RoPE — are components in :mod:`fp8rl.model` that families compose; :class:`~fp8rl.model.CausalLM` builds what its
config's family says and never branches on an architecture name.

Each family is one module of :mod:`fp8rl.model.families` (listed in its ``MODULES``) that calls :func:`register`
when imported. The registry imports them on the first lookup, so this module (which :mod:`fp8rl.model.config`
reads) imports no model code: the families import the components, never the other way round.

Adding a family: ``docs/ARCHITECTURE.md`` ("How to add a model family"); ``fp8rl/model/families/gemma3_text.py``
is the worked example.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only
    import torch
    from torch import nn

# fp8rl.model.config.ModelConfig, not imported: that module imports this one
ModelConfig = Any

__all__ = ["Family", "ENGINES", "family_names", "get_family", "register"]

# the engines a family says it runs on, or refuses with a reason (Family.refusals)
ENGINES = ("torch", "vllm", "megatron")

_REGISTRY: dict[str, Family] = {}
_loaded = False


class Family:
    """One architecture (class attributes describe it; methods build and check). Subclass, set the attributes, and
    :func:`register` an instance.

    Attributes:
        name: the ``model_type`` of its ``config.json`` (``ModelConfig.architecture``).
        hf_class: transformers' class, written into ``config.json``'s ``architectures``.
        max_position_default: transformers' ``max_position_embeddings`` default, for a file that omits it.
        config_class: the :class:`~fp8rl.model.ModelConfig` subclass holding the family's own settings (None: the
            plain class is enough).
        latent_attention: multi-head latent attention (the KV cache holds a latent; no shared prefix).
        vision: a vision-language model (a ``visual`` encoder, multimodal RoPE: :meth:`build_vision`).
        language_model_of: the vision-language ``model_type`` s whose text tower is this family
            (``policy.language_model_only``: :mod:`fp8rl.model.vision_language`).
        shared_experts: an MoE layer adds shared experts (``n_shared_experts``) to every token.
        router_scoring: ``"softmax"`` or ``"sigmoid"``: how its experts' router scores (:class:`~.router.RoutingRule`).
        refusals: engine -> why it cannot run this family (an engine not listed runs it).
        checkpoint_prefixes: where fp8rl's parameter names differ from the checkpoint's (a vision-language model's
            ``model.language_model.*`` is fp8rl's ``model.*``): ``(fp8rl's prefix, the checkpoint's)`` pairs.
    """

    name: str = ""
    hf_class: str = ""
    max_position_default: int = 2048
    config_class: type | None = None
    latent_attention: bool = False
    vision: bool = False
    language_model_of: tuple[str, ...] = ()
    shared_experts: bool = False
    router_scoring: str = "softmax"
    refusals: dict[str, str] = {}
    # (fp8rl's parameter-name prefix, the checkpoint's) where they differ, most specific first
    checkpoint_prefixes: tuple[tuple[str, str], ...] = ()

    # -- checkpoint names -----------------------------------------------------------------------------------------

    def from_checkpoint(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """``tensors`` renamed, in place, from the checkpoint's names to fp8rl's (``checkpoint_prefixes``)."""
        return self._renamed(tensors, [(theirs, ours) for ours, theirs in self.checkpoint_prefixes])

    def to_checkpoint(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """``tensors`` renamed, in place, from fp8rl's names to the checkpoint's."""
        return self._renamed(tensors, list(self.checkpoint_prefixes))

    @staticmethod
    def _renamed(tensors: dict[str, Any], pairs: list[tuple[str, str]]) -> dict[str, Any]:
        for name in list(tensors):
            for old, new in pairs:
                if name.startswith(old):
                    tensors[new + name[len(old):]] = tensors.pop(name)
                    break
        return tensors

    # -- config.json --------------------------------------------------------------------------------------------

    def text_dict(self, d: dict[str, Any]) -> dict[str, Any]:
        """Where the common keys of ``config.json`` ``d`` live: ``d`` itself, or a multimodal model's text part."""
        return d

    def from_hf(self, d: dict[str, Any]) -> dict[str, Any]:
        """The :class:`ModelConfig` keyword arguments this family reads from ``config.json`` ``d`` beyond the common
        ones (the RoPE keys included). Raises ``ValueError`` naming a key whose value fp8rl does not compute."""
        raise NotImplementedError

    def to_hf(self, config: ModelConfig, d: dict[str, Any]) -> None:
        """Add this family's keys to the common ``config.json`` dict ``d`` (in place; may replace common ones)."""
        raise NotImplementedError

    # -- checks --------------------------------------------------------------------------------------------------

    def fix_shape(self, config: ModelConfig) -> None:
        """Set the shape fields the family determines, before the common checks (heads, head width)."""

    def check(self, config: ModelConfig) -> None:
        """Fill the family's defaults left None and refuse what contradicts it (``ValueError`` naming the field)."""

    def o_proj_bias(self, config: ModelConfig) -> bool:
        """Whether the attention output projection carries a bias."""
        return bool(config.attention_bias)

    def is_moe_layer(self, config: ModelConfig, i: int) -> bool:
        """Whether decoder layer ``i`` holds experts."""
        return False

    # -- building ------------------------------------------------------------------------------------------------

    def build_embedding(self, config: ModelConfig) -> nn.Embedding:
        """``model.embed_tokens``."""
        raise NotImplementedError

    def build_layer(self, config: ModelConfig, i: int) -> nn.Module:
        """``model.layers.{i}``: ``forward(x, cos, sin, mask, kv_cache, layout, prefix)`` as
        :class:`~fp8rl.model.transformer.DecoderLayer`; its ``rope_key`` attribute (default ``"default"``) names
        the table of :meth:`rope_inv_freqs` its attention rotates by."""
        raise NotImplementedError

    def build_final_norm(self, config: ModelConfig) -> nn.Module:
        """``model.norm``."""
        raise NotImplementedError

    def rope_inv_freqs(self, config: ModelConfig) -> dict[str, torch.Tensor]:
        """FP32 inverse-frequency tables ``(D/2,)`` by the ``rope_key`` of the layers that use them."""
        raise NotImplementedError

    def mrope_axes(self, config: ModelConfig) -> torch.Tensor | None:
        """Multimodal RoPE: the position axis of each frequency (:func:`fp8rl.model.mrope.mrope_axes`); None for the
        plain RoPE."""
        return None

    def build_vision(self, config: ModelConfig) -> nn.Module | None:
        """The vision encoder (``visual``: ``forward(ImageBatch) -> (cells, hidden_size)``), None for a text
        model."""
        return None

    # -- engines -------------------------------------------------------------------------------------------------

    def refusal(self, engine: str) -> str | None:
        """Why ``engine`` (one of :data:`ENGINES`) cannot run this family, or None when it can."""
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
        return self.refusals.get(engine)

    def require(self, engine: str) -> None:
        """``ValueError`` with :meth:`refusal`'s reason when ``engine`` cannot run this family."""
        why = self.refusal(engine)
        if why:
            raise ValueError(f"{self.name} models do not run on the {engine} engine: {why}")


def register(family: Family) -> Family:
    """Add ``family`` under its ``name`` (a family module calls it on import); a second one of a name is refused."""
    if not family.name or not family.hf_class:
        raise ValueError(f"a family needs a name and an hf_class, got {family.name!r} / {family.hf_class!r}")
    held = _REGISTRY.get(family.name)
    if held is not None and type(held) is not type(family):
        raise ValueError(f"model family {family.name!r} is registered twice ({type(held).__name__}, "
                         f"{type(family).__name__})")
    _REGISTRY[family.name] = family
    return family


def _load() -> None:
    global _loaded
    if not _loaded:
        modules = importlib.import_module("fp8rl.model.families").MODULES
        for m in modules:
            importlib.import_module(f"fp8rl.model.families.{m}")
        _loaded = True


def family_names() -> list[str]:
    """Every registered family's name, sorted."""
    _load()
    return sorted(_REGISTRY)


def get_family(name: str) -> Family:
    """The family registered as ``name``; ``ValueError`` listing the known ones otherwise."""
    _load()
    fam = _REGISTRY.get(name)
    if fam is None:
        raise ValueError(f"unsupported architecture {name!r}; supported: {sorted(_REGISTRY)}")
    return fam
