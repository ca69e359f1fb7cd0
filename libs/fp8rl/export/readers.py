"""Every kind of checkpoint an export reads, as HF-named master weights plus what it records about its model.

Kinds (:func:`read_checkpoint` tells them apart by what is on disk, never by a file name):

* ``torch .pt`` — one file :meth:`TorchTrainer.save_checkpoint` writes on one rank (format
  ``fp8rl-torch-trainer/1``): ``model`` holds the policy's state dict under HF names;
* ``torch .dcp`` — a ``torch.distributed.checkpoint`` directory written by any number of FSDP2 ranks, with
  ``fp8rl.json`` beside the shards: only the ``model.*`` entries are read (no AdamW moments), resharded into
  whole tensors on this one process (DCP's own planner, no process group);
* ``megatron .pt`` — the Megatron backend's file (format ``fp8rl-megatron-trainer/1``) at any tensor / pipeline
  size: it always holds whole tensors in the TP = PP = 1 Megatron layout, turned into HF names and layout by
  :func:`fp8rl.engines.megatron.megatron_to_hf` (pure index moves) once the model config is known;
* ``hf`` — a Hugging Face directory (``config.json`` + safetensors), read with :func:`load_hf_checkpoint`.

Checkpoints written since the export landed also record their model: ``model_config`` (the HF ``config.json``
dict), ``model_source`` (the preset name or model directory :func:`fp8rl.presets.load_policy` loaded) and the
trainer's whole ``recipe``; older ones record only ``recipe_linear``, and the caller names the model.

Invariant: a checkpoint that cannot be read whole raises :class:`ExportError` naming the path and what is wrong
(missing, truncated, another format, keys that are not the model's), never a half-read result.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fp8rl.engines.megatron import megatron_to_hf
from fp8rl.engines.torch_trainer import TorchTrainer
from fp8rl.fp8 import Fp8Recipe
from fp8rl.fp8.payload import is_adapter
from fp8rl.model import ModelConfig, load_hf_checkpoint
from fp8rl.model.hf_io import CONFIG_FILE, hf_shapes

__all__ = ["ExportError", "TrainerCheckpoint", "check_tensors", "read_checkpoint"]

TORCH_FORMAT = TorchTrainer.CHECKPOINT_FORMAT
# MegatronTrainer.CHECKPOINT_FORMAT; spelt out because importing that class imports megatron-core
MEGATRON_FORMAT = "fp8rl-megatron-trainer/1"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LISTED = 5  # key names quoted in an error before "... and N more"


class ExportError(ValueError):
    """Bad input to an export: a missing or unreadable checkpoint, keys that are not the model's, an unknown format,
    an output directory that is not empty. The message names the path or key and what was expected."""


@dataclass
class TrainerCheckpoint:
    """One checkpoint, read.

    Attributes:
        path: where it was read from.
        kind: ``"torch .pt"``, ``"torch .dcp"``, ``"megatron .pt"`` or ``"hf"``.
        tensors: the weights as stored: HF names for every kind but ``megatron .pt`` (Megatron's TP = 1 names);
            :meth:`hf_tensors` gives HF names for all.
        version: the trainer's weight version (None for an HF directory).
        model_config: the config the checkpoint records (``config.json`` of an HF directory), or None.
        model_source: the preset name or model directory it records, or None.
        recipe: the trainer's recipe as recorded (only ``linear`` for checkpoints older than the record).
        lora: a LoRA trainer's record (its ``policy.lora`` settings and ``base_checksum``), else None; its
            adapters are then in ``adapters``, and ``tensors`` hold the base as the trainer held it where the checkpoint
            has it (a ``.dcp``: FP8 forms in an FP8 recipe; exports load the base from the model source instead), else
            nothing (a ``.pt`` holds the adapters alone).
        adapters: the LoRA adapters (PEFT's names without the wrapper prefix), else empty.
    """

    path: Path
    kind: str
    tensors: dict[str, torch.Tensor] = field(repr=False)
    version: int | None = None
    model_config: ModelConfig | None = None
    model_source: str | None = None
    recipe: Fp8Recipe | None = None
    lora: dict | None = None
    adapters: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def hf_tensors(self, config: ModelConfig) -> dict[str, torch.Tensor]:
        """The weights under HF names and layout for ``config``, checked by :func:`check_tensors` (a tied
        ``lm_head.weight`` omitted, as HF files do).

        Raises:
            ExportError: a tensor is missing, unknown or of the wrong shape for ``config`` (named).
        """
        tensors = {k: v for k, v in self.tensors.items() if ".kv_quant." not in k}  # runtime FP8 KV state
        if self.kind == "megatron .pt":
            fused = any(k.endswith("linear_qkv.layer_norm_weight") for k in tensors)  # Transformer Engine's spec
            try:
                tensors = megatron_to_hf(tensors, config, fused_norms=fused)
            except ValueError as e:
                raise ExportError(f"{self.path}: its Megatron weights do not fit the {config.architecture} model "
                                  f"({config.num_hidden_layers} layers): {e}") from None
        if config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        check_tensors(tensors, config, self.path)
        return tensors


def check_tensors(tensors: dict[str, torch.Tensor], config: ModelConfig, where: object) -> None:
    """Raise :class:`ExportError` unless ``tensors`` are exactly ``config``'s HF weights (tied head omitted).

    Args:
        where: the checkpoint (path or name) the message blames.
    """
    expected = hf_shapes(config)
    missing, unknown = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unknown:
        parts = [f"{len(names)} {what} tensor(s): {_listing(names)}"
                 for names, what in ((missing, "missing"), (unknown, "unexpected")) if names]
        raise ExportError(f"{where}: its weights do not match the {config.architecture} model "
                          f"({config.num_hidden_layers} layers, hidden {config.hidden_size}): " + "; ".join(parts)
                          + " (is --model the model this checkpoint was trained from?)")
    for name, shape in expected.items():
        if tensors[name].shape != shape:
            raise ExportError(f"{where}: tensor {name} has shape {tuple(tensors[name].shape)}, the model's is "
                              f"{tuple(shape)} (is --model the model this checkpoint was trained from?)")
        if not tensors[name].is_floating_point():
            raise ExportError(f"{where}: tensor {name} has dtype {tensors[name].dtype}, not a float")


def read_checkpoint(path: str | Path) -> TrainerCheckpoint:
    """Read any checkpoint kind (module docstring) from ``path``.

    Raises:
        ExportError: ``path`` does not exist, is none of the kinds, or cannot be read whole (truncated or
            corrupt file or shard); the message names it.
    """
    path = Path(path)
    if not path.exists():
        raise ExportError(f"checkpoint {path} does not exist")
    if path.is_dir():
        if (path / TorchTrainer.DCP_META).is_file():
            return _read_dcp(path)
        if (path / CONFIG_FILE).is_file():
            return _read_hf(path)
        raise ExportError(f"{path} is a directory with neither {TorchTrainer.DCP_META} (a trainer's .dcp "
                          f"checkpoint) nor {CONFIG_FILE} (a Hugging Face model)")
    try:  # mmap: the AdamW moments beside the weights are never read
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises RuntimeError, UnpicklingError, EOFError ... for a bad file
        raise ExportError(f"{path} is not a readable trainer checkpoint (truncated or not a torch file?): "
                          f"{type(e).__name__}: {_short(e)}") from None
    fmt = state.get("format") if isinstance(state, dict) else None
    if fmt not in (TORCH_FORMAT, MEGATRON_FORMAT) or not isinstance(state.get("model"), dict):
        raise ExportError(f"{path} is not a trainer checkpoint: format {fmt!r}, expected {TORCH_FORMAT!r} or "
                          f"{MEGATRON_FORMAT!r} with a 'model' state dict")
    return TrainerCheckpoint(path, "torch .pt" if fmt == TORCH_FORMAT else "megatron .pt",
                             **_split_adapters(dict(state["model"]), state, path), **_record(state, path))


def _read_dcp(path: Path) -> TrainerCheckpoint:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta_file = path / TorchTrainer.DCP_META
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{meta_file} is not valid JSON: {_short(e)}") from None
    if not isinstance(meta, dict) or meta.get("format") != TORCH_FORMAT:
        raise ExportError(f"{path} is not a {TORCH_FORMAT} checkpoint ({TorchTrainer.DCP_META}: {meta!r:.200})")
    reader = dcp.FileSystemReader(str(path))
    try:
        metadata = reader.read_metadata()
    except Exception as e:
        raise ExportError(f"{path}: its DCP metadata (.metadata) cannot be read: {type(e).__name__}: "
                          f"{_short(e)}") from None
    _check_shard_files(path, metadata.storage_data)
    entries = metadata.state_dict_metadata
    # the trainer saved {"model": ..., "optim": ..., "rng": ...}; DCP flattens the nesting into dotted keys
    wanted = {k: m for k, m in entries.items() if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    if not wanted:
        raise ExportError(f"{path}: its DCP metadata lists no model.* tensors")
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in wanted.items()}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.load(state, storage_reader=reader, no_dist=True)  # whole tensors from every rank's shards
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException; it wraps the cause
        failed = next(iter(e.failures.values()), None) if isinstance(e, CheckpointException) else None
        cause = failed[0] if failed else e  # a failure is (exception, traceback)
        raise ExportError(f"{path}: its shards cannot be read whole (a corrupt .distcp file?): "
                          f"{type(cause).__name__}: {_short(cause)}") from None
    tensors = {k.removeprefix("model."): v for k, v in state.items()}
    return TrainerCheckpoint(path, "torch .dcp", **_split_adapters(tensors, meta, path), **_record(meta, path))


def _split_adapters(tensors: dict, record: dict, path: Path) -> dict:
    """``tensors`` / ``adapters`` / ``lora`` of a checkpoint: a LoRA trainer's adapters apart from its base."""
    lora = record.get("lora")
    if lora is None:
        return {"tensors": tensors}
    if not isinstance(lora, dict) or not isinstance(lora.get("base_checksum"), str):
        raise ExportError(f"{path}: its lora record is not valid: {lora!r:.200}")
    adapters = {k: v for k, v in tensors.items() if is_adapter(k)}
    if not adapters:
        raise ExportError(f"{path} records LoRA training but holds no adapter tensors")
    return {"tensors": {k: v for k, v in tensors.items() if not is_adapter(k)}, "adapters": adapters, "lora": lora}


def _check_shard_files(path: Path, storage: dict) -> None:
    """Every shard file the metadata points into exists and is long enough for every entry in it (a copy cut short
    is caught here, named, whichever entries it cut — optimizer state included)."""
    need: dict[str, int] = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        f = path / name
        if not f.is_file():
            raise ExportError(f"{path}: shard {name} is missing (its metadata lists it)")
        if f.stat().st_size < size:
            raise ExportError(f"{path}: shard {name} is truncated: {f.stat().st_size} bytes, its entries end at "
                              f"byte {size}")


def _read_hf(path: Path) -> TrainerCheckpoint:
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text())
        dtype = _DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"), torch.float32)
        # a vision-language directory fp8rl builds whole is read whole; another, as its language model (what
        # policy.language_model_only trains of it)
        model, config = load_hf_checkpoint(path, dtype=dtype, language_model_only=None)
    except (OSError, ValueError) as e:  # hf_io names the missing file or tensor
        raise ExportError(f"{path}: not a loadable Hugging Face model: {_short(e)}") from None
    tensors = model.state_dict()
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return TrainerCheckpoint(path, "hf", tensors, model_config=config, model_source=str(path.resolve()))


def _record(state: dict, path: Path) -> dict:
    """What a .pt state or a .dcp's metadata records about its model (module docstring), checked."""
    out: dict = {"version": int(state["version"]) if isinstance(state.get("version"), int) else None}
    cfg = state.get("model_config")
    if cfg is not None:
        try:
            out["model_config"] = ModelConfig.from_hf_dict(dict(cfg))
        except (TypeError, ValueError) as e:
            raise ExportError(f"{path}: its recorded model_config is not a valid config: {_short(e)}") from None
    source = state.get("model_source")
    out["model_source"] = source if isinstance(source, str) and source else None
    recipe = state.get("recipe")
    known = {f.name for f in dataclasses.fields(Fp8Recipe)}
    try:
        if isinstance(recipe, dict):
            out["recipe"] = Fp8Recipe(**{k: v for k, v in recipe.items() if k in known})
        elif state.get("recipe_linear") in ("bf16", "fp8"):
            out["recipe"] = Fp8Recipe(linear=state["recipe_linear"])
    except (TypeError, ValueError) as e:
        raise ExportError(f"{path}: its recorded recipe is not valid: {_short(e)}") from None
    return out


def _listing(names: list[str]) -> str:
    more = f" ... and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return ", ".join(names[:_LISTED]) + more


def _short(e: object, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + " ..."
