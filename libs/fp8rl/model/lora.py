"""LoRA adapters on a model's linear projections, the same way in every engine (issue 33, first piece).

A targeted projection ``W`` (any linear module: ``nn.Linear``, :class:`~fp8rl.model.invariant.TiledLinear`, the
trainer's :class:`~fp8rl.fp8.Fp8Linear`, the rollout's :class:`~fp8rl.fp8.Fp8InferenceLinear`) keeps its own forward
and gets a low-rank update added to its output::

    y = W(x) + (dropout(x) @ Aᵀ) @ Bᵀ · alpha / rank

``A`` ``(rank, in)`` and ``B`` ``(out, rank)`` are FP32 parameters held *on the projection itself*, under PEFT's
names (``...q_proj.lora_A.weight``, ``...q_proj.lora_B.weight``), so the base weight keeps its name
(``...q_proj.weight``) and every path that knows the model's tensors by name (refit, checkpoints, FP8 conversion)
sees the base unchanged. Initialisation is PEFT's: ``A`` Kaiming-uniform (``a = √5``), ``B`` zero, so a fresh adapter
changes no number. The adapters' GEMMs follow the projection's batch-invariant tiling (its ``row_tile``), so under
``policy.numerics.batch_invariant`` a row's adapter output does not depend on the rows beside it, in the rollout's
decode or the trainer's forward alike.

A mixture-of-experts layer's experts each get their own adapters, or with ``share_experts`` one adapter per
projection shared by every expert of the layer (the same ``A`` / ``B`` parameter objects on each expert's
projection): the update is the same low-rank ``ΔW`` on every expert's weight, trained on every token the layer
routes, and its tensors are named once — under expert 0's names (``...mlp.experts.0.gate_proj.lora_A.weight``), the
first the model's parameters list — in checkpoints, refits and :func:`lora_state_dict`, so a refit ships one adapter
per projection instead of one per expert.

Apply adapters *after* FP8 conversion and batch invariance are set up (:func:`~fp8rl.fp8.convert_model` does both):
those replace plain linears with new modules, which would not carry the adapters over.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import xxhash
from torch import nn

from fp8rl.fp8.payload import ADAPTER_SUFFIXES, is_adapter

from .invariant import tiled_linear

__all__ = ["LoraSettings", "DEFAULT_TARGETS", "ADAPTER_SUFFIXES", "apply_lora", "lora_parameters", "lora_state_dict",
           "has_lora", "is_adapter", "base_checksum", "share_adapters", "peft_config", "settings_from_peft",
           "to_peft_names", "from_peft_names", "lora_computed_state_dict", "round_adapters", "ADAPTER_DTYPES",
           "expand_shared_experts", "collapse_shared_experts", "EXPERT_ADAPTER"]


# every attention and MLP projection (PEFT's / NeMo RL's module names); a mixture-of-experts layer's experts
# match gate_proj / up_proj / down_proj too, its router (mlp.gate) never
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                   # multi-head latent attention (deepseek_v3): the low-rank query and the latent's projections
                   "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
ADAPTER_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}  # policy.lora.dtype


@dataclass(frozen=True)
class LoraSettings:
    """``rank`` ≥ 1, ``alpha`` (the update is scaled by ``alpha / rank``), ``dropout`` in [0, 1) on the adapter's
    input (training passes only), ``target_modules``: projection names (the last part of a module's name),
    ``dtype``: the precision the adapters are computed and shipped in (``bfloat16`` or ``float32``); the parameters
    stay FP32 masters, and each forward uses their rounding to ``dtype`` (gradients pass straight through to the
    masters), so what a refit ships in ``dtype`` is exactly what every engine computes with. ``share_experts``: a
    mixture-of-experts layer's experts share one adapter per projection (module docstring)."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    dtype: str = "bfloat16"
    share_experts: bool = False

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"policy.lora.rank must be at least 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"policy.lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("policy.lora.target_modules names no module")
        if self.dtype not in ADAPTER_DTYPES:
            raise ValueError(f"policy.lora.dtype must be one of {', '.join(ADAPTER_DTYPES)}, got {self.dtype!r}")
        # a set of names: one order everywhere (checkpoint records, PEFT's adapter_config.json)
        object.__setattr__(self, "target_modules", tuple(sorted(set(self.target_modules))))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def torch_dtype(self) -> torch.dtype:
        return ADAPTER_DTYPES[self.dtype]


class _AdapterWeight(nn.Module):
    """One adapter matrix under PEFT's state-dict name (``lora_A.weight``); deliberately not an ``nn.Linear``, so
    FP8 conversion and batch invariance, which swap plain linears, leave it alone."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, cols, dtype=torch.float32))


def _computed(master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The FP32 master as the forward uses it: its rounding to ``dtype`` (exact in FP32), gradient straight through."""
    if dtype == torch.float32:
        return master
    return master + (master.detach().to(dtype).float() - master.detach())


def _adapter_forward(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """Forward hook on a targeted projection: its output plus the low-rank update (module docstring)."""
    (x,) = args
    a, b = _computed(module.lora_A.weight, module.lora_dtype), _computed(module.lora_B.weight, module.lora_dtype)
    h = x.to(a.dtype)
    if torch.is_grad_enabled():  # dropout in training passes only: a logprob pass (no grad) never drops
        h = module.lora_dropout(h)
    tile = getattr(module, "row_tile", None)
    if tile is None:
        low = F.linear(F.linear(h, a), b)
    else:  # the projection's tiles: each row's numbers independent of the batch
        low = tiled_linear(tiled_linear(h, a, None, tile), b, None, tile)
    return out + (low * module.lora_scaling).to(out.dtype)


_EXPERT_PROJECTION = re.compile(r"^(?P<layer>.+\.experts)\.\d+\.(?P<proj>[^.]+)$")


def _targets(model: nn.Module, names: Iterable[str]) -> list[tuple[str, nn.Module]]:
    """The projections named ``names``. Every name given must match one, except with the default set, which names
    both attention families' projections and takes those the model has."""
    wanted = set(names)
    found = [(n, m) for n, m in model.named_modules()
             if n.rsplit(".", 1)[-1] in wanted and hasattr(m, "in_features") and hasattr(m, "out_features")]
    missing = wanted - {n.rsplit(".", 1)[-1] for n, _ in found}
    if missing and (wanted != set(DEFAULT_TARGETS) or not found):
        raise ValueError(f"policy.lora.target_modules: no projection named {sorted(missing)} in the model")
    return found


def apply_lora(model: nn.Module, settings: LoraSettings, *, seed: int = 0, freeze: bool = True) -> list[str]:
    """Give every targeted projection of ``model`` an adapter (in place) and freeze every other parameter
    (``freeze=False``: leave them as they are — an engine whose base tensors are another model's own objects).

    Returns the adapted projections' names. ``seed`` draws the ``A`` matrices (the same seed gives the same adapters
    in every engine and process).

    Raises:
        ValueError: a target name matches no projection, or ``model`` already has adapters.
    """
    if has_lora(model):
        raise ValueError("this model already has LoRA adapters")
    g = torch.Generator().manual_seed(seed)
    if freeze:
        for p in model.parameters():
            p.requires_grad_(False)
    done, first_of = [], {}  # share_experts: (the layer's experts, projection) -> the expert carrying the adapter
    for name, mod in _targets(model, settings.target_modules):
        m = _EXPERT_PROJECTION.match(name) if settings.share_experts else None
        group = (m["layer"], m["proj"]) if m else None
        if group in first_of:  # the same adapter modules (and parameters) as the layer's first expert
            mod.lora_A, mod.lora_B = first_of[group].lora_A, first_of[group].lora_B
        else:
            mod.lora_A = _AdapterWeight(settings.rank, mod.in_features)
            mod.lora_B = _AdapterWeight(mod.out_features, settings.rank)
            # PEFT's init: A ~ kaiming_uniform(a=√5), i.e. U(-1/√in, 1/√in); B = 0
            bound = 1.0 / math.sqrt(mod.in_features)
            with torch.no_grad():
                mod.lora_A.weight.copy_(torch.rand(mod.lora_A.weight.shape, generator=g) * 2 * bound - bound)
            mod.lora_A.to(next(model.parameters()).device)
            mod.lora_B.to(next(model.parameters()).device)
            if group is not None:
                first_of[group] = mod
        mod.lora_dropout = nn.Dropout(settings.dropout) if settings.dropout else nn.Identity()
        mod.lora_scaling = settings.scaling
        mod.lora_dtype = settings.torch_dtype
        mod.register_forward_hook(_adapter_forward)
        done.append(name)
    if settings.share_experts and not first_of:
        raise ValueError("policy.lora.share_experts: no mixture-of-experts expert projection is among the targets "
                         f"({', '.join(settings.target_modules)})")
    return done


def has_lora(model: nn.Module) -> bool:
    """Whether ``model`` carries adapters."""
    return any(isinstance(m, _AdapterWeight) for m in model.modules())


def lora_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The adapters' ``(name, parameter)`` pairs, in ``named_parameters()`` order."""
    return [(n, p) for n, p in model.named_parameters() if is_adapter(n)]


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' FP32 masters alone (what a checkpoint holds)."""
    return {n: p.detach() for n, p in lora_parameters(model)}


def lora_computed_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters as the forward computes with them, in their ``dtype`` (what a refit ships and a PEFT export
    writes): the masters rounded once."""
    return {n: p.detach().to(model.get_submodule(n.rsplit(".", 2)[0]).lora_dtype) for n, p in lora_parameters(model)}


# an expert's adapter matrix: ``{layer}.{e}.{proj}.lora_{ab}.weight`` (``layer`` ends in ``.experts``)
EXPERT_ADAPTER = re.compile(r"^(?P<layer>.+\.experts)\.(?P<e>\d+)\.(?P<proj>[^.]+)\.lora_(?P<ab>[AB])\.weight$")


def expand_shared_experts(tensors: Mapping[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Adapters of a ``share_experts`` model (expert 0's names stand for every expert) with each expert's copy
    under its own name: what a format that knows no sharing (a merged base, PEFT) holds."""
    out = {}
    for name, t in tensors.items():
        m = EXPERT_ADAPTER.match(name)
        if m is None:
            out[name] = t
        else:
            out.update({f"{m['layer']}.{e}.{m['proj']}.lora_{m['ab']}.weight": t for e in range(num_experts)})
    return out


def collapse_shared_experts(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`expand_shared_experts`: expert 0's names only.

    Raises:
        ValueError: two experts' copies of a shared adapter differ (named): they were not shared.
    """
    out = {}
    for name, t in tensors.items():
        m = EXPERT_ADAPTER.match(name)
        if m is None:
            out[name] = t
            continue
        first = f"{m['layer']}.0.{m['proj']}.lora_{m['ab']}.weight"
        if first not in tensors or not torch.equal(tensors[first], t):
            raise ValueError(f"{name}: differs from {first} (policy.lora.share_experts: every expert shares it)")
        out[first] = tensors[first]
    return out


def round_adapters(tensors: Mapping[str, torch.Tensor], settings: LoraSettings) -> dict[str, torch.Tensor]:
    """Adapter masters (a checkpoint's) rounded to ``settings.dtype``, as :func:`lora_computed_state_dict`."""
    return {n: t.detach().to(settings.torch_dtype) for n, t in tensors.items() if is_adapter(n)}


def base_checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    """The identity of a frozen base: XXH3-128 hex over every non-adapter tensor's name, dtype, shape and bytes, in
    name order (the same weights give the same checksum in any process; a checkpoint records it, and resuming on
    another base is refused)."""
    h = xxhash.xxh3_128()
    for name in sorted(n for n in tensors if not is_adapter(n)):
        t = tensors[name].detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def share_adapters(model: nn.Module, source: nn.Module) -> None:
    """Make ``model``'s adapter parameters ``source``'s own objects (same names): an engine sharing the trainer's
    tensors serves the adapters the trainer holds, with no copy.

    Raises:
        ValueError: the two models' adapters differ in names or shapes.
    """
    theirs = dict(lora_parameters(source))
    mine = lora_parameters(model)
    if set(theirs) != {n for n, _ in mine}:
        raise ValueError("the models' LoRA adapters differ (policy.lora must be the same in both engines)")
    for name, p in mine:
        if theirs[name].shape != p.shape:
            raise ValueError(f"{name}: shape {tuple(theirs[name].shape)} != {tuple(p.shape)}")
        owner = model.get_submodule(name.removesuffix(".weight"))
        owner.weight = theirs[name]


# PEFT's adapter directory: adapter_config.json (these keys) + adapter_model.safetensors, whose names carry the
# wrapper prefix of PeftModel.from_pretrained's model (base_model.model.) and no adapter name
PEFT_PREFIX = "base_model.model."


def peft_config(settings: LoraSettings, base_model: str | None) -> dict:
    """The ``adapter_config.json`` of ``settings`` (PEFT's LoraConfig fields, plain LoRA: no DoRA, no rsLoRA)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings.rank, "lora_alpha": settings.alpha,
            "lora_dropout": settings.dropout, "target_modules": list(settings.target_modules), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
            "base_model_name_or_path": base_model, "modules_to_save": None, "init_lora_weights": True}


def settings_from_peft(cfg: Mapping) -> LoraSettings:
    """The :class:`LoraSettings` of an ``adapter_config.json`` (what fp8rl runs: plain LoRA on named projections).

    Raises:
        ValueError: another PEFT type or a LoRA variant fp8rl does not compute (named).
    """
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"adapter_config.json: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, plain in (("use_dora", False), ("use_rslora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if cfg.get(key, plain) != plain:
            raise ValueError(f"adapter_config.json: {key}={cfg.get(key)!r} is not supported (fp8rl computes plain "
                             f"LoRA: {key}={plain!r})")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if cfg.get(key):
            raise ValueError(f"adapter_config.json: {key} is not supported (one rank and alpha for every module)")
    targets = cfg.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise ValueError(f"adapter_config.json: target_modules must be a list of module names, got {targets!r}")
    return LoraSettings(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]), dropout=float(cfg.get("lora_dropout", 0)),
                        target_modules=tuple(targets))


def to_peft_names(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter tensors under the names of PEFT's ``adapter_model.safetensors``."""
    return {PEFT_PREFIX + n: t for n, t in tensors.items() if is_adapter(n)}


def from_peft_names(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_peft_names` (PEFT's names → fp8rl's); a name that is not an adapter's is refused."""
    out = {}
    for n, t in tensors.items():
        if not n.startswith(PEFT_PREFIX) or not is_adapter(n):
            raise ValueError(f"adapter_model.safetensors: {n!r} is not a LoRA matrix under {PEFT_PREFIX!r}")
        out[n.removeprefix(PEFT_PREFIX)] = t
    return out
