"""Export a trained policy as a Hugging Face model directory that transformers and vLLM load.

``python -m fp8rl.export CHECKPOINT --out DIR [--format hf|hf-fp8] [--model PRESET_OR_HF_DIR]`` (also
``fp8rl export ...``) reads any trainer checkpoint — the torch backend's ``.pt`` file or its sharded ``.dcp``
directory written at any rank count, the Megatron backend's ``.pt`` at any tensor / pipeline size — or an HF
directory, and writes safetensors weights, ``config.json``, the tokenizer files (chat template included) and
``generation_config.json``:

* ``hf``: the master weights in their own dtype; transformers' logits equal fp8rl's;
* ``hf-fp8``: the Hub's blockwise-FP8 layout (E4M3 weights + ``weight_scale_inv`` per 128×128 block,
  ``quantization_config``), bit for bit the trainer's own FP8 weights (:mod:`.hf_fp8`).

One file per idea: :mod:`.readers` (checkpoint kinds → HF-named weights and what they record about their
model), :mod:`.hf_fp8` (the FP8 layout), :mod:`.tokenizer_files`, :mod:`.writer` (the directory, whole or not
at all), :mod:`.api` (the three verbs), ``__main__`` (the command line).

Invariant: an export never leaves a partial directory and never touches ``--out`` unless it succeeds (it
writes beside it and renames); every bad input raises :class:`ExportError` naming the path or key.
"""

from .api import FORMATS, ExportResult, export_checkpoint, load_checkpoint_policy, resolve_model, save_policy_hf
from .readers import ExportError, TrainerCheckpoint, read_checkpoint

__all__ = ["FORMATS", "ExportError", "ExportResult", "TrainerCheckpoint", "export_checkpoint",
           "load_checkpoint_policy", "read_checkpoint", "resolve_model", "save_policy_hf"]
