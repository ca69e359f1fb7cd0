"""Load and save Hugging Face checkpoints (local directories, safetensors only).

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or a sharded
``model.safetensors.index.json`` plus its shards. Tensor names are HF's, which are exactly the
state-dict keys of :class:`~fp8rl.model.CausalLM`, so loading is a strict name check plus
``load_state_dict``. Two HF conventions are honoured:

* tied embeddings: ``lm_head.weight`` is absent from saved files (and ignored if present);
* legacy ``*.rotary_emb.inv_freq`` buffers found in old checkpoints are ignored (we recompute RoPE);
* experts: saved per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``, what transformers writes by
  default); the fused form a ``save_pretrained(save_original_format=False)`` leaves (``mlp.experts.gate_up_proj``
  ``(E, 2F, C)`` with the gate rows first, ``mlp.experts.down_proj`` ``(E, C, F)``) is split on load — pure
  index moves, exact.

Saving writes only the HF tensors: an installed ``kv_quant`` (FP8 KV scales, recalibrated every
step) is runtime state, not checkpoint state, and is skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import ModelConfig
from .family import family_names
from .transformer import CausalLM
from .vision_language import LM_ONLY_KEY, language_model_config, split_tensors, vision_language_of

__all__ = ["checked_model", "hf_shapes", "load_hf_checkpoint", "load_hf_tensors", "model_from_tensors",
           "read_model_config", "save_hf_checkpoint"]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SAVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_LISTED = 20  # names listed in an error before "... and N more"


def _listing(names: set[str]) -> str:
    ordered = sorted(names)
    more = f" ... and {len(ordered) - _MAX_LISTED} more" if len(ordered) > _MAX_LISTED else ""
    return ", ".join(ordered[:_MAX_LISTED]) + more


def _read_tensors(path: Path, device: str | torch.device) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file or sharded)."""
    single, index = path / WEIGHTS_FILE, path / INDEX_FILE
    if single.is_file():
        return load_file(single, device=str(device))
    if not index.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} or {INDEX_FILE} in checkpoint directory {path}")
    weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = path / shard
        if not shard_path.is_file():
            raise FileNotFoundError(f"shard {shard_path} listed in {index} does not exist")
        tensors.update(load_file(shard_path, device=str(device)))
    listed_not_found = set(weight_map) - set(tensors)
    if listed_not_found:
        raise ValueError(f"{index} lists tensors its shards lack: {_listing(listed_not_found)}")
    return tensors


