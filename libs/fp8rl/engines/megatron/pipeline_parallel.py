"""Pipeline-parallel layout of the Megatron backend: which stage holds which tensor, under which name.

With ``megatron_cfg.pipeline_model_parallel_size`` = P, stage ``p`` builds a GPTModel of decoder layers
``[p L/P, (p + 1) L/P)`` (:func:`~fp8rl.engines.megatron.model.stage_layers`), numbered from 0 in its own state
dict; the first stage also holds the embedding, the last the final norm and the output layer. With tied
embeddings the last stage holds a *copy* of the embedding as ``output_layer.weight`` (Megatron keeps the two
equal by summing their gradients over its embedding group), so the embedding is owned by the first stage.

Checkpoints and published weights use the whole model's (P = 1) names; these helpers map between them and a
stage's, and say which stage owns each whole tensor. Pure functions of names: no process group needed.
"""

from __future__ import annotations

import re

__all__ = ["owner_stage", "stage_name", "whole_name", "whole_param_order"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
TIED_COPY = "output_layer.weight"  # on the last stage of a tied model: the embedding's copy
EMBEDDING = "embedding.word_embeddings.weight"


def whole_name(local: str, layers: range, tied_copy: bool) -> str:
    """The P = 1 name of this stage's tensor ``local`` (``layers``: the global layers the stage holds;
    ``tied_copy``: this stage's ``output_layer.weight`` is the tied embedding's copy)."""
    m = _LAYER.match(local)
    if m:
        return f"decoder.layers.{int(m.group(1)) + layers.start}.{m.group(2)}"
    return EMBEDDING if tied_copy and local == TIED_COPY else local


def stage_name(whole: str, layers: range) -> str | None:
    """The local name of the P = 1 tensor ``whole`` on the stage holding ``layers``, None for a layer it does
    not hold (stage-level tensors — embedding, final norm, output layer — map to themselves)."""
    m = _LAYER.match(whole)
    if not m:
        return whole
    i = int(m.group(1))
    return f"decoder.layers.{i - layers.start}.{m.group(2)}" if i in layers else None


def owner_stage(whole: str, num_layers: int, pp: int) -> int:
    """The stage that owns the P = 1 tensor ``whole``: its layer's, the first for the embedding, the last for the
    final norm and an untied output layer."""
    m = _LAYER.match(whole)
    if m:
        return int(m.group(1)) // (num_layers // pp)
    return 0 if whole.startswith("embedding.") else pp - 1


def whole_param_order(local_params: list[str], whole_names: list[str], layers: range) -> list[str]:
    """The P = 1 model's parameter names in its ``parameters()`` order (the optimizer state's keys in a checkpoint),
    from one stage's local order and the whole model's names.

    A GPTModel registers the embedding, then the decoder layers in order (each layer's parameters in one order,
    the same for every layer), the final norm, the output layer. The per-layer order is read off this stage's
    first layer.
    """
    per_layer = [m.group(2) for m in map(_LAYER.match, local_params) if m and int(m.group(1)) == 0]
    if not per_layer:
        raise ValueError(f"this pipeline stage holds no decoder layer (layers {layers})")
    num_layers = 1 + max(int(m.group(1)) for m in map(_LAYER.match, whole_names) if m)
    head = [n for n in whole_names if n.startswith("embedding.")]
    tail = [n for n in whole_names if not n.startswith("embedding.") and not _LAYER.match(n)]
    tail.sort(key=lambda n: (not n.startswith("decoder."), n))  # the final norm (decoder.*) before output_layer
    body = [f"decoder.layers.{i}.{suffix}" for i in range(num_layers) for suffix in per_layer]
    order = head + body + tail
    if sorted(order) != sorted(whole_names):
        raise ValueError(f"pipeline layout: the whole model's names differ from the per-stage order "
                         f"({sorted(set(order) ^ set(whole_names))[:4]})")
    return order
