"""fp8rl's character tokenizer written as a Hugging Face fast tokenizer, so ``AutoTokenizer`` (and a
vision-language model's ``AutoProcessor``) read a tiny preset's directory with the ids fp8rl uses.

One token per character (``"\\n"`` too), ``<bos>`` prepended as :meth:`CharTokenizer.encode` does (the
post-processor; ``add_special_tokens=False`` leaves it out), characters joined back as they are. A
vision-language model's special tokens (Qwen-VL's names: ``<|image_pad|>``, ``<|video_pad|>``,
``<|vision_start|>``, ``<|vision_end|>``) take the config's ids — ids the character vocabulary leaves unused —
and are matched whole before the text is split, which is how the processor finds the image token it expands.
fp8rl itself keeps reading ``fp8rl_tokenizer.json`` (:func:`fp8rl.model.tokenizer.load_tokenizer` prefers it).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from .tokenizer import CharTokenizer

__all__ = ["HF_TOKENIZER_FILES", "VISION_TOKENS", "save_char_tokenizer_hf", "vision_special_tokens"]

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                      "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
# The config key of each Qwen-VL vision token and the name its tokenizer (and processor) give it.
VISION_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                 "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}


def vision_special_tokens(config: object) -> dict[str, int]:
    """``{token name: id}`` of the vision tokens ``config`` sets (empty for a text-only config)."""
    return {name: int(getattr(config, key)) for key, name in VISION_TOKENS.items()
            if getattr(config, key, None) is not None}


def save_char_tokenizer_hf(tok: CharTokenizer, out: str | Path, special: Mapping[str, int] | None = None) -> list[str]:
    """Write ``tok`` into ``out`` as ``tokenizer.json`` + ``tokenizer_config.json`` (+ the special-tokens map);
    ``special`` adds whole-matched special tokens at the given ids. Returns the names written.

    Raises:
        ValueError: a special token's id is one of ``tok``'s characters', or two special tokens share an id.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    special = dict(special or {})
    clash = {n: i for n, i in special.items() if 0 <= i < len(tok.vocab)}
    if clash or len(set(special.values())) != len(special):
        raise ValueError(f"special tokens {special} must take distinct ids outside the {len(tok.vocab)}-character "
                         f"vocabulary (clashing: {clash or 'two share an id'})")
    pad, bos, eos, unk = (tok.vocab[i] for i in (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id))
    raw = Tokenizer(models.WordLevel({**{t: i for i, t in enumerate(tok.vocab)}, **special}, unk_token=unk))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character, "\n" too
    raw.decoder = decoders.Fuse()  # characters joined as they are, no spaces between
    raw.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                       special_tokens=[(bos, tok.bos_id)])
    if special:
        raw.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in special])
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=bos, eos_token=eos, pad_token=pad, unk_token=unk)
    if special:
        fast.add_special_tokens({"additional_special_tokens": list(special)})
    fast.save_pretrained(str(out))
    return [n for n in HF_TOKENIZER_FILES if (Path(out) / n).is_file()]
