"""Token-in / token-out rendering of an environment's messages with the tokenizer's own chat template.

A trajectory's token ids are built by appending, never by re-rendering (DESIGN §4c)::

    ids  = renderer.opening(opening_messages, tools)          # prompt, ends with the generation prompt
    ids += model_ids                                            # the model's sampled ids, stop token INCLUDED
    d, prefix_ok = renderer.delta(history, env_messages, tools)
    ids += d                                                    # env messages + next generation prompt
    ids += model_ids_2 ...

where ``history`` is every message so far, ending with the model's turn as ``{"role": "assistant", "content":
<decoded text of the turn, without its stop token>}``.

**Where a delta starts.** The model ends its turn by sampling the end-of-turn token (``<|im_end|>`` in
ChatML, one of the tokenizer's ``eos_ids``), and the caller keeps that token in the model's segment. So the
delta starts right *after* the last end-of-turn token in the template's rendering of ``history``: whatever the
template writes after it (ChatML's ``"\\n"``) belongs to the delta. The template may write only whitespace
there (anything else is refused with a ValueError: it could not be placed soundly). A turn cut by the token
budget has no stop token: the caller ends the trajectory there (or appends :attr:`ChatRenderer.end_of_turn_id`
as an environment token before asking for a delta).

**The rule, on text, then tokenized once** (the cut sits right after a special token, which tokenizers never
merge across, so tokenizing the suffix alone gives the same ids as tokenizing the whole)::

    past = render(history)                       # no generation prompt
    full = render(history + new, add_generation_prompt=True)
    cut  = end of the last end-of-turn token in past
    prefix_ok = full[:cut] == past[:cut]
    delta = full[cut:]                           # when prefix_ok

When the template rewrites earlier turns (Qwen3 strips ``<think>`` from assistant turns before the last user
message; verl #6854, NeMo RL #2821), ``full`` does not extend ``past`` and no suffix of ``full`` is sound. Then
the new messages are rendered after a *neutral* history — the history's system message (if any) and an empty
user / assistant exchange, so tools, default system prompts and "after an assistant turn" context are the
same. With ``k`` the number of end-of-turn tokens in ``render(neutral)``, the delta is the text of
``render(neutral + new, add_generation_prompt=True)`` after its ``k``-th end-of-turn token. Counting turns
rather than comparing text lets the template rewrite the neutral turns too (Qwen3 renders the empty assistant
turn with an empty ``<think>`` block while it is last, and without one once a user message follows); the
neutral contents are empty, so no end-of-turn string can hide in them. The tokens the model already saw are
kept exactly (it was sampled on them; the trainer re-reads the same ids), only the new messages are added, and
``prefix_ok=False`` is reported so the caller can count it in a metric. A template that drops turns of the
neutral history raises ValueError naming the model.

Only Hugging Face tokenizers with a chat template are supported (``HFTokenizer`` of
:mod:`fp8rl.model.tokenizer`); ``encode(..., add_bos=False)`` is used throughout because the template writes
its own BOS, so the prompt never gets two. Message contents are rendered as text: a tool result holding the
literal text of a special token (``<|im_end|>``) is tokenized as that token, as in every text-rendering stack.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .base import Message, check_message

if TYPE_CHECKING:
    from fp8rl.model.tokenizer import HFTokenizer

__all__ = ["ChatRenderer"]

_NEUTRAL_EXCHANGE: list[Message] = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]


class ChatRenderer:
    """Renders opening prompts and per-turn deltas as token ids; see the module docstring for the rules."""

    def __init__(self, tokenizer: HFTokenizer, *, template_kwargs: dict[str, Any] | None = None):
        """Args:
            tokenizer: an :class:`fp8rl.model.tokenizer.HFTokenizer` whose tokenizer has a chat template.
            template_kwargs: extra variables for every template call (e.g. ``{"enable_thinking": False}``).

        Raises:
            ValueError: the tokenizer has no chat template, or none of its stop tokens is a token string.
        """
        hf = getattr(tokenizer, "hf_tokenizer", None)
        self.model = str(getattr(hf, "name_or_path", "") or type(tokenizer).__name__)
        template = getattr(hf, "chat_template", None)
        if not (isinstance(template, str) and template):
            raise ValueError(f"{self.model}: tokenizer has no chat template; multi-turn rendering needs a chat "
                             f"model's tokenizer (an HF tokenizer with chat_template)")
        self.tokenizer = tokenizer
        self._hf = hf
        self.template_kwargs = dict(template_kwargs or {})
        stop_ids = list(getattr(tokenizer, "eos_ids", None) or [tokenizer.eos_id])
        self.stop_ids: tuple[int, ...] = tuple(stop_ids)
        """The ids that end a model turn (the tokenizer's ``eos_ids``)."""
        self.end_of_turn_id: int = stop_ids[0]
        """The id a turn ends with (the tokenizer's ``eos_id``): the caller appends it to a turn cut short."""
        strings = [t for t in hf.convert_ids_to_tokens(stop_ids) if isinstance(t, str) and t]
        if not strings:
            raise ValueError(f"{self.model}: stop token ids {stop_ids} have no token strings")
        self._end_of_turn = tuple(strings)
        self._end_of_turn_re = re.compile("|".join(map(re.escape, sorted(strings, key=len, reverse=True))))

    def render(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None, *,
               add_generation_prompt: bool) -> str:
        """``messages`` as the template renders them (text, special tokens written out)."""
        for i, m in enumerate(messages):
            check_message(m, f"messages[{i}]")
        return self._hf.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                            add_generation_prompt=add_generation_prompt, tokenize=False,
                                            **self.template_kwargs)

    def encode(self, text: str) -> list[int]:
        """Ids of rendered text; never adds BOS (the template writes its own)."""
        return self.tokenizer.encode(text, add_bos=False)

    def opening(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """The prompt of a trajectory: ``messages`` (system + user) with the assistant's generation prompt."""
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def _ends_of_turns(self, text: str) -> list[int]:
        """Positions right after each end-of-turn token in ``text``, in order."""
        return [m.end() for m in self._end_of_turn_re.finditer(text)]

    def _cut(self, past: str) -> int:
        """Position right after the last end-of-turn token in ``past`` (the rendering of a history ending with
        the model's turn); only whitespace may follow it."""
        ends = self._ends_of_turns(past)
        if not ends:
            raise ValueError(f"{self.model}: the chat template ends an assistant turn with none of the stop "
                             f"tokens {list(self._end_of_turn)}; the model's turn cannot end where it does")
        if past[ends[-1]:].strip():
            raise ValueError(f"{self.model}: the chat template writes {past[ends[-1]:][:60]!r} after the "
                             f"assistant's end-of-turn token; a delta cannot start after the model's own tokens")
        return ends[-1]

    def delta(self, history: Sequence[Message], new_messages: Sequence[Message],
              tools: Sequence[dict[str, Any]] | None = None) -> tuple[list[int], bool]:
        """The ids the template appends for ``new_messages`` and the next generation prompt, after a history
        that ends with the model's turn (whose ids, stop token included, the caller already holds).

        Returns:
            ``(ids, prefix_ok)``: ``prefix_ok`` is False when the template rewrote earlier turns and the
            neutral-history rule was used (module docstring).

        Raises:
            ValueError: ``history`` does not end with an assistant message; a message is malformed; the
                template writes text after the end-of-turn token or drops turns of the neutral history.
        """
        history, new = list(history), list(new_messages)
        if not history or not isinstance(history[-1], dict) or history[-1].get("role") != "assistant":
            raise ValueError("delta: history must end with the model's turn (role 'assistant')")
        past = self.render(history, tools, add_generation_prompt=False)
        cut = self._cut(past)
        full = self.render(history + new, tools, add_generation_prompt=True)
        if full[:cut] == past[:cut]:
            return self.encode(full[cut:]), True
        neutral = ([history[0]] if history[0].get("role") == "system" else []) + _NEUTRAL_EXCHANGE
        n_past = self.render(neutral, tools, add_generation_prompt=False)
        self._cut(n_past)  # the same checks as for the real history
        k = len(self._ends_of_turns(n_past))
        n_full = self.render(neutral + new, tools, add_generation_prompt=True)
        ends = self._ends_of_turns(n_full)
        if len(ends) < k:
            raise ValueError(f"{self.model}: the chat template drops turns of a neutral history "
                             f"({len(ends)} end-of-turn tokens, {k} expected); no delta keeps the model's tokens")
        return self.encode(n_full[ends[k - 1]:]), False
