"""The three verbs: export a checkpoint, save a live policy, load a checkpoint for evaluation.

Which model a checkpoint belongs to: the ``--model`` the caller names (a preset or an HF model directory),
else the ``model_source`` the checkpoint records. Its config is the one the checkpoint records, else that
model's ``config.json``; when both exist they must agree (a checkpoint exported with another model's
tokenizer would be silently wrong). The tokenizer, chat template and generation config always come from that
model directory.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fp8rl.fp8 import E4M3, Fp8Recipe
from fp8rl.model import CausalLM, ModelConfig, model_from_tensors
from fp8rl.model.hf_io import CONFIG_FILE, load_hf_tensors, read_model_config
from fp8rl.model.lora import expand_shared_experts
from fp8rl.model.tokenizer import Tokenizer, load_tokenizer
from fp8rl.model.vision_language import vision_language_of, whole_checkpoint_tensors
from fp8rl.presets import PRESETS, prepare_preset

from .hf_fp8 import fp8_recipe_for_export, hub_fp8_tensors
from .peft import lora_settings_of, merged_with_base, write_peft_dir
from .readers import ExportError, TrainerCheckpoint, check_tensors, read_checkpoint
from .writer import check_out_dir, high_precision_dtype, write_hf_dir

__all__ = ["FORMATS", "ExportResult", "export_checkpoint", "load_checkpoint_policy", "resolve_model",
           "save_policy_hf"]

FORMATS = ("hf", "hf-fp8", "peft")


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote.

    Attributes:
        out: the directory (absolute).
        fmt: ``"hf"`` or ``"hf-fp8"``.
        bytes_written: the size of every file in it.
        seconds: wall time of the whole export (reading included).
    """

    out: Path
    fmt: str
    bytes_written: int
    seconds: float


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, fmt: str = "hf", model: str | None = None,
                      progress: bool = True, force: bool = False, num_first_layers_in_bf16: int | None = None,
                      num_last_layers_in_bf16: int | None = None) -> ExportResult:
    """Turn a trainer checkpoint (``.pt``, ``.dcp``, Megatron ``.pt``) or an HF directory into an HF directory.

    Args:
        checkpoint: the checkpoint (:func:`~fp8rl.export.readers.read_checkpoint` tells its kind).
        out: the directory to write; refused when it holds files, unless ``force``.
        fmt: ``"hf"`` (the master weights in their dtype) or ``"hf-fp8"`` (:mod:`fp8rl.export.hf_fp8`); of a LoRA
            checkpoint, the base with the adapters merged in; ``"peft"``: a LoRA checkpoint's adapters as a PEFT
            adapter directory (:mod:`fp8rl.export.peft`).
        model: preset name or HF model directory of the checkpoint's model; default the one it records.
        progress: progress bars on stderr.
        force: replace a non-empty ``out``.
        num_first_layers_in_bf16: hf-fp8: leading layers kept in high precision, instead of the recorded
            recipe's (a checkpoint from before the record knows only whether it trained in FP8).
        num_last_layers_in_bf16: hf-fp8: likewise for the trailing layers.

    Raises:
        ExportError: unknown ``fmt``, ``out`` not empty, an unreadable checkpoint, an unknown model, weights that
            do not fit it (each message names the path or key).
    """
    t0 = time.perf_counter()
    _check_format(fmt)
    out = Path(out).absolute()
    src = Path(checkpoint).absolute()
    if out == src or out in src.parents:
        raise ExportError(f"--out {out} would replace the checkpoint {src} itself; choose another directory")
    check_out_dir(out, force)  # before reading gigabytes
    ck = read_checkpoint(checkpoint)
    config, source, source_dir = _model_of(ck, model)
    if source_dir is None:
        raise ExportError(f"{ck.path} records no model directory to take the tokenizer from; pass --model "
                          f"PRESET_OR_HF_DIR ({', '.join(PRESETS)} or a directory with config.json)")
    _vision_language_source(source_dir, fmt, config)  # refused before anything is written
    record = {"checkpoint": str(src), "kind": ck.kind, "version": ck.version,
              "model_source": source, "format": fmt}
    if ck.lora is None:
        if fmt == "peft":
            raise ExportError(f"--format peft needs a LoRA checkpoint (policy.lora.enabled: true); {ck.path} holds "
                              "every weight: export it as hf or hf-fp8")
        tensors = ck.hf_tensors(config)
    else:
        settings = lora_settings_of(ck.lora, ck.path)
        adapters = expand_shared_experts(ck.adapters, config.num_experts) if settings.share_experts else ck.adapters
        if fmt == "peft":
            size = write_peft_dir(out, adapters, settings, base_model=source,
                                  record={**record, "base_checksum": ck.lora["base_checksum"]}, force=force)
            return ExportResult(out, fmt, size, time.perf_counter() - t0)
        tensors = merged_with_base(source, adapters, settings, recorded_checksum=ck.lora["base_checksum"],
                                   where=ck.path)
        if config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        check_tensors(tensors, config, ck.path)
    use = ck.recipe
    overrides = {k: v for k, v in (("num_first_layers_in_bf16", num_first_layers_in_bf16),
                                   ("num_last_layers_in_bf16", num_last_layers_in_bf16)) if v is not None}
    if overrides:
        try:
            use = dataclasses.replace(use or Fp8Recipe(), **overrides)
        except ValueError as e:
            raise ExportError(str(e)) from None
    size = _write(out, tensors, config, source_dir, fmt, use, record, force, progress)
    return ExportResult(out, fmt, size, time.perf_counter() - t0)


