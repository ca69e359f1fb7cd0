"""``tiny-arith``: a small Llama that GRPO can improve on a laptop CPU.

``tiny-arith`` is a 4-layer, 256-wide Llama (every dim a multiple of 128, so FP8 blocks are whole)
with the character-level tokenizer. It is created from a seed and warm-started by a short
supervised run on the arithmetic word problems of :mod:`fp8rl.data.arith`, stopped as soon as
greedy accuracy on a held-out set reaches ``target_accuracy`` (default 0.3): GRPO then starts
from a model that is right sometimes and has room to improve. The result is cached on disk as a
normal Hugging Face checkpoint (``config.json`` + ``model.safetensors`` + the tokenizer file),
so everything that loads HF checkpoints loads it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from fp8rl.data import ArithConfig, ArithDataset, exact_match_grader
from fp8rl.engines.base import SamplingParams
from fp8rl.engines.torch_rollout import TorchRolloutEngine
from fp8rl.fp8 import Fp8Recipe
from fp8rl.model.config import ModelConfig
from fp8rl.model.hf_io import save_hf_checkpoint
from fp8rl.model.tokenizer import CharTokenizer, Tokenizer
from fp8rl.model.transformer import CausalLM

from .cache import PRESET_VERSION, preset_dir
from .catalog import register_preset

log = logging.getLogger(__name__)

__all__ = ["META_FILE", "TINY_ARITH", "TINY_ARITH_TASK", "greedy_accuracy", "prepare_tiny_arith", "supervised_run",
           "tiny_arith_config", "warm_start"]

TINY_ARITH = "tiny-arith"
META_FILE = "fp8rl_preset.json"  # written last: a preset directory without it is unfinished
# The task tiny-arith is warm-started on (and that GRPO then trains on): bare two-term sums and
# differences of operands up to 20 ("Q: 12+7=\nA: "). Short prompts keep a warm start at a few
# minutes on 2 CPU cores; word problems are available (ArithConfig(word_problems=True)) for
# bigger models.
TINY_ARITH_TASK = {"max_operand": 20, "num_terms": 2, "ops": ("+", "-"), "word_problems": False}


def tiny_arith_config() -> ModelConfig:
    """The tiny-arith architecture (CharTokenizer ids; vocab padded to 128)."""
    tok = CharTokenizer()
    return ModelConfig(
        architecture="llama", vocab_size=128, hidden_size=256, intermediate_size=768,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
    )


@torch.no_grad()
def greedy_accuracy(model: CausalLM, tok: Tokenizer, problems, max_tokens: int = 8, batch_size: int = 128) -> float:
    """Fraction of ``problems`` answered exactly by greedy decoding (full recompute; small models only)."""

    engine = TorchRolloutEngine(model, Fp8Recipe(linear="bf16"), eos_token_ids=[tok.eos_id],
                                max_batch_size=batch_size, pad_token_id=tok.pad_id)
    prompts = [tok.encode(p.prompt) for p in problems]
    samples = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    right = [exact_match_grader(tok.decode(s.token_ids), problems[s.prompt_index].answer) for s in samples]
    return sum(right) / max(len(right), 1)


def _sft_batch(tok: CharTokenizer, problems) -> tuple[torch.Tensor, torch.Tensor]:
    rows, masks = [], []
    for p in problems:
        prompt = tok.encode(p.prompt)
        answer = tok.encode(p.answer, add_bos=False, add_eos=True)
        rows.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))  # learn the completion only
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), tok.pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), T)
    for i, (r, m) in enumerate(zip(rows, masks, strict=True)):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids, mask


def prepare_tiny_arith(
    directory: str | Path | None = None,
    *,
    seed: int = 0,
    max_steps: int = 1500,
    batch_size: int = 64,
    lr: float = 2e-3,
    target_accuracy: float = 0.3,
    eval_every: int = 50,
    eval_size: int = 200,
    progress: bool = True,
    force: bool = False,
) -> Path:
    """Create (or reuse) the cached tiny-arith checkpoint and return its directory.

    Deterministic for a given seed and thread count. Stops at ``max_steps`` or as soon as greedy
    accuracy on ``eval_size`` held-out problems reaches ``target_accuracy``.
    """
    out = Path(directory) if directory is not None else preset_dir(TINY_ARITH)
    if (out / META_FILE).exists() and not force:
        return out
    torch.manual_seed(seed)
    cfg = tiny_arith_config()
    return warm_start(CausalLM(cfg), cfg, out, TINY_ARITH, seed=seed, max_steps=max_steps, batch_size=batch_size,
                      lr=lr, target_accuracy=target_accuracy, eval_every=eval_every, eval_size=eval_size,
                      progress=progress)


def supervised_run(model: CausalLM, name: str, batch: Callable[[int], tuple[torch.Tensor, torch.Tensor, dict]],
                   accuracy: Callable[[CausalLM], float], *, max_steps: int, lr: float, warmup: int,
                   target_accuracy: float, eval_every: int, progress: bool, min_steps: int = 0) -> tuple[int, float]:
    """The presets' warm start: AdamW (warm-up then cosine) on the completion tokens of ``batch(step)`` (``(ids,
    loss mask, forward kwargs)``), every ``eval_every`` steps ``accuracy(model)``, stopped at ``max_steps`` or once it
    reaches ``target_accuracy`` (after ``min_steps`` at least). Returns ``(steps run, last accuracy)``."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        return lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, max_steps - warmup))))

    acc = 0.0
    bar = tqdm(range(max_steps), desc=f"{name} warm start", disable=not progress, unit="step")
    step = 0
    model.train()
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        ids, mask, kwargs = batch(step)
        logits = model(ids, **kwargs)[:, :-1]  # (B, T-1, V)
        loss_tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
        loss = (loss_tok * mask[:, 1:].reshape(-1)).sum() / mask[:, 1:].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % eval_every == 0:
            acc = accuracy(model.eval())
            model.train()
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.2f}")
            if acc >= target_accuracy and step + 1 >= min_steps:
                break
    return step + 1, acc


