"""The decoder-only causal LM (Llama / Qwen2 / Qwen3 / Qwen3-MoE), its static KV cache, and HF checkpoint I/O.

Depends only on ``fp8rl.fp8`` (for the per-tensor FP8 KV quantizer). Tokenizers live in
``fp8rl.model.tokenizer`` and are imported from there, not re-exported here.

Invariant: parameter names are the HF checkpoint's, so a state dict moves between the model, the
trainer backends, refit and vLLM without a rename table.
"""

from .config import ModelConfig
from .hf_io import load_hf_checkpoint, model_from_tensors, save_hf_checkpoint
from .kv_cache import KVCache
from .router import Routing, routing
from .transformer import CausalLM

__all__ = ["ModelConfig", "CausalLM", "KVCache", "Routing", "load_hf_checkpoint", "model_from_tensors", "routing",
           "save_hf_checkpoint"]