def save_policy_hf(model: CausalLM, tokenizer_source: str | Path, out: str | Path, *, fmt: str = "hf",
                   recipe: Fp8Recipe | None = None, force: bool = False, progress: bool = False) -> ExportResult:
    """Write a live in-memory policy as an HF directory (the same layout as :func:`export_checkpoint`).

    Args:
        model: a :class:`CausalLM` holding whole high-precision weights — the trainer's model of a one-process
            trainer (its FP8 linears keep master weights under HF names) or a loaded policy; not a rollout
            engine's FP8 inference model.
        tokenizer_source: the model directory whose tokenizer and generation config to copy
            (``load_policy``'s third value).
        out: the directory to write.
        fmt: ``"hf"`` or ``"hf-fp8"``.
        recipe: hf-fp8: the recipe whose FP8 layers to quantize; default the model's own (``convert_model`` sets
            ``model.fp8_recipe``), else every layer.
        force: replace a non-empty ``out``.
        progress: progress bars on stderr.

    Raises:
        ExportError: unknown ``fmt``, ``out`` not empty, the model holds E4M3 weights or tensors that are not HF's.
    """
    t0 = time.perf_counter()
    _check_format(fmt)
    out = Path(out).absolute()
    check_out_dir(out, force)
    config = model.config
    tensors = {k: v.detach() for k, v in model.state_dict().items() if ".kv_quant." not in k}
    e4m3 = sorted(k for k, v in tensors.items() if v.dtype == E4M3)
    if e4m3:
        raise ExportError(f"the model holds E4M3 weights ({e4m3[0]} ...): an FP8 inference model; save the "
                          f"trainer's high-precision master weights instead")
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    check_tensors(tensors, config, "the model")
    record = {"model_source": getattr(model, "name_or_path", None) or str(tokenizer_source), "format": fmt}
    size = _write(out, tensors, config, Path(tokenizer_source), fmt, recipe or getattr(model, "fp8_recipe", None),
                  record, force, progress)
    return ExportResult(out, fmt, size, time.perf_counter() - t0)


def load_checkpoint_policy(checkpoint: str | Path, *, model: str | None = None,
                           dtype: torch.dtype = torch.float32) -> tuple[CausalLM, Tokenizer, Path]:
    """Any checkpoint kind (or an HF directory) as ``(policy, tokenizer, model_path)``, like ``load_policy``.

    Args:
        checkpoint: a trainer checkpoint or an HF model directory.
        model: preset name or HF model directory of its model; default the one it records.
        dtype: the policy's parameter dtype.

    Returns:
        the policy in eval mode (``name_or_path`` set, so a trainer built on it records the same model), its
        tokenizer, and the model directory the tokenizer and generation config come from.

    Raises:
        ExportError: as :func:`export_checkpoint`, or no model directory is known.
    """
    ck = read_checkpoint(checkpoint)
    config, source, source_dir = _model_of(ck, model)
    if source_dir is None:
        raise ExportError(f"{ck.path} records no model directory to take the tokenizer from; pass "
                          f"model=PRESET_OR_HF_DIR")
    policy = model_from_tensors(config, {k: v.to(dtype=dtype, copy=True) for k, v in ck.hf_tensors(config).items()})
    policy.name_or_path = source
    return policy, load_tokenizer(source_dir), source_dir


