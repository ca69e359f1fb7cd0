"""Expert-parallel layout of the Megatron backend: which rank holds which expert, under which name.

With ``megatron_cfg.expert_model_parallel_size`` = EP, each mixture-of-experts layer's ``E`` experts are spread over
the EP ranks of an expert-parallel group (a slice of the data-parallel ranks, as Megatron-Core defines it): rank
``r`` holds experts ``[r E/EP, (r + 1) E/EP)``, numbered from 0 in its own state dict
(``mlp.experts.local_experts.{j}``). Every other tensor is replicated on every rank. Checkpoints and published
weights use the whole model's (EP = 1) names; these helpers map between the two and say which rank owns each
expert. Pure functions of names: no process group needed.
"""

from __future__ import annotations

import re

from fp8rl.model import ModelConfig

__all__ = ["check_expert_parallel", "expert_owner", "is_expert", "whole_expert_name", "whole_expert_order",
           "DISPATCHERS"]

_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)\.(.+)$")
DISPATCHERS = ("allgather", "alltoall")  # Megatron-Core's token dispatchers that run without CUDA-only kernels


def is_expert(name: str) -> bool:
    """Whether the Megatron tensor ``name`` belongs to one routed expert (held by one expert-parallel rank)."""
    return _EXPERT.match(name) is not None


def whole_expert_name(local: str, ep_rank: int, num_local: int) -> str:
    """The EP = 1 name of this rank's tensor ``local`` (its local expert ``j`` is global expert
    ``ep_rank * num_local + j``); any other tensor keeps its name."""
    m = _EXPERT.match(local)
    if not m:
        return local
    return f"{m.group(1)}{ep_rank * num_local + int(m.group(2))}.{m.group(3)}"


def expert_owner(whole: str, num_local: int) -> int:
    """The expert-parallel rank holding the EP = 1 expert tensor ``whole``."""
    m = _EXPERT.match(whole)
    if not m:
        raise ValueError(f"{whole} is not an expert's tensor")
    return int(m.group(2)) // num_local


def whole_expert_order(local_params: list[str], num_experts: int) -> list[str]:
    """The EP = 1 model's parameter names in its ``parameters()`` order (the optimizer state's keys in a checkpoint)
    from this rank's order: where a layer's local experts begin, all ``num_experts`` experts of the layer, each with
    the parameters of local expert 0 in its order; everything else as it is."""
    order: list[str] = []
    seen: set[str] = set()
    for name in local_params:
        m = _EXPERT.match(name)
        if not m:
            order.append(name)
            continue
        prefix = m.group(1)
        if prefix in seen:
            continue
        seen.add(prefix)
        suffixes = [e.group(3) for e in map(_EXPERT.match, local_params)
                    if e and e.group(1) == prefix and e.group(2) == "0"]
        order += [f"{prefix}{g}.{s}" for g in range(num_experts) for s in suffixes]
    return order


def check_expert_parallel(config: ModelConfig, ep: int, dp: int, dispatcher: str) -> None:
    """Refuse an expert-parallel layout that cannot run, naming the key.

    Raises:
        ValueError: EP > 1 on a dense model, EP not dividing the experts or the data-parallel ranks, or a
            dispatcher other than :data:`DISPATCHERS`.
    """
    key = "policy.training.megatron_cfg"
    if ep < 1:
        raise ValueError(f"{key}.expert_model_parallel_size={ep} must be at least 1")
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"{key}.moe_token_dispatcher_type={dispatcher!r}: one of {', '.join(DISPATCHERS)} (flex "
                         f"needs DeepEP / HybridEP kernels on CUDA)")
    if ep == 1:
        return
    if not config.moe_layers:
        raise ValueError(f"{key}.expert_model_parallel_size={ep}: the model ({config.architecture}) has no "
                         f"mixture-of-experts layer to spread over ranks")
    if config.num_experts % ep:
        raise ValueError(f"{key}.expert_model_parallel_size={ep} must divide the model's {config.num_experts} "
                         f"experts")
    if dp % ep:
        raise ValueError(f"{key}.expert_model_parallel_size={ep} must divide the data-parallel size ({dp} ranks): "
                         f"expert parallelism runs inside the data-parallel group")
