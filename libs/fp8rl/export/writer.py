"""Write one Hugging Face model directory, whole or not at all.

Layout (what ``transformers.AutoModelForCausalLM.from_pretrained`` and vLLM read):

* ``model.safetensors`` — or, past :data:`MAX_SHARD_BYTES`, ``model-0000i-of-0000n.safetensors`` shards plus
  ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``), tensors in name order;
* ``config.json`` — :meth:`ModelConfig.to_hf_dict` in the weights' dtype, plus ``quantization_config`` for FP8 (of
  a vision-language source, the source's own: :mod:`fp8rl.model.vision_language`);
* tokenizer files and ``generation_config.json`` (:mod:`.tokenizer_files`);
* ``fp8rl_export.json`` — where it came from: the checkpoint, its kind and version, the model source, the
  format and the recipe.

Everything is written into a temporary directory beside ``out`` (same file system) and renamed into place
last, so a failed or interrupted export leaves ``out`` as it was; an ``out`` that holds files is replaced only
when the caller says so (``force``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from fp8rl.model import ModelConfig
from fp8rl.model.hf_io import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE

from .readers import ExportError
from .tokenizer_files import write_tokenizer_files

__all__ = ["EXPORT_RECORD", "MAX_SHARD_BYTES", "check_out_dir", "high_precision_dtype", "write_hf_dir"]

EXPORT_RECORD = "fp8rl_export.json"
MAX_SHARD_BYTES = 5 * 1024**3  # transformers' save_pretrained default ("5GB")


def check_out_dir(out: Path, force: bool) -> None:
    """Refuse an ``out`` that is a file, or a directory holding anything, unless ``force``.

    Raises:
        ExportError: naming ``out`` and the way out (``--force``).
    """
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; give a directory (it is created)")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"--out {out} is not empty; choose another directory or pass --force to replace it")


def write_hf_dir(out: Path, tensors: Mapping[str, torch.Tensor], config: ModelConfig, *, tokenizer_source: Path,
                 quantization: dict | None = None, record: dict | None = None, force: bool = False,
                 progress: bool = False, hf_config: dict | None = None) -> int:
    """Write the directory of the module docstring; the bytes written.

    Args:
        out: the directory to create (or, with ``force``, to replace).
        tensors: HF-named tensors as they are to be stored (high precision, or E4M3 + block scales).
        config: the model's config.
        tokenizer_source: the model directory whose tokenizer and generation files are copied.
        quantization: ``config.json``'s ``quantization_config`` (hf-fp8), or None.
        record: provenance written to ``fp8rl_export.json``.
        force: replace an ``out`` that holds files.
        progress: a progress bar over the weight files (stderr).
        hf_config: the ``config.json`` to write instead of ``config``'s (a vision-language source's own).

    Raises:
        ExportError: ``out`` is a file or not empty without ``force``; the tokenizer source holds no tokenizer.
    """
    out = Path(out).absolute()
    check_out_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.export-{os.getpid()}.tmp")  # beside out: the final rename stays on one disk
    shutil.rmtree(tmp, ignore_errors=True)  # left by an export of this pid that was killed
    tmp.mkdir()  # (the umask's permissions, unlike mkdtemp's 0700)
    try:
        _write_weights(tmp, tensors, progress)
        dtype = high_precision_dtype(tensors)
        cfg = config.to_hf_dict(torch_dtype=str(dtype).removeprefix("torch.")) if hf_config is None else hf_config
        if quantization is not None:
            cfg["quantization_config"] = quantization
        (tmp / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
        try:
            write_tokenizer_files(Path(tokenizer_source), tmp, config)
        except (OSError, ValueError) as e:
            raise ExportError(f"tokenizer of {tokenizer_source}: {e}") from None
        (tmp / EXPORT_RECORD).write_text(json.dumps(record or {}, indent=2, default=str) + "\n")
        size = sum(f.stat().st_size for f in tmp.iterdir())
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return size


def high_precision_dtype(tensors: Mapping[str, torch.Tensor]) -> torch.dtype:
    """The dtype of the high-precision tensors (the embedding's: FP8 layouts keep it in high precision)."""
    emb = tensors.get("model.embed_tokens.weight")
    return emb.dtype if emb is not None else next(t.dtype for t in tensors.values() if t.dtype.itemsize > 1)


def _write_weights(tmp: Path, tensors: Mapping[str, torch.Tensor], progress: bool) -> None:
    """One safetensors file, or name-ordered shards of at most :data:`MAX_SHARD_BYTES` plus their index."""
    names = sorted(tensors)
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        b = tensors[n].numel() * tensors[n].element_size()
        if shards[-1] and size + b > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += b
    total = sum(tensors[n].numel() * tensors[n].element_size() for n in names)
    files = [WEIGHTS_FILE] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    bar = tqdm(total=total, desc="write safetensors", unit="B", unit_scale=True, disable=not progress,
               file=sys.stderr)
    with bar:
        for file, part in zip(files, shards, strict=True):
            save_file({n: tensors[n].detach().to("cpu").contiguous() for n in part}, str(tmp / file),
                      metadata={"format": "pt"})
            bar.update(sum(tensors[n].numel() * tensors[n].element_size() for n in part))
    if len(files) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: f for f, part in zip(files, shards, strict=True) for n in part}}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _replace(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` (empty, or ``force``) is moved aside first, then removed."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        if old is not None:
            old.rename(out)  # put it back: nothing lost
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
