"""The one record every task source produces: a prompt and its reference answer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["IMAGE_PLACEHOLDER", "Message", "Messages", "Problem", "as_messages", "placeholders"]

IMAGE_PLACEHOLDER = "<image>"  # where a prompt's picture goes (a chat message's image part becomes one)

Message = tuple[str, str]  # (role, content), e.g. ("user", "What is 6*7?")
Messages = tuple[Message, ...]


@dataclass(frozen=True)
class Problem:
    """One task instance; frozen, hashable, and JSON-able (``dataclasses.asdict`` gives strings and lists).

    Attributes:
        prompt: either the exact text fed to the policy — the response is generated right after it, so a text
            prompt carries its own trailing separator (e.g. ``"Q: ...\\nA: "``) — or a chat: a tuple of
            ``(role, content)`` messages, which the job renders with the tokenizer's chat template (generation
            prompt added; :meth:`fp8rl.controller.plan.JobPlan.prompts`). Lists of pairs or of
            ``{"role", "content"}`` mappings are turned into that tuple on construction.
        answer: the reference answer as a string; graders compare a response against it
            (:mod:`fp8rl.data.grading`). Never empty for problems built by this package.
        images: a vision-language task's images, encoded files (PNG, JPEG ...: bytes), one per
            ``<image>`` placeholder of the prompt (of a chat's messages, in order: an image content part becomes
            one), in order; empty for a text task (whose problem is then JSON-able as described).
    """

    prompt: str | Messages
    answer: str
    images: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            object.__setattr__(self, "prompt", as_messages(self.prompt))
        if not isinstance(self.images, tuple):
            object.__setattr__(self, "images", tuple(self.images))
        if any(not isinstance(b, bytes) for b in self.images):
            raise ValueError("Problem.images: each image is the bytes of an image file")
        if self.images and placeholders(self.prompt) != len(self.images):
            raise ValueError(f"Problem.images: {placeholders(self.prompt)} {IMAGE_PLACEHOLDER} placeholder(s) in the "
                             f"prompt for {len(self.images)} image(s)")

    @property
    def is_chat(self) -> bool:
        """True when :attr:`prompt` is a list of chat messages rather than text."""
        return not isinstance(self.prompt, str)

    def messages(self) -> list[dict[str, str]]:
        """The chat prompt as ``[{"role": ..., "content": ...}, ...]`` (what chat templates take).

        Raises:
            ValueError: the prompt is text.
        """
        if isinstance(self.prompt, str):
            raise ValueError("Problem.messages: this problem's prompt is text, not chat messages")
        return [{"role": role, "content": content} for role, content in self.prompt]


def as_messages(value: Any) -> Messages:
    """``value`` — a non-empty list of ``{"role", "content"}`` mappings or of ``(role, content)`` pairs — as
    :data:`Messages`.

    Raises:
        ValueError: it is empty or not a list, a message lacks ``role`` or ``content``, a role is not a
            non-empty string, or a content is not a string (multimodal content parts are not supported).
    """
    if not isinstance(value, list | tuple) or not value:
        raise ValueError(f"expected a non-empty list of chat messages, got {value!r:.80}")
    out = []
    for i, msg in enumerate(value):
        if isinstance(msg, Mapping):
            if "role" not in msg or "content" not in msg:
                raise ValueError(f"message {i} has keys {sorted(map(str, msg))}; a chat message needs 'role' and "
                                 f"'content'")
            role, content = msg["role"], msg["content"]
        elif isinstance(msg, list | tuple) and len(msg) == 2:
            role, content = msg
        else:
            raise ValueError(f"message {i} is {msg!r:.80}; expected {{'role': ..., 'content': ...}}")
        if not isinstance(role, str) or not role.strip():
            raise ValueError(f"message {i}: 'role' must be a non-empty string, got {role!r:.80}")
        if isinstance(content, list | tuple):  # content parts: text, and images as placeholders
            content = _parts_text(content, i)
        if not isinstance(content, str):
            raise ValueError(f"message {i}: 'content' must be a string or a list of content parts, got "
                             f"{content!r:.80}")
        out.append((role, content))
    if not any(content.strip() for _, content in out):
        raise ValueError("every message's content is empty")
    return tuple(out)


def _parts_text(parts, i: int) -> str:
    """A message's content parts (``{"type": "text", "text": ...}``, ``{"type": "image"}`` — the chat templates'
    multimodal form) as text, each image part an :data:`IMAGE_PLACEHOLDER` (its picture is the problem's next)."""
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind == "image":
            out.append(IMAGE_PLACEHOLDER)
        else:
            raise ValueError(f"message {i}: content part {j} is {part!r:.80}; expected {{'type': 'text', 'text': "
                             f"...}} or {{'type': 'image'}}")
    return "".join(out)


def placeholders(prompt: str | Messages) -> int:
    """How many :data:`IMAGE_PLACEHOLDER` s a prompt holds (a chat's, over its messages)."""
    if isinstance(prompt, str):
        return prompt.count(IMAGE_PLACEHOLDER)
    return sum(content.count(IMAGE_PLACEHOLDER) for _, content in prompt)