def resolve_model(name_or_path: str) -> Path:
    """The model directory of a preset name (prepared on first use) or of an HF model directory.

    Raises:
        ExportError: neither a preset nor a directory with ``config.json``, or the preset cannot be prepared.
    """
    if name_or_path in PRESETS:
        try:
            return prepare_preset(name_or_path, progress=False)
        except (ImportError, OSError, ValueError) as e:  # e.g. smollm2's PyPI package not installed
            raise ExportError(f"preset {name_or_path!r} cannot be prepared: {e}") from None
    path = Path(name_or_path)
    if not (path / CONFIG_FILE).is_file():
        raise ExportError(f"model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a model "
                          f"directory with {CONFIG_FILE}")
    return path


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}: expected one of {', '.join(FORMATS)}")


def _model_of(ck: TrainerCheckpoint, model: str | None) -> tuple[ModelConfig, str | None, Path | None]:
    """``(config, source, source_dir)`` of checkpoint ``ck`` (module docstring); ``source_dir`` None when no
    model directory is known."""
    source = model or ck.model_source
    source_dir = None
    if source is not None:
        try:
            source_dir = resolve_model(source)
        except ExportError as e:
            if model is not None:
                raise
            raise ExportError(f"{ck.path} records its model as {source!r}, which is not here ({e}); pass --model "
                              f"PRESET_OR_HF_DIR") from None
    src_cfg = None
    if source_dir is not None:
        # of a vision-language source, the whole model where the checkpoint trained it whole, else its text tower
        # (policy.language_model_only; a checkpoint that records no config was trained on text)
        whole = ck.model_config is not None and ck.model_config.family.vision
        try:
            src_cfg = read_model_config(source_dir, language_model_only=not whole)
        except (OSError, ValueError, TypeError) as e:
            raise ExportError(f"{source_dir / CONFIG_FILE}: not a supported model config: {e}") from None
    config = ck.model_config or src_cfg
    if config is None:
        raise ExportError(f"{ck.path} does not record its model (a checkpoint from before the record); pass "
                          f"--model PRESET_OR_HF_DIR ({', '.join(PRESETS)} or a directory with {CONFIG_FILE})")
    if src_cfg is not None and ck.model_config is not None and src_cfg != ck.model_config:
        a, b = ck.model_config.to_hf_dict(), src_cfg.to_hf_dict()
        keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        diff = ", ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in keys[:6]) + \
            (f" ... and {len(keys) - 6} more" if len(keys) > 6 else "")
        raise ExportError(f"{ck.path} was trained on another model than {source!r}: checkpoint vs model config "
                          f"differ in {diff}")
    return config, source, source_dir


def _vision_language_source(source_dir: Path, fmt: str, config: ModelConfig) -> dict | None:
    """The ``config.json`` of a vision-language ``source_dir`` whose text tower alone was trained (``config`` is the
    text family's), None otherwise; ``ExportError`` for a format not written for a vision-language model."""
    source_cfg = json.loads((source_dir / CONFIG_FILE).read_text())
    if vision_language_of(source_cfg) is None:
        return None
    if fmt != "hf":
        raise ExportError(f"{source_dir} is a vision-language model: it exports as --format hf (the whole model, "
                          f"vision encoder included); {fmt} is not written for it yet")
    return None if config.family.vision else source_cfg  # a whole VLM writes its own config and tensors


def _write(out: Path, tensors: dict, config: ModelConfig, source_dir: Path, fmt: str, recipe: Fp8Recipe | None,
           record: dict, force: bool, progress: bool) -> int:
    hf_config = _vision_language_source(source_dir, fmt, config)
    if hf_config is not None:  # the whole model back: the trained text tower beside the source's vision encoder
        dtype = str(high_precision_dtype(tensors)).removeprefix("torch.")
        try:
            tensors = whole_checkpoint_tensors(tensors, load_hf_tensors(source_dir))
        except (OSError, ValueError) as e:
            raise ExportError(f"{source_dir}: {e}") from None
        hf_config = {**hf_config, "dtype": dtype, "torch_dtype": dtype}
    else:  # a model under its own family's checkpoint names (a whole VLM's may differ from fp8rl's)
        tensors = config.family.to_checkpoint(dict(tensors))
    quantization = None
    if fmt == "hf-fp8":
        used = fp8_recipe_for_export(recipe)
        tensors, quantization = hub_fp8_tensors(tensors, config, used, progress=progress)
        record = {**record, "recipe": dataclasses.asdict(used)}
    return write_hf_dir(out, tensors, config, tokenizer_source=source_dir, quantization=quantization,
                        record=record, force=force, progress=progress, hf_config=hf_config)
