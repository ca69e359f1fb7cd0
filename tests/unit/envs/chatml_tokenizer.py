"""The tiny ChatML tokenizer the environment tests render with: :mod:`fp8rl.presets.chatml`, re-exported."""

from fp8rl.presets.chatml import SPECIAL_TOKENS, VOCAB_SIZE, build_chatml_tokenizer, chatml_template

__all__ = ["SPECIAL_TOKENS", "VOCAB_SIZE", "build_chatml_tokenizer", "chatml_template"]