def _unfuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused expert tensors (transformers 5's in-memory form) split into the per-expert names; others as they are."""
    out = {}
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".experts.")
        if leaf == "gate_up_proj" and t.dim() == 3:  # (E, 2F, C): gate rows, then up rows
            f = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.experts.{e}.gate_proj.weight"] = t[e, :f]
                out[f"{prefix}.experts.{e}.up_proj.weight"] = t[e, f:]
        elif leaf == "down_proj" and t.dim() == 3:  # (E, C, F)
            for e in range(t.shape[0]):
                out[f"{prefix}.experts.{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def hf_shapes(config: ModelConfig) -> dict[str, torch.Size]:
    """HF tensor name -> shape for ``config`` (built on the meta device: no memory, no init)."""
    with torch.device("meta"):
        ref = CausalLM(config)
    shapes = {k: v.shape for k, v in ref.state_dict().items()}
    if config.tie_word_embeddings:
        del shapes["lm_head.weight"]  # HF files omit the tied head
    return shapes


def load_hf_checkpoint(
    path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    language_model_only: bool | None = False,
) -> tuple[CausalLM, ModelConfig]:
    """Load a local HF checkpoint directory into a :class:`CausalLM`.

    Args:
        path: directory with ``config.json`` and ``model.safetensors`` (or an index + shards).
        dtype: floating dtype of the loaded parameters.
        device: where the parameters live.
        language_model_only: of a vision-language checkpoint, load its text tower alone
            (:mod:`fp8rl.model.vision_language`); False: the whole model (refused for one fp8rl does not build
            whole); None: whichever fp8rl can (:func:`read_model_config`).

    Returns:
        ``(model, config)``; the model is in eval mode with no ``kv_quant`` installed.

    Raises:
        FileNotFoundError: the directory, ``config.json`` or the weights are missing.
        ValueError: unsupported config, tensors missing from / unexpected in the checkpoint
            (each listed by name), or a tensor of the wrong shape.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    d = _config_dict(path)
    config = _model_config(path, d, language_model_only)
    tensors = load_hf_tensors(path, device)
    if not config.family.vision and vision_language_of(d) is not None:
        tensors, _ = split_tensors(tensors)  # a text tower alone: the vision tensors dropped (an export reads them)
    return checked_model(path, config, tensors, dtype), config


def _config_dict(path: Path) -> dict:
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in checkpoint directory {path}")
    try:
        d = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{cfg_path} is not readable JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{cfg_path} holds a {type(d).__name__}, not a JSON object")
    return d


def read_model_config(path: str | Path, *, language_model_only: bool | None = False) -> ModelConfig:
    """The :class:`ModelConfig` of checkpoint directory ``path`` (its ``config.json``; no weights read): of a
    vision-language checkpoint with ``language_model_only``, its text tower's; without, the whole model's where its
    family is registered (``qwen2_5_vl``, ``qwen3_vl``); None: the whole model where it is, else the text tower's.

    Raises:
        FileNotFoundError: no ``config.json``.
        ValueError: an unsupported config, or a vision-language one fp8rl does not build whole without
            ``language_model_only`` (the message names the job key).
    """
    path = Path(path)
    return _model_config(path, _config_dict(path), language_model_only)


def _model_config(path: Path, d: dict, language_model_only: bool | None) -> ModelConfig:
    arch = vision_language_of(d)
    if arch is not None:
        whole = arch.model_type in family_names()
        if language_model_only or (language_model_only is None and not whole):
            d = language_model_config(d)
        elif not whole:
            raise ValueError(f"{path} is a vision-language checkpoint ({arch.hf_class}): fp8rl trains its language "
                             f"model alone with {LM_ONLY_KEY}: true (the vision encoder is kept and written back "
                             f"on export)")
    return ModelConfig.from_hf_dict(d)


def load_hf_tensors(path: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint directory ``path`` by HF name (fused experts split per expert, RoPE buffers
    left out), as stored."""
    tensors = _read_tensors(path, device)
    return _unfuse_experts({k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")})


def checked_model(path: Path, config: ModelConfig, tensors: dict[str, torch.Tensor],
                  dtype: torch.dtype = torch.float32) -> CausalLM:
    """The :class:`CausalLM` of ``config`` over ``tensors`` (read from ``path``, named in errors), converted to
    ``dtype`` one tensor at a time; ``tensors`` is emptied.

    Raises:
        ValueError: tensors missing or unexpected (each listed by name), or one of the wrong shape.
    """
    config.family.from_checkpoint(tensors)  # the checkpoint's names to fp8rl's, where a family's differ
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    expected = hf_shapes(config)
    missing, unexpected = set(expected) - set(tensors), set(tensors) - set(expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s): {_listing(missing)}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s): {_listing(unexpected)}")
        raise ValueError(f"checkpoint {path} does not match its {config.architecture} config.json: " + "; ".join(parts))
    for name, shape in expected.items():
        if tensors[name].shape != shape:
            raise ValueError(
                f"checkpoint {path}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                f"config.json implies {tuple(shape)}"
            )

    # one tensor at a time, each file-dtype tensor dropped once converted: the load never holds the checkpoint
    # twice (a bfloat16 checkpoint loaded in FP32 peaked at 1.5x the model's FP32 size)
    converted = {k: tensors.pop(k).to(dtype=dtype) for k in list(tensors)}
    return model_from_tensors(config, converted)


def model_from_tensors(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> CausalLM:
    """A :class:`CausalLM` of ``config`` in eval mode holding ``tensors`` (HF names; ``lm_head.weight`` may be left
    out when the embeddings are tied) themselves — adopted, not copied.

    Raises:
        RuntimeError: a missing or unexpected key, or a shape that does not fit ``config`` (``load_state_dict``).
    """
    state = dict(tensors)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    with torch.device("meta"):
        model = CausalLM(config)
    # assign=True adopts the loaded tensors instead of copying into (meta) placeholders
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()  # assign replaced the shared Parameter with two; share it again
    return model.eval()


def save_hf_checkpoint(model: CausalLM, config: ModelConfig, path: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` in HF layout (loadable by transformers).

    Args:
        model: a model with plain high-precision weights (FP32/BF16/FP16 ``nn.Linear``); its
            ``kv_quant`` buffers, if any, are not saved.
        config: the model's config; its shapes must match the model's tensors.
        path: target directory, created if needed.

    Raises:
        ValueError: a tensor is missing, has the wrong shape or a non-float dtype, the model holds
            tensors that are not HF's (e.g. after an FP8 conversion), or ``path`` already holds
            a sharded checkpoint (its index would shadow the new file for some readers).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if (path / INDEX_FILE).exists():
        raise ValueError(f"{path} already holds a sharded checkpoint ({INDEX_FILE}); save into an empty directory")
    expected = hf_shapes(config)
    state = {k: v for k, v in model.state_dict().items() if ".kv_quant." not in k}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, extra = set(expected) - set(state), set(state) - set(expected)
    if missing or extra:
        raise ValueError(
            f"model tensors do not match the {config.architecture} HF layout: missing [{_listing(missing)}], "
            f"not HF [{_listing(extra)}] (save the high-precision master weights, not an FP8-converted model)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if t.shape != expected[name]:
            raise ValueError(f"tensor {name} has shape {tuple(t.shape)}, config implies {tuple(expected[name])}")
        if t.dtype not in _SAVE_DTYPES:
            raise ValueError(f"tensor {name} has dtype {t.dtype}; HF checkpoints hold one of {_SAVE_DTYPES}")
        tensors[name] = t.detach().to("cpu").contiguous()
    dtype_name = str(model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    (path / CONFIG_FILE).write_text(json.dumps(config.to_hf_dict(torch_dtype=dtype_name), indent=2) + "\n")
    save_file(config.family.to_checkpoint(tensors), str(path / WEIGHTS_FILE), metadata={"format": "pt"})
