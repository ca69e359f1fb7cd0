"""``tiny-arith-moe``: tiny-arith upcycled into a small Qwen3-MoE (8 experts, top-2), warm-started the same way.

Sparse upcycling (Komatsuzaki et al., 2022): from the cached tiny-arith checkpoint, the embeddings, attention,
norms and output head are copied; in every layer each of the 8 experts starts as that layer's dense SwiGLU MLP
(width 768, a multiple of 128: whole FP8 blocks) plus a little noise that breaks their symmetry, and the router
starts small and random. With the top-2 weights renormalised (``norm_topk_prob``) an upcycled layer computes
its dense MLP again, so the model starts close to tiny-arith. Qwen3's QK-norm is new: a short supervised run on
the same arithmetic task (:func:`~fp8rl.presets.tiny_arith.warm_start`, 100 steps at least, then to the same
accuracy target) lets the attention, the experts and the router adjust. Cached like every preset, as a
Qwen3-MoE HF checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fp8rl.model.config import ModelConfig
from fp8rl.model.hf_io import load_hf_checkpoint
from fp8rl.model.transformer import CausalLM

from .cache import preset_dir
from .catalog import register_preset
from .tiny_arith import META_FILE, prepare_tiny_arith, warm_start

__all__ = ["TINY_ARITH_MOE", "prepare_tiny_arith_moe", "tiny_arith_moe_config"]

TINY_ARITH_MOE = "tiny-arith-moe"
EXPERTS, TOP_K = 8, 2
EXPERT_NOISE = 1e-2  # relative std of the noise added to each expert's copy of the dense MLP
MIN_STEPS = 100  # supervised steps at least, so the router and the experts move away from their start


def tiny_arith_moe_config(dense: ModelConfig) -> ModelConfig:
    """The Qwen3-MoE twin of tiny-arith's ``dense`` config: every layer 8 experts of its MLP's width, top-2."""
    d = {k: v for k, v in dense.__dict__.items() if k not in ("architecture", "qk_norm", "attention_bias")}
    return ModelConfig(architecture="qwen3_moe", **{**d, "num_experts": EXPERTS, "num_experts_per_tok": TOP_K,
                                                    "moe_intermediate_size": dense.intermediate_size,
                                                    "norm_topk_prob": True, "decoder_sparse_step": 1})


@torch.no_grad()
def upcycle(dense: CausalLM, cfg: ModelConfig, *, generator: torch.Generator) -> CausalLM:
    """A :class:`CausalLM` of ``cfg`` whose shared weights are ``dense``'s and whose experts are its MLPs (+ noise)."""
    moe = CausalLM(cfg)
    src = dense.state_dict()
    for name, p in moe.state_dict().items():
        if name in src:
            p.copy_(src[name])
        elif ".mlp.experts." in name:
            layer, _, rest = name.partition(".mlp.experts.")
            w = src[f"{layer}.mlp.{rest.split('.', 1)[1]}"]  # e.g. ...mlp.gate_proj.weight
            p.copy_(w + EXPERT_NOISE * w.std() * torch.randn(w.shape, generator=generator))
        # the router (and q_norm / k_norm, at 1) keep their fresh initialisation
    return moe


def prepare_tiny_arith_moe(directory: str | Path | None = None, *, seed: int = 0, max_steps: int = 1500,
                           batch_size: int = 64, lr: float = 1e-3, target_accuracy: float = 0.3, eval_every: int = 25,
                           eval_size: int = 200, progress: bool = True, force: bool = False) -> Path:
    """Create (or reuse) the cached tiny-arith-moe checkpoint (tiny-arith is prepared first) and return its directory.

    Deterministic for a given seed and thread count.
    """
    out = Path(directory) if directory is not None else preset_dir(TINY_ARITH_MOE)
    if (out / META_FILE).exists() and not force:
        return out
    dense, dense_cfg = load_hf_checkpoint(prepare_tiny_arith(progress=progress))
    cfg = tiny_arith_moe_config(dense_cfg)
    torch.manual_seed(seed)
    model = upcycle(dense, cfg, generator=torch.Generator().manual_seed(seed))
    return warm_start(model, cfg, out, TINY_ARITH_MOE, seed=seed, max_steps=max_steps, batch_size=batch_size, lr=lr,
                      target_accuracy=target_accuracy, eval_every=eval_every, eval_size=eval_size, progress=progress,
                      meta={"upcycled_from": "tiny-arith", "experts": EXPERTS, "top_k": TOP_K},
                      min_steps=MIN_STEPS)


register_preset(TINY_ARITH_MOE, lambda progress: prepare_tiny_arith_moe(progress=progress))
