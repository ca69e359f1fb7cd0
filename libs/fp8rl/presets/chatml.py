"""A character-level ChatML tokenizer with a Hermes / Qwen-style tool-calling chat template, built offline.

The multi-turn tests build their random policies with it (``tests/unit/envs/chatml_tokenizer.py`` re-exports
this module), and a tiny tool-using preset would save it beside its weights. ``build_chatml_tokenizer(directory)``
writes a Hugging Face tokenizer directory (``tokenizer.json``, ``tokenizer_config.json`` + chat template,
``generation_config.json``) that :func:`fp8rl.model.tokenizer.load_tokenizer` reads as an ``HFTokenizer`` — no
download, no model.

The model: character-level BPE over printable ASCII and newline plus a few merges (so ids are not simply
characters), the specials ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos, the end-of-turn
token) and ``<unk>``; no BOS. :data:`VOCAB_SIZE` ids in all (specials 0-3, characters 4-99 in
:class:`~fp8rl.model.tokenizer.CharTokenizer`'s order, merges from 100). ``generation_config.json`` stops on
``<|im_end|>`` and ``<|endoftext|>``, as Qwen's does.

The chat format (Qwen2.5's, simplified)::

    <|im_start|>system\\n{system}\\n\\n# Tools\\n...<tools>\\n{tool json}...\\n</tools>...<|im_end|>\\n   (tools given)
    <|im_start|>system\\n{system}<|im_end|>\\n                                                  (no tools)
    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n{content}<|im_end|>\\n
    <|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response>\\n<tool_response>...<|im_end|>\\n
    <|im_start|>assistant\\n                                                     (add_generation_prompt)

Consecutive ``tool`` messages share one ``user`` block, one ``<tool_response>`` each, as in Qwen2.5 / Qwen3.
``rewrite_history=True`` gives a template that drops the content of every assistant turn but the last (the
shape of Qwen3's ``<think>`` stripping), which breaks the prefix property on purpose.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["SPECIAL_TOKENS", "VOCAB_SIZE", "build_chatml_tokenizer", "chatml_template", "random_chat_checkpoint"]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")
_MERGES = [("t", "h"), ("th", "e"), ("a", "n"), ("i", "n"), ("e", "r"), ("o", "n"), ("r", "e"), ("e", " "),
           ("\n", "\n"), ("o", "o"), ("l", "l"), ("a", "t")]
VOCAB_SIZE = len(SPECIAL_TOKENS) + (ord("~") - ord(" ") + 1) + 1 + len(_MERGES)  # specials, ASCII, "\n", merges

_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within ' }}
    {{- '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' }}
    {{- '\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}{{- raise_exception('a system message must come first') }}{%- endif %}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + CONTENT + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


def chatml_template(rewrite_history: bool = False) -> str:
    """The Jinja chat template described in the module docstring."""
    content = ("(message.content if (message.role != 'assistant' or loop.last) else '')" if rewrite_history
               else "message.content")
    return _TEMPLATE.replace("CONTENT", content).strip()


def build_chatml_tokenizer(directory: str | Path, *, chat_template: str | None = None) -> Path:
    """Writes the tokenizer into ``directory`` (created if needed) and returns it.

    Args:
        directory: where the tokenizer files go.
        chat_template: Jinja source to store instead of :func:`chatml_template` ``()``.
    """
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    chars = [chr(c) for c in range(ord(" "), ord("~") + 1)] + ["\n"]
    vocab: dict[str, int] = {}
    for tok in (*SPECIAL_TOKENS, *chars, *(a + b for a, b in _MERGES)):
        vocab.setdefault(tok, len(vocab))
    backend = Tokenizer(BPE(vocab=vocab, merges=list(_MERGES), unk_token="<unk>"))
    backend.decoder = decoders.Fuse()  # characters join without spaces
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 unk_token="<unk>", clean_up_tokenization_spaces=False)
    hf.chat_template = chat_template if chat_template is not None else chatml_template()
    assert len(hf) == VOCAB_SIZE, (len(hf), VOCAB_SIZE)  # the constant above describes this vocabulary
    hf.save_pretrained(str(directory))
    stop = [vocab["<|im_end|>"], vocab["<|endoftext|>"]]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": stop}) + "\n")
    return directory


def random_chat_checkpoint(directory: str | Path, *, chat_template: str | None = None, seed: int = 0,
                           **arch) -> Path:
    """A seeded random 2-layer Llama (hidden 128, 2 heads, 1 KV head, 512 positions) with this tokenizer, saved as
    an HF checkpoint in ``directory``: the small chat policy the tests and benches of multi-turn trajectories,
    agents and the endpoint run (a random policy writes noise; what they check is the contract and exactness).
    ``arch`` overrides :class:`~fp8rl.model.ModelConfig` fields (e.g. ``max_position_embeddings``)."""
    import torch

    from fp8rl.model import CausalLM, ModelConfig, save_hf_checkpoint
    from fp8rl.model.tokenizer import load_tokenizer

    directory = build_chatml_tokenizer(directory, chat_template=chat_template)
    tok = load_tokenizer(directory)
    # the embedding padded to 128 rows past the tokenizer's VOCAB_SIZE ids (as real checkpoints pad theirs)
    cfg = ModelConfig(**{**dict(architecture="llama", vocab_size=128, hidden_size=128, intermediate_size=256,
                                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                max_position_embeddings=512, bos_token_id=None, eos_token_id=tok.eos_id,
                                pad_token_id=tok.pad_id), **arch})
    torch.manual_seed(seed)
    save_hf_checkpoint(CausalLM(cfg), cfg, directory)
    return directory
