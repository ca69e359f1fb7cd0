"""``tiny-vl``: a small Qwen2.5-VL that GRPO can improve on a laptop CPU, on pictures (``data.task: shapes``).

The language tower is tiny-arith's (its dims, copied weights; Qwen2's q/k/v biases start at 0, so it computes
tiny-arith again), with multimodal RoPE; the vision encoder is new and small (2 blocks, 128 wide, 14-pixel patches
merged 2 × 2, one full-attention block) and never FP8. The vision special tokens take ids of tiny-arith's vocabulary
that the character tokenizer leaves unused (124 … 127). A short supervised run on the counting task
(:mod:`fp8rl.data.shapes`: pictures of 56 × 56 pixels, 4 image tokens each) trains both towers until greedy
accuracy on held-out pictures reaches ``target_accuracy`` — above chance (1 in 4), with room for GRPO to improve.
Cached like every preset, as a Qwen2.5-VL HF checkpoint with a ``preprocessor_config.json`` fixing the pictures'
size, and its tokenizer twice: fp8rl's character file (what fp8rl reads) and the same ids as a Hugging Face fast
tokenizer with the vision special tokens (:mod:`fp8rl.model.char_tokenizer_hf`), so ``AutoTokenizer`` loads the
directory and transformers' Qwen2.5-VL processor expands ``<|image_pad|>`` into the ids fp8rl's prompts hold.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from pathlib import Path

import torch

from fp8rl.data import exact_match_grader
from fp8rl.data.shapes import CELL, GRID, ShapesDataset
from fp8rl.engines.base import SamplingParams
from fp8rl.engines.torch_rollout import TorchRolloutEngine
from fp8rl.fp8 import Fp8Recipe
from fp8rl.model.char_tokenizer_hf import save_char_tokenizer_hf, vision_special_tokens
from fp8rl.model.config import ModelConfig
from fp8rl.model.families.vision_language import VisionLanguageConfig
from fp8rl.model.hf_io import load_hf_checkpoint, read_model_config, save_hf_checkpoint
from fp8rl.model.image_inputs import PromptImages, VisionProcessor
from fp8rl.model.tokenizer import CharTokenizer
from fp8rl.model.transformer import CausalLM
from fp8rl.model.vision import ImageBatch

from .cache import PRESET_VERSION, preset_dir
from .catalog import register_preset
from .tiny_arith import META_FILE, prepare_tiny_arith, supervised_run

log = logging.getLogger(__name__)

__all__ = ["TINY_VL", "prepare_tiny_vl", "tiny_vl_config"]

TINY_VL = "tiny-vl"
HF_TOKENIZER = "tokenizer.json"
PICTURE_PIXELS = (GRID * CELL) ** 2  # the processor keeps the 56 x 56 pictures as they are
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": PICTURE_PIXELS,
                "max_pixels": PICTURE_PIXELS, "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
                "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
                "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                "do_convert_rgb": True}
VISION = {"depth": 2, "hidden_size": 128, "num_heads": 2, "intermediate_size": 256, "patch_size": 14,
          "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3, "window_size": 112,
          "fullatt_block_indexes": [1], "hidden_act": "silu"}


def tiny_vl_config(text: ModelConfig) -> VisionLanguageConfig:
    """The Qwen2.5-VL twin of tiny-arith's ``text`` config: its language tower, a small vision encoder."""
    d = {k: v for k, v in text.__dict__.items() if k not in ("architecture", "qk_norm", "attention_bias")}
    half = text.head_dim // 2
    section = (half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2)
    return VisionLanguageConfig(architecture="qwen2_5_vl", **d, attention_bias=True,
                                vision_config={**VISION, "out_hidden_size": text.hidden_size},
                                image_token_id=124, video_token_id=125, vision_start_token_id=126,
                                vision_end_token_id=127, mrope_section=section)


@torch.no_grad()
def _from_text(text: CausalLM, cfg: VisionLanguageConfig) -> CausalLM:
    """A fresh VLM of ``cfg`` whose language tower is ``text``'s (the q/k/v biases it lacks at 0)."""
    vl = CausalLM(cfg)
    src = text.state_dict()
    for name, p in vl.state_dict().items():
        if name in src:
            p.copy_(src[name])
        elif name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            p.zero_()
    return vl


