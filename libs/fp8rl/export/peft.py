"""LoRA checkpoints out (issue 33): a PEFT adapter directory, or the base with the adapters merged in.

``--format peft`` writes what ``peft.PeftModel.from_pretrained(base, DIR)`` and vLLM's LoRA loader read:

* ``adapter_model.safetensors`` — every adapter matrix under PEFT's names (``base_model.model.`` + fp8rl's name,
  ``...q_proj.lora_A.weight``), FP32 as trained;
* ``adapter_config.json`` — PEFT's LoraConfig (:func:`fp8rl.model.lora.peft_config`): rank, alpha, dropout,
  target modules, and the base model it belongs to;
* a mixture-of-experts model's expert adapters in PEFT's fused-expert form (:mod:`.peft_experts`:
  ``target_parameters`` over transformers 5's ``mlp.experts.gate_up_proj`` / ``down_proj``), the form PEFT loads
  onto transformers' Qwen3-MoE and DeepSeek-V3 — they hold no per-expert modules;
* ``fp8rl_export.json`` — where it came from, the base's checksum among it.

``hf`` / ``hf-fp8`` of a LoRA checkpoint write the merged model: ``W + (B @ A) * alpha / rank`` per targeted
projection, summed in FP32 and rounded once to the base's dtype, after the base loaded from the model source is
checked against the checksum the checkpoint records (adapters merged into another base would be silently wrong).
:func:`read_peft_dir` reads such a directory back (fp8rl's names and :class:`~fp8rl.model.lora.LoraSettings`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fp8rl.model.lora import (
    ADAPTER_DTYPES,
    LoraSettings,
    base_checksum,
    collapse_shared_experts,
    from_peft_names,
    peft_config,
    round_adapters,
    settings_from_peft,
    to_peft_names,
)
from fp8rl.presets import load_policy

from .peft_experts import fuse_expert_adapters, split_fused
from .readers import ExportError
from .writer import EXPORT_RECORD, check_out_dir

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "lora_settings_of", "merge_adapters", "merged_with_base",
           "read_peft_dir", "write_peft_dir"]

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def lora_settings_of(record: Mapping, where: object) -> LoraSettings:
    """The :class:`LoraSettings` a checkpoint's ``lora`` record holds.

    Raises:
        ExportError: the record does not make valid settings (named).
    """
    try:
        return LoraSettings(rank=int(record["rank"]), alpha=float(record["alpha"]),
                            dropout=float(record.get("dropout", 0.0)), target_modules=tuple(record["target_modules"]),
                            dtype=str(record.get("dtype", "float32")),
                            share_experts=bool(record.get("share_experts", False)))
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(f"{where}: its lora record is not valid settings: {e}") from None


def merged_with_base(source: str, adapters: Mapping[str, torch.Tensor], settings: LoraSettings, *,
                     recorded_checksum: str | None, where: object) -> dict[str, torch.Tensor]:
    """The base loaded from ``source`` (a preset or model directory, as :func:`~fp8rl.presets.load_policy` loads it
    for a trainer: the weights a checkpoint's ``base_checksum`` was taken over) with ``adapters`` merged in
    (:func:`merge_adapters`). A trainer's own base is in FP8 where its recipe computes in FP8, so the base always
    comes from the source, checked against ``recorded_checksum`` when given.

    Raises:
        ExportError: the base cannot be loaded, is another than the one recorded, or the adapters do not fit it.
    """
    try:
        base = {k: v.detach() for k, v in load_policy(source)[0].state_dict().items()}
    except (OSError, ValueError) as e:
        raise ExportError(f"{where}: its base model {source!r} cannot be loaded: {e}") from None
    if recorded_checksum is not None:
        got = base_checksum(base)
        if got != recorded_checksum:
            raise ExportError(f"{where}: its adapters were trained on a base with checksum {recorded_checksum}, "
                              f"but the model given has {got}: pass --model the base they were trained on")
    return merge_adapters(base, adapters, settings)


def merge_adapters(base: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor],
                   settings: LoraSettings) -> dict[str, torch.Tensor]:
    """``base`` with every adapter merged into its projection's weight (module docstring); the base's dtypes.

    The adapters are taken as the forward computes with them (rounded to ``settings.dtype``).

    Raises:
        ExportError: an adapter pair is incomplete or does not fit its projection (named).
    """
    adapters = round_adapters(adapters, settings)
    out = dict(base)
    for a_name in sorted(n for n in adapters if n.endswith(".lora_A.weight")):
        prefix = a_name.removesuffix(".lora_A.weight")
        b = adapters.get(f"{prefix}.lora_B.weight")
        w = base.get(f"{prefix}.weight")
        a = adapters[a_name]
        if b is None or w is None or tuple(w.shape) != (b.shape[0], a.shape[1]) or b.shape[1] != a.shape[0]:
            raise ExportError(f"adapter {prefix} does not fit its projection (B {None if b is None else tuple(b.shape)}"
                              f", A {tuple(a.shape)}, weight {None if w is None else tuple(w.shape)})")
        merged = w.float() + (b.float() @ a.float()) * settings.scaling
        out[f"{prefix}.weight"] = merged.to(w.dtype)
    if len(adapters) != 2 * sum(1 for n in adapters if n.endswith(".lora_A.weight")):
        raise ExportError("the adapters are not pairs of lora_A and lora_B matrices")
    return out


def write_peft_dir(out: Path, adapters: Mapping[str, torch.Tensor], settings: LoraSettings, *, base_model: str | None,
                   record: dict, force: bool = False) -> int:
    """Write the PEFT directory of the module docstring, whole or not at all; the bytes written.

    Raises:
        ExportError: ``out`` is a file or not empty without ``force``.
    """
    out = Path(out).absolute()
    check_out_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.export-{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        tensors, experts = fuse_expert_adapters(round_adapters(adapters, settings), settings.rank, settings.alpha)
        save_file({n: t.detach().to("cpu").contiguous() for n, t in to_peft_names(tensors).items()},
                  str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps({**peft_config(settings, base_model), **experts}, indent=2)
                                          + "\n")
        if experts:  # which projections fp8rl adapted (a fused gate_up adapter does not say whether gate, up or
            # both), and whether its experts shared them (PEFT's form holds a copy per expert)
            record = {**record, "lora_target_modules": list(settings.target_modules),
                      "lora_share_experts": settings.share_experts}
        (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=2, default=str) + "\n")
        size = sum(f.stat().st_size for f in tmp.iterdir())
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return size


def read_peft_dir(path: str | Path) -> tuple[LoraSettings, dict[str, torch.Tensor]]:
    """A PEFT LoRA adapter directory as ``(settings, adapters under fp8rl's names)``.

    Raises:
        ExportError: a file is missing or unreadable, or the adapter is not plain LoRA (named).
    """
    path = Path(path)
    try:
        cfg = json.loads((path / ADAPTER_CONFIG).read_text())
        tensors = load_file(str(path / ADAPTER_WEIGHTS))
    except (OSError, ValueError) as e:
        raise ExportError(f"{path} is not a readable PEFT adapter directory: {type(e).__name__}: {e}") from None
    try:
        record = json.loads((path / EXPORT_RECORD).read_text()) if (path / EXPORT_RECORD).is_file() else {}
    except (OSError, ValueError) as e:
        raise ExportError(f"{path / EXPORT_RECORD}: unreadable ({type(e).__name__}: {e})") from None
    try:
        settings, adapters = _settings_and_adapters(cfg, tensors, record)
        names = {v: k for k, v in ADAPTER_DTYPES.items()}
        dtypes = {t.dtype for t in adapters.values()}
        if len(dtypes) != 1 or next(iter(dtypes)) not in names:
            raise ValueError(f"the adapter tensors must all be one of {', '.join(ADAPTER_DTYPES)}, got "
                             f"{sorted(map(str, dtypes))}")
        return dataclasses.replace(settings, dtype=names[dtypes.pop()]), adapters
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(f"{path}: {e}") from None


def _settings_and_adapters(cfg: Mapping, tensors: Mapping[str, torch.Tensor], record: Mapping
                           ) -> tuple[LoraSettings, dict[str, torch.Tensor]]:
    """The settings and fp8rl-named adapters of a PEFT directory, fused expert adapters split per expert."""
    params = cfg.get("target_parameters") or []
    if not params:
        return settings_from_peft(cfg), from_peft_names(tensors)
    rank, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    names = {p.rsplit(".", 1)[-1] for p in params}
    if not names <= {"gate_up_proj", "down_proj"}:
        raise ValueError(f"target_parameters {params}: fp8rl adapts mixture-of-experts gate_up_proj / down_proj only")
    recorded = record.get("lora_target_modules")
    if recorded is not None:
        gate_up = [p for p in ("gate_proj", "up_proj") if p in recorded]
    else:  # another tool's directory: both halves where the rank says two adapters, else the one it holds
        gate_up = ["gate_proj", "up_proj"] if cfg.get("rank_pattern", {}).get("gate_up_proj") == 2 * rank else []
    two = len(gate_up) == 2 and "gate_up_proj" in names  # gate and up: one adapter of twice the rank and alpha
    want = ({"gate_up_proj": 2 * rank}, {"gate_up_proj": 2 * alpha}) if two else ({}, {})
    if ((cfg.get("rank_pattern") or {}), (cfg.get("alpha_pattern") or {})) != want:
        raise ValueError(f"rank_pattern {cfg.get('rank_pattern')} / alpha_pattern {cfg.get('alpha_pattern')}: not "
                         "the fused expert adapters' (gate_up_proj at twice the rank and alpha of one projection)")
    # without fp8rl's record, a rank-r gate_up adapter is read as gate's (one that touches up rows is refused)
    experts = {"gate_up_proj": gate_up or ["gate_proj"]}
    adapters = split_fused(from_peft_names(tensors), cfg, rank, experts)
    if recorded is None:  # the modules PEFT adapts and the experts' projections the fused adapters hold
        recorded = {*(cfg.get("target_modules") or []), *(experts["gate_up_proj"] if "gate_up_proj" in names else ()),
                    *(("down_proj",) if "down_proj" in names else ())}
    plain = {k: v for k, v in cfg.items() if k not in ("target_parameters", "rank_pattern", "alpha_pattern")}
    settings = settings_from_peft({**plain, "target_modules": sorted(recorded)})
    if record.get("lora_share_experts"):
        settings, adapters = dataclasses.replace(settings, share_experts=True), collapse_shared_experts(adapters)
    return settings, adapters

