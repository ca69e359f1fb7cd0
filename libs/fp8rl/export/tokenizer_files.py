"""The tokenizer and generation files of an exported directory, from the model directory the policy came from.

* Hugging Face tokenizer files (``tokenizer.json``, ``tokenizer_config.json`` — which holds the
  ``chat_template`` — ``chat_template.jinja``, ``special_tokens_map.json``, ``tokenizer.model``, ``vocab.json``,
  ``merges.txt``, ``added_tokens.json``) are copied byte for byte: the export tokenizes exactly as the run did.
* fp8rl's character tokenizer (``fp8rl_tokenizer.json``, the tiny presets) is copied too — fp8rl keeps reading
  it — and written once more as a Hugging Face fast tokenizer (:mod:`fp8rl.model.char_tokenizer_hf`: the same
  ids, a vision-language model's image tokens included), so ``AutoTokenizer``, ``AutoProcessor`` and vLLM read the
  directory as well (a source that has its own ``tokenizer.json`` beside it, as tiny-vl does, gives that one).
* a vision-language model's processor files (``preprocessor_config.json``, ``video_preprocessor_config.json``,
  ``processor_config.json``, ``chat_template.json``) are copied when the source has them, so ``AutoProcessor``
  loads the export as it loaded the source.
* ``generation_config.json`` is copied when the source has one (chat models list their end-of-turn EOS ids
  there), else written from the config's BOS / EOS / PAD ids.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from fp8rl.model import ModelConfig
from fp8rl.model.char_tokenizer_hf import HF_TOKENIZER_FILES, save_char_tokenizer_hf, vision_special_tokens
from fp8rl.model.tokenizer import CHAR_TOKENIZER_FILE, CharTokenizer

__all__ = ["HF_TOKENIZER_FILES", "GENERATION_CONFIG", "PROCESSOR_FILES", "write_tokenizer_files"]

PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
                   "chat_template.json")
GENERATION_CONFIG = "generation_config.json"

log = logging.getLogger(__name__)


def write_tokenizer_files(source: Path, out: Path, config: ModelConfig) -> list[str]:
    """Copy (or write) the files of the module docstring from model directory ``source`` into ``out``.

    Returns:
        the names written.

    Raises:
        FileNotFoundError: ``source`` holds no tokenizer (neither kind).
    """
    written = []
    for name in (*HF_TOKENIZER_FILES, CHAR_TOKENIZER_FILE):
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
            written.append(name)
    if CHAR_TOKENIZER_FILE in written and "tokenizer.json" not in written:
        tok = CharTokenizer.load(source)
        special = vision_special_tokens(config)
        if any(i < tok.vocab_size for i in special.values()):  # the model reads those characters as vision tokens
            log.warning("%s: the vision tokens %s take ids of the character vocabulary; the exported Hugging Face "
                        "tokenizer leaves them characters (a processor will not find its image token)", source, special)
            special = {}
        written += save_char_tokenizer_hf(tok, out, special)
    if not written:
        raise FileNotFoundError(f"model directory {source} holds no tokenizer (looked for "
                                f"{', '.join((*HF_TOKENIZER_FILES, CHAR_TOKENIZER_FILE))})")
    for name in PROCESSOR_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
            written.append(name)
    if (source / GENERATION_CONFIG).is_file():
        shutil.copyfile(source / GENERATION_CONFIG, out / GENERATION_CONFIG)
    else:
        gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
               "pad_token_id": config.pad_token_id}
        (out / GENERATION_CONFIG).write_text(json.dumps(gen, indent=2) + "\n")
    return [*written, GENERATION_CONFIG]

