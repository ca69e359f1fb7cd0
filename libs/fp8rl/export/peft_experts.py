"""Expert LoRA in PEFT's fused-expert form: fp8rl's per-expert adapters ↔ PEFT's ``target_parameters``.

transformers 5 holds a mixture-of-experts layer's experts as two 3-D parameters (Qwen3-MoE, DeepSeek-V3:
``mlp.experts.gate_up_proj`` ``(E, 2I, H)``, gate rows then up rows, and ``mlp.experts.down_proj`` ``(E, H, I)``),
and PEFT adapts them through ``target_parameters`` — there is no per-expert module for ``target_modules`` to match.
fp8rl trains each expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` adapter on its own (``A`` ``(r, in)``,
``B`` ``(out, r)``). The same updates in PEFT's form, exactly:

* ``gate_up_proj``: one adapter per expert over the fused rows, of rank ``k·r`` (``k`` = how many of gate / up are
  adapted): ``A_e = [A_gate; A_up]`` and ``B_e = [[B_gate, 0], [0, B_up]]`` — block-diagonal, so gate's rows get
  ``B_gate A_gate`` and up's ``B_up A_up``, nothing else. Its rank and alpha go in ``rank_pattern`` /
  ``alpha_pattern`` (``k·r``, ``k·alpha``: the scaling ``alpha / r`` unchanged).
* ``down_proj``: the experts' adapters as they are, rank ``r``.
* PEFT's layout (``ParamWrapper``): ``lora_A.weight`` ``(R·E, in)`` is the experts' ``A`` stacked;
  ``lora_B.weight`` ``(out, R·E)`` holds expert ``e``'s column ``j`` at ``j·E + e``. With both parameters adapted
  PEFT nests the wrappers, gate_up's inside (``mlp.experts.base_layer.lora_*``), down's outside
  (``mlp.experts.lora_*``); with one, it is ``mlp.experts.lora_*``.

Reading back (:func:`split_fused`) inverts it; a fused adapter that is not of this block form (another tool's
rank-``R`` update mixing gate and up) is refused, naming it: fp8rl's per-expert adapters cannot hold it.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping

import torch

from fp8rl.model.lora import EXPERT_ADAPTER

__all__ = ["EXPERT_PARAMETERS", "fuse_expert_adapters", "split_fused"]

_FUSED = re.compile(r"^(?P<pre>.+\.mlp\.experts)(?P<inner>\.base_layer)?\.lora_(?P<ab>[AB])\.weight$")
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # the order PEFT nests them in
_GATE_UP = ("gate_proj", "up_proj")


def _to_peft(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts' ``A`` ``(E, R, in)`` and ``B`` ``(E, out, R)`` in PEFT's ``(R·E, in)`` / ``(out, R·E)`` layout."""
    E, R, _ = a.shape
    return a.reshape(E * R, -1), b.permute(1, 2, 0).reshape(b.shape[1], R * E)


