"""The registered model families, one module each (:mod:`fp8rl.model.family`).

Each module registers its :class:`~fp8rl.model.family.Family` when imported; the registry imports every one of
``MODULES`` on its first lookup. Adding a family is adding its module and its name here.
"""

MODULES = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "deepseek_v3",
    "gemma3_text",
    "qwen2_5_vl",
    "qwen3_vl",
)
