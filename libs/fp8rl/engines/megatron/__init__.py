"""The Megatron-Core trainer backend (``policy.training.backend: megatron``; extra ``fp8rl[megatron]``).

``convert`` (HF ↔ Megatron layout) needs only torch; ``model`` and ``trainer`` import megatron-core
when used. ``shims`` holds the CPU shims, applied explicitly by the trainer.
"""

from .convert import gate_up_rows, hf_to_megatron, megatron_names, megatron_to_hf, qkv_rows

__all__ = ["hf_to_megatron", "megatron_to_hf", "megatron_names", "qkv_rows", "gate_up_rows", "MegatronTrainer"]


def __getattr__(name: str):
    if name == "MegatronTrainer":  # imports megatron-core: only when asked for
        from .trainer import MegatronTrainer

        return MegatronTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