def _from_peft(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`_to_peft` for rank ``rank``."""
    E = a.shape[0] // rank
    return a.reshape(E, rank, -1), b.reshape(b.shape[0], rank, E).permute(2, 0, 1)


def fuse_expert_adapters(adapters: Mapping[str, torch.Tensor], rank: int, alpha: float
                         ) -> tuple[dict[str, torch.Tensor], dict]:
    """``adapters`` (fp8rl's names) with every MoE layer's per-expert adapters in PEFT's fused form (module
    docstring), and what ``adapter_config.json`` then needs: ``target_modules`` (the other adapted modules'
    names), ``target_parameters``, ``rank_pattern``, ``alpha_pattern``. No expert adapters: both as they were
    (an empty dict).

    Raises:
        ValueError: a layer lacks some expert's adapter, or layers adapt different projections.
    """
    layers: dict[str, dict] = defaultdict(dict)
    out = {}
    for name, t in adapters.items():
        m = EXPERT_ADAPTER.match(name)
        if m is None or m["proj"] not in (*_GATE_UP, "down_proj"):
            out[name] = t
        else:
            layers[m["layer"]][int(m["e"]), m["proj"], m["ab"]] = t
    if not layers:
        return dict(adapters), {}
    kinds = {pre: sorted({p for _, p, _ in g}) for pre, g in layers.items()}
    projs = next(iter(kinds.values()))
    if any(k != projs for k in kinds.values()):
        raise ValueError(f"expert adapters: every MoE layer must adapt the same projections, got {kinds}")
    gate_up = [p for p in _GATE_UP if p in projs]
    for pre, g in layers.items():
        E = 1 + max(e for e, _, _ in g)
        missing = [f"{pre}.{e}.{p}.lora_{ab}" for e in range(E) for p in projs for ab in "AB" if (e, p, ab) not in g]
        if missing:
            raise ValueError(f"expert adapters: {', '.join(missing[:4])} missing (every expert of a layer is adapted)")
        if gate_up:
            a = torch.stack([torch.cat([g[e, p, "A"] for p in gate_up]) for e in range(E)])  # (E, k·r, H)
            inter = g[0, gate_up[0], "B"].shape[0]
            b = a.new_zeros(E, 2 * inter, len(gate_up) * rank)
            for j, p in enumerate(gate_up):
                row = 0 if p == "gate_proj" else inter
                b[:, row:row + inter, j * rank:(j + 1) * rank] = torch.stack([g[e, p, "B"] for e in range(E)])
            where = f"{pre}.base_layer" if "down_proj" in projs else pre
            out[f"{where}.lora_A.weight"], out[f"{where}.lora_B.weight"] = _to_peft(a, b)
        if "down_proj" in projs:
            a = torch.stack([g[e, "down_proj", "A"] for e in range(E)])
            b = torch.stack([g[e, "down_proj", "B"] for e in range(E)])
            out[f"{pre}.lora_A.weight"], out[f"{pre}.lora_B.weight"] = _to_peft(a, b)
    modules = sorted({n.rsplit(".", 2)[0].rsplit(".", 1)[-1] for n in out if not _FUSED.match(n)})
    params = [p for p in EXPERT_PARAMETERS if (p.endswith("gate_up_proj") and gate_up)
              or (p.endswith("down_proj") and "down_proj" in projs)]
    k = len(gate_up)
    extra = {"target_modules": modules, "target_parameters": params,
             "rank_pattern": {"gate_up_proj": k * rank} if k > 1 else {},
             "alpha_pattern": {"gate_up_proj": k * alpha} if k > 1 else {}}
    return out, extra


def split_fused(adapters: Mapping[str, torch.Tensor], cfg: Mapping, rank: int, experts_of: Mapping[str, list[str]]
                ) -> dict[str, torch.Tensor]:
    """The inverse of :func:`fuse_expert_adapters`: ``adapters`` (fp8rl's names, fused experts' too) with each
    fused expert adapter back as per-expert ones. ``cfg`` is the ``adapter_config.json``; ``experts_of`` maps
    ``gate_up_proj`` to the projections its rows hold adapters of (``[gate_proj, up_proj]``, or one of them).

    Raises:
        ValueError: a fused adapter of another form (named), or shapes that do not divide into experts.
    """
    params = [p.rsplit(".", 1)[-1] for p in cfg.get("target_parameters") or []]
    nested = len(params) == 2
    out, fused = {}, defaultdict(dict)
    for name, t in adapters.items():
        m = _FUSED.match(name)
        if m is None:
            out[name] = t
            continue
        param = ("gate_up_proj" if m["inner"] else "down_proj") if nested else params[0]
        fused[m["pre"], param][m["ab"]] = t
    for (pre, param), ab in fused.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{pre}: {param}'s adapter lacks lora_{'A' if 'A' not in ab else 'B'}")
        if param == "down_proj":
            if ab["A"].shape[0] % rank:
                raise ValueError(f"{pre}.down_proj: lora_A has {ab['A'].shape[0]} rows, not experts × rank {rank}")
            a, b = _from_peft(ab["A"], ab["B"], rank)
            for e in range(a.shape[0]):
                out[f"{pre}.{e}.down_proj.lora_A.weight"], out[f"{pre}.{e}.down_proj.lora_B.weight"] = a[e], b[e]
            continue
        projs = list(experts_of["gate_up_proj"])
        width = len(projs) * rank
        if ab["A"].shape[0] % width or ab["B"].shape[0] % 2:
            raise ValueError(f"{pre}.gate_up_proj: lora_A {tuple(ab['A'].shape)} / lora_B {tuple(ab['B'].shape)} do "
                             f"not split into experts of rank {width} over gate and up rows")
        a, b = _from_peft(ab["A"], ab["B"], width)
        inter = b.shape[1] // 2
        rows = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter)}
        kept = torch.zeros_like(b, dtype=torch.bool)
        for j, p in enumerate(projs):
            cols = slice(j * rank, (j + 1) * rank)
            kept[:, rows[p], cols] = True
            for e in range(a.shape[0]):
                out[f"{pre}.{e}.{p}.lora_A.weight"] = a[e, cols].contiguous()
                out[f"{pre}.{e}.{p}.lora_B.weight"] = b[e, rows[p], cols].contiguous()
        if b[~kept].any():
            raise ValueError(f"{pre}.gate_up_proj: the adapter mixes gate and up rows (not fp8rl's block form: one "
                             f"rank-{rank} adapter per projection); fp8rl cannot hold it per expert")
    return out
