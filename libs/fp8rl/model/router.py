"""The mixture-of-experts router, and what one forward does with routing (record, replay, statistics).

:class:`TopKRouter` is the ``mlp.gate`` of a mixture-of-experts layer: ``weight`` ``(E, C)`` is a bare
Parameter (HF's layout and name, ``model.layers.{i}.mlp.gate.weight``), deliberately **not** an ``nn.Linear``:
FP8 conversion swaps ``nn.Linear`` modules, so the router can never be quantized by accident — a bug peers
have shipped (a router in FP8 flips near-tied experts, and every flip is a different sub-network). Its
logits, scores and routing weights are FP32 whatever the activation dtype (transformers computes the logits
in the activation dtype: equal in FP32, closer to FP32 truth in BF16).

Routing (Qwen3-MoE): ``scores = softmax(x Wᵀ)`` over the experts, the top ``K`` experts by score (ties
go to the lower index, as ``torch.topk``), their scores renormalised to sum to 1 when ``norm_topk_prob``.

Routing (DeepSeek-V3, ``scoring="sigmoid"``): ``scores = sigmoid(x Wᵀ)``; the choice adds the per-expert
``e_score_correction_bias`` (an FP32 buffer, HF's name; used for selection only, and never trained here: Moonlight
updates it outside the loss, so RL keeps it fixed and ships it with every version); the experts form ``n_group``
groups, each scored by the sum of its top-2 biased scores, and only the best ``topk_group`` groups may be chosen;
the top ``K`` of those by biased score are the experts, their weights gathered from the *unbiased* scores,
renormalised (``+ 1e-20``) when ``norm_topk_prob`` and multiplied by ``routed_scaling_factor``.

:class:`Routing` is the plan of one forward, installed on every router of a model by :func:`routing`:

* **replay** ``(B, T, L, K)`` expert ids (``L`` = mixture-of-experts layers in order, -1 = not given): the
  router uses these experts instead of its own top-k and gathers their weights from *its own* scores, so
  the router still gets gradients (Megatron's ``RouterReplay``; rollout routing replay, arXiv 2510.11370);
* **record**: the experts used per (token, layer) — what a rollout ships for replay — and, where replay
  was given, the router's own top-k too (``router_agreement`` compares the two);
* **load** per layer and expert over the real tokens (``token_mask``), and the load-balancing loss
  (``aux``: Switch-style ``E · Σ_e f_e · P_e``, transformers' ``load_balancing_loss_func``, counting the experts
  actually used — the replayed ones under replay) with gradients.

Shapes: C hidden, E experts, K top-k, N = B·T tokens, L mixture-of-experts layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .invariant import tiled_linear

__all__ = ["Routing", "RoutingRule", "TopKRouter", "routers", "routing"]


def _sigmoid(logits: torch.Tensor) -> torch.Tensor:
    """``sigmoid`` as ``softmax([x, 0])[0]``: the same function, but computed by a kernel that treats every element
    alike. ``torch.sigmoid`` runs the vectorized exp on whole vectors of the flattened tensor and the scalar exp on
    the remainder, so an element's last bits depend on where the tensor ends — on the batch — which breaks batch
    invariance (a row's routing weights alone and among other rows differed by an ulp). The softmax over a last
    dimension of 2 computes each pair the same way whatever the rest of the tensor."""
    return F.softmax(torch.stack([logits, torch.zeros_like(logits)], dim=-1), dim=-1)[..., 0]


@dataclass(frozen=True)
class RoutingRule:
    """How a router turns FP32 logits into experts and weights (module docstring): Qwen3-MoE's softmax top-k, or
    DeepSeek-V3's sigmoid with a selection-only bias, group-limited top-k and scaled weights. One rule, used by
    :class:`TopKRouter` and by the Megatron backend's router, so both route a token alike."""

    top_k: int
    norm_topk_prob: bool
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"router scoring {self.scoring!r} is not softmax or sigmoid")

    @classmethod
    def of(cls, config) -> RoutingRule:
        """The rule of a :class:`~fp8rl.model.ModelConfig`'s mixture-of-experts layers."""
        return cls(config.num_experts_per_tok, config.norm_topk_prob, config.family.router_scoring,
                   config.n_group, config.topk_group, config.routed_scaling_factor)

    def route(self, logits: torch.Tensor, bias: torch.Tensor | None = None, plan: Routing | None = None,
              index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """FP32 ``logits`` ``(N, E)`` -> expert ids ``(N, K)`` int64 and their weights ``(N, K)`` FP32; ``bias``:
        the sigmoid rule's ``e_score_correction_bias``; ``plan``: the forward's :class:`Routing` (replayed ids,
        statistics), this router being its layer ``index``."""
        if self.scoring == "softmax":
            scores = F.softmax(logits, dim=-1)  # (N, E) FP32
            own = torch.topk(scores, self.top_k, dim=-1).indices  # (N, K)
        else:
            scores = _sigmoid(logits)
            own = self._group_limited_topk(scores.detach() + bias.float())
        ids = own if plan is None else plan.ids_for(index, own)
        weights = scores.gather(1, ids)  # (N, K): from this router's scores, replayed or not (gradients flow)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if self.scoring == "sigmoid" else 0.0))
        if self.scoring == "sigmoid":
            weights = weights * self.routed_scaling_factor
        if plan is not None:
            plan.observe(index, ids, own, scores)
        return ids, weights

    def _group_limited_topk(self, choice: torch.Tensor) -> torch.Tensor:
        """DeepSeek's selection (module docstring) on the biased scores ``choice`` ``(N, E)``: ``(N, K)`` ids."""
        n, e = choice.shape
        g = self.n_group
        group_scores = choice.view(n, g, e // g).topk(2, dim=-1).values.sum(-1)  # (N, G)
        keep = torch.zeros_like(group_scores)
        keep.scatter_(1, torch.topk(group_scores, self.topk_group, dim=-1).indices, 1.0)
        allowed = keep[:, :, None].expand(n, g, e // g).reshape(n, e).bool()
        return torch.topk(choice.masked_fill(~allowed, 0.0), self.top_k, dim=-1).indices

    def __str__(self) -> str:
        rule = "softmax" if self.scoring == "softmax" else (
            f"sigmoid + bias, {self.topk_group} of {self.n_group} groups, x{self.routed_scaling_factor}")
        return f"top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}, {rule}"


class TopKRouter(nn.Module):
    """``mlp.gate``: FP32 top-k routing over ``num_experts`` by a :class:`RoutingRule` (see the module docstring).

    Attributes:
        rule: the :class:`RoutingRule`.
        row_tile: batch-invariant numerics (:mod:`fp8rl.model.invariant`): the logits GEMM over whole row tiles.
        plan: the :class:`Routing` of the forward in progress (set by :func:`routing`), or None.
        moe_index: this router's place among the model's mixture-of-experts layers (a route's layer axis).
    """

    def __init__(self, hidden_size: int, num_experts: int, rule: RoutingRule) -> None:
        super().__init__()
        self.rule, self.num_experts = rule, num_experts
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        if rule.scoring == "sigmoid":  # DeepSeek's selection bias: a buffer (no gradient), in the state dict
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.row_tile: int | None = None
        self.plan: Routing | None = None
        self.moe_index = 0

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``(N, C)`` -> expert ids ``(N, K)`` int64 and their routing weights ``(N, K)`` FP32."""
        w = self.weight.float()
        xf = x.float()
        logits = xf @ w.t() if self.row_tile is None else tiled_linear(xf, w, None, self.row_tile)  # (N, E)
        return self.rule.route(logits, getattr(self, "e_score_correction_bias", None), self.plan, self.moe_index)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, {self.rule}, fp32 (never quantized)"


@dataclass
class Routing:
    """What one forward does with routing (module docstring), and what it found.

    Args:
        num_layers: ``L``, the model's mixture-of-experts layers.
        replay: ``(B, T, L, K)`` expert ids to use (-1: the router's own choice for that token and layer), or None.
        record: keep the ids used (``ids``) and, where replayed, the router's own (``own``), per layer.
        token_mask: ``(B, T)`` the real tokens (load statistics and the aux loss count only these); None: all.
        aux: compute the load-balancing loss (with gradients) into ``aux_loss``.

    Attributes (filled by the forward):
        ids, own: per layer, ``(N, K)`` int64, in layer order (``record``).
        load: ``(L, E)`` FP64 token counts per layer and expert, over the real tokens.
        aux_loss: the load-balancing loss of the forward (``aux``), or None.
    """

    num_layers: int
    replay: torch.Tensor | None = None
    record: bool = False
    token_mask: torch.Tensor | None = None
    aux: bool = False
    ids: list[torch.Tensor | None] = field(default_factory=list)
    own: list[torch.Tensor | None] = field(default_factory=list)
    load: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.ids = [None] * self.num_layers
        self.own = [None] * self.num_layers
        self._mask = None if self.token_mask is None else self.token_mask.reshape(-1).bool()
        self._aux: tuple = (0.0, 0.0, 0)  # (tokens per expert, router probability per expert, rows), summed

    @property
    def aux_loss(self) -> torch.Tensor | None:
        """transformers' ``load_balancing_loss_func`` over every layer of the forward: ``E · Σ_e f_e · P_e`` with
        ``f_e`` the tokens routed to expert ``e`` and ``P_e`` its summed router probability, each over all layers'
        real tokens (``f`` sums to K). ``P`` carries the gradient. None unless ``aux``."""
        counts, probs, rows = self._aux
        if not self.aux or not rows:
            return None
        return probs.shape[0] * (counts / rows * probs / rows).sum()

    def ids_for(self, layer: int, own: torch.Tensor) -> torch.Tensor:
        """The expert ids layer ``layer`` uses: the replayed ones where given, ``own`` elsewhere."""
        if self.replay is None:
            return own
        r = self.replay[:, :, layer].reshape(-1, own.shape[1]).to(own.device)  # (N, K)
        if r.shape != own.shape:
            raise ValueError(f"routing replay for {r.shape[0]} tokens, but the layer routes {own.shape[0]}")
        given = (r >= 0).all(-1, keepdim=True)  # a token's K experts are replayed together or not at all
        return torch.where(given, r.long(), own)

    def observe(self, layer: int, ids: torch.Tensor, own: torch.Tensor, scores: torch.Tensor) -> None:
        if self.record:
            self.ids[layer] = ids.detach()
            self.own[layer] = own.detach()
        E = scores.shape[1]
        mask = None if self._mask is None else self._mask.to(ids.device)
        used = ids if mask is None else ids[mask]  # (n, K) over the real tokens
        counts = torch.bincount(used.reshape(-1), minlength=E).double()  # (E,) tokens routed to each expert
        if self.load is None:
            self.load = torch.zeros(self.num_layers, E, dtype=torch.float64, device=scores.device)
        self.load[layer] = counts
        if self.aux:  # sums over the layers, as transformers' load_balancing_loss_func takes them
            real = scores if mask is None else scores[mask]
            self._aux = (self._aux[0] + counts.float(), self._aux[1] + real.sum(0), self._aux[2] + real.shape[0])

    def routes(self) -> torch.Tensor:
        """``(N, L, K)`` the experts used by every token in every layer (``record``)."""
        if any(t is None for t in self.ids):
            raise RuntimeError("routes() needs a recorded forward through every mixture-of-experts layer")
        return torch.stack(self.ids, dim=1)

    def agreement(self) -> tuple[int, int]:
        """(agreeing, compared) (token, layer) pairs whose own top-k set equals the replayed one, over the real
        tokens where replay was given."""
        if self.replay is None:
            return 0, 0
        agree = total = 0
        for layer, (ids, own) in enumerate(zip(self.ids, self.own, strict=True)):
            if ids is None:
                continue
            r = self.replay[:, :, layer].reshape(-1, ids.shape[1])
            given = (r >= 0).all(-1)
            if self._mask is not None:
                given = given & self._mask.to(given.device)
            same = (ids.sort(-1).values == own.sort(-1).values).all(-1)
            agree += int((same & given).sum())
            total += int(given.sum())
        return agree, total


def routers(model: nn.Module) -> list[TopKRouter]:
    """The model's routers in layer order (each one's ``moe_index`` is its place in this list): :class:`TopKRouter`,
    or another backend's router that takes routing plans (``takes_routing_plan``: the Megatron backend's)."""
    return [m for m in model.modules() if isinstance(m, TopKRouter) or getattr(m, "takes_routing_plan", False)]


@contextmanager
def routing(model: nn.Module, plan: Routing) -> Iterator[Routing]:
    """Install ``plan`` on every router of ``model`` for the forward passes inside the block."""
    rs = routers(model)
    if len(rs) != plan.num_layers:
        raise ValueError(f"a routing plan for {plan.num_layers} mixture-of-experts layers, but the model has {len(rs)}")
    for r in rs:
        r.plan = plan
    try:
        yield plan
    finally:
        for r in rs:
            r.plan = None