def warm_start(model: CausalLM, cfg: ModelConfig, out: Path, name: str, *, seed: int, max_steps: int,
               batch_size: int, lr: float, target_accuracy: float, eval_every: int, eval_size: int, progress: bool,
               meta: dict | None = None, min_steps: int = 0) -> Path:
    """A short supervised run of ``model`` on :data:`TINY_ARITH_TASK` (:func:`supervised_run`, 50 warm-up steps),
    stopped at ``max_steps`` or once greedy accuracy on ``eval_size`` held-out problems reaches ``target_accuracy``
    (after ``min_steps`` at least); the result saved as an HF checkpoint in ``out`` with the tokenizer and
    ``fp8rl_preset.json``."""
    tok = CharTokenizer()
    data = ArithDataset(ArithConfig(**TINY_ARITH_TASK), seed=seed)
    eval_set = data.eval_set(eval_size)
    t0 = time.perf_counter()
    steps, acc = supervised_run(model, name, lambda step: (*_sft_batch(tok, data.batch(step, batch_size)), {}),
                                lambda m: greedy_accuracy(m, tok, eval_set), max_steps=max_steps, lr=lr, warmup=50,
                                target_accuracy=target_accuracy, eval_every=eval_every, progress=progress,
                                min_steps=min_steps)
    out.mkdir(parents=True, exist_ok=True)
    save_hf_checkpoint(model.eval(), cfg, out)
    tok.save(out)
    meta = {"preset": name, "version": PRESET_VERSION, "task": TINY_ARITH_TASK, "seed": seed, **(meta or {}),
            "sft_steps": steps, "greedy_accuracy": acc, "eval_size": eval_size,
            "seconds": round(time.perf_counter() - t0, 1)}
    (out / META_FILE).write_text(json.dumps(meta, indent=2))
    log.info("%s ready in %s: %s", name, out, meta)
    return out


register_preset(TINY_ARITH, lambda progress: prepare_tiny_arith(progress=progress))
