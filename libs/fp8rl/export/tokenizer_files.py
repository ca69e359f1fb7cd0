"""The tokenizer and generation files of an exported directory, from the model directory the policy came from.

* Hugging Face tokenizer files (``tokenizer.json``, ``tokenizer_config.json`` — which holds the
  ``chat_template`` — ``chat_template.jinja``, ``special_tokens_map.json``, ``tokenizer.model``, ``vocab.json``,
  ``merges.txt``, ``added_tokens.json``) are copied byte for byte: the export tokenizes exactly as the run did.
* fp8rl's character tokenizer (``fp8rl_tokenizer.json``, the tiny presets) is copied too — fp8rl keeps reading
  it — and written once more as a Hugging Face fast tokenizer (one token per character, ``<bos>`` prepended as
  :meth:`CharTokenizer.encode` does), so ``AutoTokenizer`` and vLLM read the directory as well.
* a vision-language model's processor files (``preprocessor_config.json``, ``video_preprocessor_config.json``,
  ``processor_config.json``, ``chat_template.json``) are copied when the source has them, so ``AutoProcessor``
  loads the export as it loaded the source.
* ``generation_config.json`` is copied when the source has one (chat models list their end-of-turn EOS ids
  there), else written from the config's BOS / EOS / PAD ids.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from fp8rl.model import ModelConfig
from fp8rl.model.tokenizer import CHAR_TOKENIZER_FILE, CharTokenizer

__all__ = ["HF_TOKENIZER_FILES", "GENERATION_CONFIG", "PROCESSOR_FILES", "write_tokenizer_files"]

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                      "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
                   "chat_template.json")
GENERATION_CONFIG = "generation_config.json"


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
        written += _char_tokenizer_as_hf(CharTokenizer.load(source), out)
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


def _char_tokenizer_as_hf(tok: CharTokenizer, out: Path) -> list[str]:
    """``tokenizer.json`` + ``tokenizer_config.json``: ``tok`` as a fast tokenizer with the same ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    pad, bos, eos, unk = (tok.vocab[i] for i in (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id))
    raw = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tok.vocab)}, unk_token=unk))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character, "\n" too
    raw.decoder = decoders.Fuse()  # characters joined as they are, no spaces between
    raw.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                       special_tokens=[(bos, tok.bos_id)])
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=bos, eos_token=eos, pad_token=pad,
                            unk_token=unk).save_pretrained(str(out))
    return [n for n in HF_TOKENIZER_FILES if (out / n).is_file()]
