"""What a trainer does with mixture-of-experts routing: the replay plan of a micro-batch, and the step's metrics.

A trainer pass over a micro-batch of a mixture-of-experts model runs inside a :class:`~fp8rl.model.Routing`
plan (:func:`plan_for`): with routing replay, the rollout's routes of the batch (``TrainBatch.routes``); the
real tokens (rows with generated tokens, no padding) for the statistics; the load-balancing loss when it is
trained. :class:`RouteStats` sums what the plans found over a pass and turns it into the step's ``moe/*``
metrics:

* ``moe/router_agreement`` — share of (real token, layer) pairs where the trainer's own top-k expert set equals
  the rollout's (measured at each layer before its replay is applied; only with replay, which carries the
  rollout's routes);
* ``moe/load_max_over_mean`` — the most loaded expert's tokens over the mean, worst layer (1.0 = balanced);
  ``moe/load/{layer}/{expert}`` — each expert's share of its layer's routed slots (the report's heat map),
  for models of at most :data:`MAX_LOAD_CELLS` layer × expert cells;
* ``moe/aux_loss`` — the load-balancing loss (transformers' ``load_balancing_loss_func``), summed over layers.
"""

from __future__ import annotations

import torch

from fp8rl.model import Routing

from .base import TrainBatch

__all__ = ["MAX_LOAD_CELLS", "RouteStats", "plan_for"]

MAX_LOAD_CELLS = 512  # layer x expert shares reported one by one (the heat map); bigger models report summaries only


def plan_for(num_moe_layers: int, mb: TrainBatch, *, replay: bool, record: bool = False,
             aux: bool = False) -> Routing | None:
    """The routing plan of one trainer pass over ``mb`` (None for a dense model).

    Raises:
        ValueError: ``replay`` is asked but the batch carries no routes.
    """
    if not num_moe_layers:
        return None
    if replay and mb.routes is None:
        raise ValueError("routing replay is on (policy.router_replay.enabled) but the batch carries no routes: "
                         "the rollout engine must record them")
    real_rows = mb.loss_mask.sum(-1) > 0  # a data-parallel filler row routes too, but is no real token
    mask = mb.attention_mask.bool() & real_rows[:, None]
    return Routing(num_moe_layers, replay=mb.routes if replay else None, record=record, token_mask=mask, aux=aux)


class RouteStats:
    """Sums of the routing plans of one pass (module docstring)."""

    def __init__(self, num_moe_layers: int) -> None:
        self.agree = self.compared = 0
        self.load: torch.Tensor | None = None
        self.aux = 0.0
        self.passes = 0
        self.num_layers = num_moe_layers

    def add(self, plan: Routing | None) -> None:
        if plan is None:
            return
        a, n = plan.agreement()
        self.agree, self.compared = self.agree + a, self.compared + n
        if plan.load is not None:
            self.load = plan.load.cpu() if self.load is None else self.load + plan.load.cpu()
        if plan.aux_loss is not None:
            self.aux += float(plan.aux_loss.detach())
        self.passes += 1

    def metrics(self, reduce=None) -> dict[str, float]:
        """The ``moe/*`` metrics; ``reduce`` (e.g. a data-parallel group's sum) adds the sums of every rank first."""
        load = self.load if self.load is not None else torch.zeros(self.num_layers, 1, dtype=torch.float64)
        flat = torch.cat([torch.tensor([self.agree, self.compared, self.aux, self.passes], dtype=torch.float64),
                          load.reshape(-1)])
        if reduce is not None:
            flat = reduce(flat)
        agree, compared, aux, passes = flat[:4].tolist()
        load = flat[4:].view(load.shape)
        out: dict[str, float] = {}
        if compared:
            out["moe/router_agreement"] = agree / compared
        if passes:
            out["moe/aux_loss"] = aux / passes
        per_layer = load.sum(-1, keepdim=True)
        if bool((per_layer > 0).all()):
            share = load / per_layer  # (L, E)
            out["moe/load_max_over_mean"] = float((share.max(-1).values * load.shape[1]).max())
            if load.numel() <= MAX_LOAD_CELLS:
                for layer in range(load.shape[0]):
                    for e in range(load.shape[1]):
                        out[f"moe/load/{layer}/{e}"] = float(share[layer, e])
        return out