def write_hf_tokenizer(out: Path, cfg: VisionLanguageConfig | None = None) -> None:
    """The character tokenizer in ``out`` written beside itself as a Hugging Face tokenizer with the vision tokens
    of ``cfg`` (the directory's own config when not given); written whole or not at all."""
    cfg = cfg if cfg is not None else read_model_config(out)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        names = save_char_tokenizer_hf(CharTokenizer.load(out), tmp, vision_special_tokens(cfg))
        for name in sorted(names, key=lambda n: n == HF_TOKENIZER):  # tokenizer.json, which marks it done, last
            (Path(tmp) / name).replace(out / name)


def _batch(tok: CharTokenizer, images: PromptImages, problems) -> tuple[torch.Tensor, torch.Tensor, ImageBatch]:
    """Right-padded supervised rows (prompt with its picture's tokens, then the answer and EOS), the loss mask on the
    answer, and the pictures."""
    rows, masks, pics = [], [], []
    for p in problems:
        prompt = images.prompt(p.prompt, p.images, lambda piece, first: tok.encode(piece, add_bos=first))
        answer = tok.encode(p.answer, add_bos=False, add_eos=True)
        rows.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
        pics.append(images.batch(p.images))
    T = max(map(len, rows))
    ids = torch.full((len(rows), T), tok.pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), T)
    for i, (r, m) in enumerate(zip(rows, masks, strict=True)):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids, mask, ImageBatch.concat(pics)


def greedy_picture_accuracy(model: CausalLM, tok: CharTokenizer, images: PromptImages, problems) -> float:
    """Fraction of ``problems`` (pictures) answered exactly by greedy decoding."""
    engine = TorchRolloutEngine(model, Fp8Recipe(linear="bf16"), eos_token_ids=[tok.eos_id],
                                max_batch_size=len(problems), pad_token_id=tok.pad_id)
    prompts = [images.prompt(p.prompt, p.images, lambda piece, first: tok.encode(piece, add_bos=first))
               for p in problems]
    samples = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4),
                              images=[images.batch(p.images) for p in problems])
    right = [exact_match_grader(tok.decode(s.token_ids), problems[s.prompt_index].answer) for s in samples]
    return sum(right) / max(len(right), 1)


def prepare_tiny_vl(directory: str | Path | None = None, *, seed: int = 0, max_steps: int = 600, batch_size: int = 32,
                    lr: float = 5e-4, target_accuracy: float = 0.4, eval_every: int = 10, eval_size: int = 128,
                    progress: bool = True, force: bool = False) -> Path:
    """Create (or reuse) the cached tiny-vl checkpoint (tiny-arith is prepared first) and return its directory.

    Deterministic for a given seed and thread count. Stops at ``max_steps`` or as soon as greedy accuracy on
    ``eval_size`` held-out pictures reaches ``target_accuracy``.
    """
    out = Path(directory) if directory is not None else preset_dir(TINY_VL)
    if (out / META_FILE).exists() and not force:
        if not (out / HF_TOKENIZER).is_file():  # a preset cached before the file was written: only it is added
            write_hf_tokenizer(out)
        return out
    text, text_cfg = load_hf_checkpoint(prepare_tiny_arith(progress=progress))
    cfg = tiny_vl_config(text_cfg)
    torch.manual_seed(seed)
    model = _from_text(text, cfg)
    tok = CharTokenizer()
    images = PromptImages(VisionProcessor(cfg.vision_config, PREPROCESSOR), cfg)
    data = ShapesDataset(seed)
    eval_set = data.eval_set(eval_size)
    t0 = time.perf_counter()

    def batch(step: int):  # past step 10**6 of the training stream: apart from what a GRPO job on seed 0 draws
        ids, mask, pics = _batch(tok, images, data.batch(10**6 + step, batch_size))
        return ids, mask, {"images": pics}

    steps, acc = supervised_run(model, TINY_VL, batch, lambda m: greedy_picture_accuracy(m, tok, images, eval_set),
                                max_steps=max_steps, lr=lr, warmup=25, target_accuracy=target_accuracy,
                                eval_every=eval_every, progress=progress)
    out.mkdir(parents=True, exist_ok=True)
    save_hf_checkpoint(model.eval(), cfg, out)
    tok.save(out)
    write_hf_tokenizer(out, cfg)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")
    meta = {"preset": TINY_VL, "version": PRESET_VERSION, "task": "shapes", "seed": seed,
            "language_tower_from": "tiny-arith", "sft_steps": steps, "greedy_accuracy": acc,
            "eval_size": eval_size, "seconds": round(time.perf_counter() - t0, 1)}
    (out / META_FILE).write_text(json.dumps(meta, indent=2))
    log.info("%s ready in %s: %s", TINY_VL, out, meta)
    return out


register_preset(TINY_VL, lambda progress: prepare_tiny_vl(progress=progress))
