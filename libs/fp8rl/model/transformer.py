"""Decoder-only causal LM: one implementation for every registered family, which says what its layers are made of.

:class:`CausalLM` builds the embedding, each decoder layer, the final norm and the RoPE tables its config's family
gives (:mod:`fp8rl.model.family`; the shared pre-norm blocks are :class:`Attention`, :class:`MLP` and
:class:`DecoderLayer` here, :mod:`.mla` and :mod:`.moe`), and never branches on an architecture name.

The rollout engine (incremental decoding with a :class:`~fp8rl.model.kv_cache.KVCache`) and the
trainer (full sequences) run *this* module, so their numerics are shared by construction.

Contracts other packages rely on:

* Parameter names equal Hugging Face's on-disk names (``model.layers.{i}.self_attn.q_proj.weight``,
  ``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``, ...), so HF checkpoints load with a plain
  ``load_state_dict`` (:mod:`fp8rl.model.moe` says why experts keep their per-expert names).
* A mixture-of-experts layer's ``mlp`` is a :class:`~fp8rl.model.moe.SparseMoeBlock` whose router
  (``mlp.gate``) is FP32 and not an ``nn.Linear``: never FP8. What a forward does with routing (record,
  replay, load statistics) is a :class:`~fp8rl.model.router.Routing` plan installed around it.
* Every projection is an ``nn.Linear`` attribute called as a module (``self.q_proj(x)``), so
  ``fp8rl.fp8.convert_model`` can swap it for an FP8 linear by name in ``self_attn`` / ``mlp``.
* ``self_attn.qkv_point`` sees Q ``(B, H, T, D)`` and K/V ``(B, Hkv, T, D)`` after QK-norm and
  RoPE: what the KV cache stores, hence where QKV calibration hooks read amax.
* ``self_attn.kv_quant`` (an optional :class:`~fp8rl.fp8.kv.QKVQuantizer`) makes K/V E4M3 per
  tensor; the full forward quantizes and dequantizes them the same way as the cached path.

Precision: RMSNorm statistics, attention scores, softmax and ``P @ V`` run in FP32; everything
else runs in the activation dtype (the embedding's dtype). Logits are returned in FP32.

Outputs: the logits of every position, of the last ``logits_to_keep`` only (the rollout's prefill samples
from the last), or the logprob (and entropy) of each next token, computed through bounded chunks of logits
(:mod:`fp8rl.model.logprobs`: never the ``(B, T, V)`` logits, forward or backward). The head runs inside
``forward`` whichever it is, so a wrapper that holds the parameters only during the module's own forward and
backward (FSDP2) sees it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fp8rl.fp8.kv import QKVQuantizer

from .config import ModelConfig
from .invariant import BatchInvariance, KeyLayout, TiledLinear, split_kv_attention
from .kv_cache import KVCache
from .layers import QKVPoint, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq
from .logprobs import chunked_token_logprobs
from .mla import set_absorbed
from .moe import ExpertMLP
from .mrope import mrope_cos_sin, mrope_positions
from .router import TopKRouter, routers
from .shared_prefix import SharedPrefix
from .vision import ImageBatch

__all__ = ["CausalLM", "Decoder", "DecoderLayer", "Attention", "MLP", "RMSNorm", "QKVPoint", "rope_inv_freq"]


# ---------------------------------------------------------------------------------------------
# blocks
# ---------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Causal GQA self-attention with optional QK-norm and optional per-tensor FP8 Q/K/V.

    Attributes:
        kv_quant: None (K/V in the compute dtype) or a :class:`QKVQuantizer` (K/V stored as E4M3;
            with ``fp8_attention`` also Q and the softmax probabilities rounded to E4M3).
    """

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, qkv_bias = config.hidden_size, bool(config.attention_bias)
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_point = QKVPoint()
        self.kv_quant: QKVQuantizer | None = None
        self.score_scale = self.head_dim**-0.5  # of the scores q·k ("scaling" is an FP8 linear's format)

    def restrict(self, mask: torch.Tensor | None, layout: KeyLayout | None
                 ) -> tuple[torch.Tensor | None, KeyLayout | None]:
        """The keys this layer's queries may see, from the forward's causal-and-padding ``mask`` (or ``layout``):
        all of them here; a subclass narrows them (a sliding window) by masking more, never by dropping keys."""
        return mask, layout

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        kv_cache: KVCache | None = None,
        layout: KeyLayout | None = None,
        prefix: SharedPrefix | None = None,
    ) -> torch.Tensor:
        """Attend ``x`` ``(B, T, C)`` to itself (and to the cache's first ``length`` slots, or a shared prefix).

        Args:
            cos, sin: RoPE tables ``(B, T, D)`` for the new tokens.
            mask: additive FP32 mask ``(B or 1, 1, T, S)``, 0 where visible, a large negative
                elsewhere; ``S = T`` without a cache, ``cache.length + T`` with one (None with ``layout``).
            kv_cache: written at ``[length, length + T)`` for this layer; not advanced here.
            layout: with batch-invariant numerics, the keys' canonical layout; attention then runs
                :func:`~fp8rl.model.invariant.split_kv_attention` (``mask`` is None then).
            prefix: a :class:`~fp8rl.model.shared_prefix.SharedPrefix` this layer records its K/V into (the
                prefix's forward) or attends after (the suffixes'); never with ``kv_cache``.
        """
        B, T, _ = x.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        dtype = x.dtype
        q = self.q_proj(x).view(B, T, H, D)
        k = self.k_proj(x).view(B, T, Hkv, D)
        v = self.v_proj(x).view(B, T, Hkv, D)
        if self.q_norm is not None:  # Qwen3: per-head RMSNorm before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|Hkv, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = self.qkv_point(q, k, v)

        quant = self.kv_quant
        if quant is not None:
            q = quant.fake_quantize_q(q)
        if kv_cache is not None:
            k_st, v_st = quant.quantize_kv(k, v) if quant is not None else (k, v)  # E4M3: what an FP8 cache stores
            reach = layout.index.shape[1] if layout is not None else 0  # split-KV reads whole chunks
            k_st, v_st = self._through_cache(kv_cache, k_st, v_st, reach)  # (B, Hkv, S, D)
            if quant is not None:
                k_att, v_att = kv_cache.read_dequantized(self.layer_idx, k_st.shape[2], quant.dequantize_kv, dtype)
            else:
                k_att, v_att = k_st.to(dtype), v_st.to(dtype)
        elif quant is not None:  # without a cache the same quantize -> dequantize runs: both paths see equal K/V
            k_att, v_att = quant.fake_quantize_kv(k, v, dtype)
        else:
            k_att, v_att = k, v
        if prefix is not None:
            k_att, v_att = prefix.attend(self.layer_idx, k_att, v_att)

        mask, layout = self.restrict(mask, layout)
        if layout is not None:
            out = split_kv_attention(q, k_att, v_att, layout, quant.round_probs if quant is not None else None,
                                     scale=self.score_scale)
            return self.o_proj(out.to(dtype).transpose(1, 2).reshape(B, T, H * D))
        rep = H // Hkv  # GQA: query head h reads kv head h // rep
        S = k_att.shape[2]
        # One plain batched GEMM per kv head: its rep query heads stacked along the rows.
        qg = q.float().reshape(B * Hkv, rep * T, D)  # (B*Hkv, rep*T, D)
        kg = k_att.float().reshape(B * Hkv, S, D)  # (B*Hkv, S, D)
        scores = torch.bmm(qg, kg.transpose(1, 2)).view(B, Hkv, rep, T, S) * self.score_scale  # (B, Hkv, rep, T, S)
        p = F.softmax(scores + mask.unsqueeze(1), dim=-1)
        if quant is not None:
            p = quant.round_probs(p)
        out = torch.bmm(p.reshape(B * Hkv, rep * T, S), v_att.float().reshape(B * Hkv, S, D))  # (B*Hkv, rep*T, D)
        out = out.view(B, H, T, D).to(dtype).transpose(1, 2).reshape(B, T, H * D)  # (B, T, H*D)
        return self.o_proj(out)

    def _through_cache(
        self, cache: KVCache, k: torch.Tensor, v: torch.Tensor, reach: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return cache.store(self.layer_idx, k, v, fp8=self.kv_quant is not None, reach=reach)


class MLP(ExpertMLP):
    """A dense layer's SwiGLU ``down(silu(gate(x)) * up(x))`` of width ``intermediate_size``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config.hidden_size, config.intermediate_size)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``+ mlp(norm(.))``, of the attention and MLP its family chose
    (:class:`Attention` or latent attention; a dense :class:`MLP` or experts)."""

    rope_key = "default"  # the RoPE table its attention rotates by (Family.rope_inv_freqs)

    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        kv_cache: KVCache | None = None,
        layout: KeyLayout | None = None,
        prefix: SharedPrefix | None = None,
    ) -> torch.Tensor:
        """``x`` ``(B, T, C)`` -> ``(B, T, C)``; arguments as :meth:`Attention.forward`."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache, layout, prefix)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """The ``model.`` prefix of HF checkpoints: ``embed_tokens``, ``layers``, ``norm``, as the config's family builds
    them."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        family = config.family
        self.embed_tokens = family.build_embedding(config)
        self.layers = nn.ModuleList(family.build_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = family.build_final_norm(config)


class CausalLM(nn.Module):
    """A causal LM of any registered family (:mod:`fp8rl.model.family`), with HF parameter names.

    Args:
        config: the architecture; weights are initialised N(0, ``initializer_range``) (biases 0,
            norms 1). Build under ``torch.device("meta")`` and load a state dict with
            ``assign=True`` to skip the init (what :func:`~fp8rl.model.load_hf_checkpoint` does).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        vision = config.family.build_vision(config)
        if vision is not None:  # a vision-language model: its encoder is "visual" (the checkpoint's name)
            self.visual = vision
        self._mrope_axes = config.family.mrope_axes(config)
        self.tie_weights()
        # Kept out of the state dict (HF names) and out of module.to(dtype): BF16 angles would be wrong. One table
        # per RoPE kind the family uses (a layer's rope_key).
        self._inv_freqs = config.family.rope_inv_freqs(config)
        self._inv_freq_by_device: dict[tuple[str, torch.device], torch.Tensor] = {}
        self.batch_invariance: BatchInvariance | None = None
        # recompute each layer in the backward instead of keeping its activations (set_activation_checkpointing)
        self.activation_checkpointing = False
        for j, router in enumerate(routers(self)):  # its place on a route's layer axis
            router.moe_index = j
        self.apply(self._init_weights)

    def _init_weights(self, m: nn.Module) -> None:
        std = self.config.initializer_range
        with torch.no_grad():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, std)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.Embedding | TopKRouter):
                m.weight.normal_(0.0, std)

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the embedding matrix when ``tie_word_embeddings`` (after loads too)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def takes_shared_prefix(self) -> bool:
        """Whether every layer's attention can record and attend a :class:`SharedPrefix` (latent attention cannot)."""
        return all(getattr(layer.self_attn, "takes_prefix", True) for layer in self.model.layers)

    @property
    def num_moe_layers(self) -> int:
        """Layers with experts (the layer axis of a route); 0 for a dense model."""
        return len(self.config.moe_layers)

    # -----------------------------------------------------------------------------------------
    # FP8 KV cache / FP8 attention
    # -----------------------------------------------------------------------------------------

    def enable_fp8_kv(self, fp8_attention: bool = True) -> list[QKVQuantizer]:
        """Install a fresh :class:`QKVQuantizer` (placeholder 1.0 scales) on every layer's attention.

        The caller sets calibrated scales (``set_scales``) before serving. Caches built earlier
        must be rebuilt (they hold the compute dtype, not E4M3).

        Returns:
            The quantizers, layer order.

        Multi-head latent attention: the scales are the query's, the latent's and the rotary key's
        (:mod:`fp8rl.model.mla`).
        """
        device = self.model.embed_tokens.weight.device
        quants = []
        for layer in self.model.layers:
            layer.self_attn.kv_quant = QKVQuantizer(fp8_attention).to(device)
            quants.append(layer.self_attn.kv_quant)
        return quants

    def disable_fp8_kv(self) -> None:
        """Remove every layer's ``kv_quant`` (back to compute-dtype K/V)."""
        for layer in self.model.layers:
            layer.self_attn.kv_quant = None

    @property
    def kv_quantizers(self) -> list[QKVQuantizer]:
        """The installed quantizers, layer order (empty when FP8 KV is off)."""
        return [la.self_attn.kv_quant for la in self.model.layers if la.self_attn.kv_quant is not None]

    # -----------------------------------------------------------------------------------------
    # batch-invariant numerics
    # -----------------------------------------------------------------------------------------

    def set_mla_absorbed(self, on: bool) -> None:
        """Multi-head latent attention in the absorbed (``on``) or the expanded form (:mod:`fp8rl.model.mla`); no-op
        for a model without it. :func:`fp8rl.fp8.convert.convert_model` sets the recipe's choice."""
        set_absorbed(self, on)

    def enable_batch_invariance(self, inv: BatchInvariance | None = None) -> None:
        """:meth:`set_batch_invariance` with ``inv`` or the default tile and chunk sizes."""
        self.set_batch_invariance(inv or BatchInvariance())

    def set_batch_invariance(self, inv: BatchInvariance | None) -> None:
        """Run every GEMM over whole row tiles and attention split-KV (:mod:`fp8rl.model.invariant`).

        Plain ``nn.Linear`` modules (the output head included) become :class:`TiledLinear` on the same
        parameters; FP8 linears (anything with a ``row_tile`` attribute) get the tile size. Call it after
        any FP8 conversion. ``None`` turns it off (the tiled modules then compute as plain linears do).
        """
        self.batch_invariance = inv
        for parent in list(self.modules()):
            for attr, child in list(parent.named_children()):
                if type(child) is nn.Linear and inv is not None:
                    setattr(parent, attr, TiledLinear.from_linear(child, inv.row_tile))
                elif hasattr(child, "row_tile"):
                    child.row_tile = inv.row_tile if inv is not None else None
        self.tie_weights()

    def set_activation_checkpointing(self, on: bool) -> None:
        """Keep only each transformer layer's input for the backward and run the layer's forward again there
        (``torch.utils.checkpoint``, non-reentrant): the saved activations of a token fall from a few
        ``hidden_size + intermediate_size`` vectors per layer to one ``hidden_size`` vector, for one more forward
        of the layers per backward. The recomputed forward is the same computation on the same inputs, so the
        gradients are bitwise the same. Refused for mixture-of-experts models: their routing plans would record
        (or replay) each recomputed forward a second time."""
        if on and self.num_moe_layers:
            raise ValueError("activation checkpointing runs no mixture-of-experts model yet (its routing plans "
                             "would see every layer's forward twice)")
        self.activation_checkpointing = on

    # -----------------------------------------------------------------------------------------
    # forward
    # -----------------------------------------------------------------------------------------

    def _rope_inv_freq(self, key: str, device: torch.device) -> torch.Tensor:
        inv = self._inv_freq_by_device.get((key, device))
        if inv is None:
            inv = self._inv_freq_by_device[key, device] = self._inv_freqs[key].to(device)
        return inv

    def encode_images(self, images: ImageBatch) -> ImageBatch:
        """``images`` with the vision encoder's outputs attached (``features``): what the engines compute once per
        prompt and pass to every forward of its rows."""
        return dataclasses.replace(images, features=self.visual(images))

    def _with_images(self, x: torch.Tensor, input_ids: torch.Tensor, images: ImageBatch
                     ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``x`` with the image tokens' embeddings replaced by the encoder's outputs, in order; and a DeepStack
        encoder's further embeddings per cell (:mod:`fp8rl.model.vision_deepstack`) as one ``(B, T, C)`` addend per
        layer they follow (zero off the image tokens)."""
        out = (images.features if images.features is not None else self.visual(images)).to(x.dtype)
        C = x.shape[-1]
        if out.shape[-1] % C:
            raise ValueError(f"the vision encoder's outputs are {out.shape[-1]} wide, not a multiple of {C}")
        feats = out[:, :C]  # (cells, C); the rest: DeepStack's, C each
        slots = input_ids == self.config.image_token_id  # (B, T)
        if images.rows is not None:  # a row's image tokens past its images' cells are text (a sampled one)
            if len(images.rows) != input_ids.shape[0]:
                raise ValueError(f"images for {len(images.rows)} rows, input_ids has {input_ids.shape[0]}")
            cells, per_row, i = images.cells(self.visual.merge), [], 0
            for n in images.rows:
                per_row.append(sum(cells[i:i + n]))
                i += n
            slots &= slots.long().cumsum(-1) <= torch.tensor(per_row, device=slots.device)[:, None]
        n = int(slots.sum())
        if n != feats.shape[0]:
            raise ValueError(f"the images make {feats.shape[0]} embeddings for {n} image tokens "
                             f"(id {self.config.image_token_id}) in input_ids")
        at = slots.unsqueeze(-1)
        deep = [torch.zeros_like(x).masked_scatter(at, out[:, k * C:(k + 1) * C]) for k in range(1, out.shape[-1] // C)]
        return x.masked_scatter(at, feats), deep

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        *,
        prefix: SharedPrefix | None = None,
        logits_to_keep: int = 0,
        token_logprobs: bool = False,
        temperature: float = 1.0,
        entropy: bool = False,
        images: ImageBatch | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of every position (or of the last ``logits_to_keep``), or the logprob of every next token.

        Args:
            input_ids: ``(B, T)`` token ids.
            position_ids: ``(B, T)`` RoPE positions. Default: with ``attention_mask``,
                ``cumsum(mask) - 1`` clamped at 0 over all keys, taken at the new tokens (left
                padding gets the same positions as the unpadded prompt); else
                ``arange(L, L + T)`` with ``L = kv_cache.length`` (0 without a cache).
            attention_mask: ``(B, S)`` key-padding mask, 1 keep / 0 pad, over every key visible in
                this call: ``S = L + T``. Causal masking is always applied on top.
            kv_cache: written at slots ``[L, L + T)`` of every layer, attended over ``[0, L + T)``,
                then advanced by ``T`` once.
            prefix: a :class:`~fp8rl.model.shared_prefix.SharedPrefix` (:mod:`fp8rl.model.shared_prefix`): while it
                records, this forward is the prefix's (one row, from position 0; every layer keeps its K/V and the
                call seals it); once sealed, ``input_ids`` are the rows' suffixes, at positions from
                ``L = prefix.length``, attending to the prefix first. Not with ``kv_cache``.
            logits_to_keep: ``k > 0`` computes the logits of the last ``k`` positions only; 0 all of them.
            token_logprobs: return, instead of logits, the logprob of each token of ``input_ids`` given the
                positions before it, under ``log_softmax(logits / temperature)``, from bounded chunks of logits
                (:func:`~fp8rl.model.logprobs.chunked_token_logprobs`): bitwise the same ops on this forward's
                full logits wherever the head's GEMM gives a row the same bits in a chunk as in the whole
                (always with batch invariance).
            temperature: with ``token_logprobs``, the sampling temperature (0 and 1: the logits as they are).
            entropy: with ``token_logprobs``, also the entropy of the distribution each token was drawn from.
            images: a vision-language model's images (:class:`~fp8rl.model.vision.ImageBatch`): their encoder
                outputs replace the embeddings of the ``image_token_id`` tokens, in order. Its multimodal RoPE
                takes ``position_ids`` ``(3, B, T)``, or ``(B, T)`` for all three axes; left None, they are
                computed from the image-token runs (:func:`~fp8rl.model.mrope.mrope_positions`; a decode through a
                cache must pass them: the image's positions shift the text after it).

        Returns:
            ``(B, T, vocab_size)`` FP32 logits (``(B, logits_to_keep, vocab_size)`` with ``logits_to_keep``).
            Rows whose query has no visible key (a pad query behind left padding) are finite garbage, never NaN.
            With ``token_logprobs``: ``(logprobs, entropy)``, FP32 ``(B, T)`` each, 0 at ``t = 0`` (nothing
            predicts the first token); entropy without gradient, None unless asked for.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
        if logits_to_keep < 0 or (token_logprobs and logits_to_keep):
            raise ValueError(f"logits_to_keep must be >= 0 and is for logits only, got {logits_to_keep} "
                             f"(token_logprobs={token_logprobs})")
        if not token_logprobs and (entropy or temperature != 1.0):
            raise ValueError("temperature and entropy are arguments of token_logprobs=True")
        B, T = input_ids.shape
        device = input_ids.device
        L = 0
        if prefix is not None:
            if kv_cache is not None:
                raise ValueError("a forward takes a kv_cache or a shared prefix, not both")
            if not self.takes_shared_prefix:
                raise ValueError(f"{self.config.architecture}'s attention takes no shared prefix")
            if prefix.recording and B != 1:
                raise ValueError(f"a shared prefix runs as one row, got {B}")
            L = 0 if prefix.recording else prefix.length
        if kv_cache is not None:
            kv_cache.check_room(B, T)
            L = kv_cache.length
        S = L + T
        if attention_mask is not None and tuple(attention_mask.shape) != (B, S):
            raise ValueError(
                f"attention_mask must be (B, S) = ({B}, {S}) (cache length {L} + {T} new tokens), "
                f"got {tuple(attention_mask.shape)}"
            )
        mrope = self._mrope_axes is not None
        if images is not None and not hasattr(self, "visual"):
            raise ValueError(f"{self.config.architecture} takes no images")
        if mrope and position_ids is None and images is not None and L == 0:
            position_ids, _ = mrope_positions(input_ids, attention_mask, images.grid_thw, self.config.image_token_id,
                                              self.visual.merge, images.rows)  # (3, B, T)
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, L:]  # (B, T)
            else:
                position_ids = torch.arange(L, S, device=device).expand(B, T)  # (B, T)
        if mrope and position_ids.dim() == 2:  # text: the same position on every axis
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        want = (3, B, T) if mrope else (B, T)
        if tuple(position_ids.shape) != want:
            raise ValueError(f"position_ids must be {want}, got {tuple(position_ids.shape)}")

        mask, layout = None, None
        if self.batch_invariance is not None:  # split-KV attention reads the key layout, not an additive mask
            keys = attention_mask if attention_mask is not None else torch.ones(B, S, dtype=torch.long, device=device)
            layout = KeyLayout.build(keys, L, T, self.batch_invariance)
            if kv_cache is not None:  # every row's keys from cache position 0: attention slices, never gathers
                kv_cache.align_rows(layout.offset)
                layout = layout.row_aligned()
        else:
            # Additive mask (B|1, 1, T, S): query i sits at time slot L + i and sees slots <= L + i.
            q_slot = torch.arange(L, S, device=device)
            visible = torch.arange(S, device=device)[None, :] <= q_slot[:, None]  # (T, S)
            visible = visible[None, None]  # (1, 1, T, S)
            if attention_mask is not None:
                visible = visible & attention_mask.bool()[:, None, None, :]  # (B, 1, T, S)
            # finfo.min rather than -inf: a fully masked row softmaxes to uniform instead of NaN
            mask = torch.zeros(visible.shape, dtype=torch.float32, device=device)
            mask.masked_fill_(~visible, torch.finfo(torch.float32).min)

        x = self.model.embed_tokens(input_ids)  # (B, T, C)
        deep: list[torch.Tensor] = []  # DeepStack: what layer k's output gains at the image tokens
        if images is not None:
            x, deep = self._with_images(x, input_ids, images)
        if mrope:
            rope = {key: mrope_cos_sin(self._rope_inv_freq(key, device), self._mrope_axes, position_ids, x.dtype)
                    for key in self._inv_freqs}
        else:
            rope = {key: rope_cos_sin(self._rope_inv_freq(key, device), position_ids, x.dtype)  # (B, T, D) each
                    for key in self._inv_freqs}
        # a prefix being recorded runs once (a recomputation would record it again); the suffixes' forward may
        recompute = (self.activation_checkpointing and kv_cache is None and torch.is_grad_enabled()
                     and not (prefix is not None and prefix.recording))
        for i, layer in enumerate(self.model.layers):
            cos, sin = rope[layer.rope_key]
            if recompute:  # only the layer's input is kept; its forward runs again in the backward
                x = checkpoint(layer, x, cos, sin, mask, None, layout, prefix, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, kv_cache, layout, prefix)
            if i < len(deep):
                x = x + deep[i]
        x = self.model.norm(x)
        if kv_cache is not None:
            kv_cache.advance(T)  # once per forward, after every layer wrote its slots
        if prefix is not None and prefix.recording:
            prefix.seal(T)
        if token_logprobs:  # position t predicts token t + 1
            h = x[:, :-1].reshape(-1, x.shape[-1])  # (B * (T-1), C)
            lp, ent = chunked_token_logprobs(h, self.lm_head, input_ids[:, 1:].reshape(-1), temperature, entropy)
            lp = F.pad(lp.view(B, T - 1), (1, 0))  # (B, T)
            return lp, F.pad(ent.view(B, T - 1), (1, 0)) if ent is not None else None
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        return self.lm_head(x).float()
