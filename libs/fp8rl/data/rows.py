"""One data row → one :class:`Problem`: which fields hold the prompt and the answer, and what they may hold.

Every reader (JSON lines, Parquet, Arrow) hands its rows here as plain Python mappings, with ``where`` — the
file and line or row — so a bad row is reported the same way whatever the format.

Without explicit keys a row must match one of :data:`KNOWN_SHAPES`, tried in order:

* ``{"prompt", "answer"}`` — this project's own shape;
* ``{"problem", "expected_answer"}`` — OpenMathInstruct-2;
* ``{"prompt", "reward_model": {"ground_truth"}}`` — verl's preprocessed GSM8K / MATH (a chat prompt);
* ``{"question", "answer"}`` — GSM8K as published (the answer is a worked solution ending in ``#### 72``,
  which the graders read: :func:`fp8rl.data.grading.reference_answer`).

One key given, the other side is the first known shape's key for it that the row has.

A row may also hold pictures, verl's way: an ``images`` field, a list of image files (their bytes, or
``{"bytes": ...}`` as Parquet and Arrow datasets store an image), one per ``<image>`` placeholder of its text
prompt (a chat prompt's ``{"type": "image"}`` content parts are its placeholders). They are decoded (under limits)
where the policy's processor turns them into patches. A picture may also be
a path (a string, or ``{"path": ...}`` without bytes): the file under the data root, read when the rows are
(:meth:`fp8rl.data.files.DataRoot.read_picture`: confined to the root, at most
:data:`~fp8rl.data.files.MAX_PICTURE_BYTES`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .keys import KeyPathError, lookup
from .problem import Problem, as_messages

__all__ = ["IMAGES_FIELD", "KNOWN_SHAPES", "problem_from_row", "shape_columns"]

# (prompt_key, answer_key) pairs tried in order when the caller names no keys.
KNOWN_SHAPES: tuple[tuple[str, str], ...] = (
    ("prompt", "answer"),
    ("problem", "expected_answer"),
    ("prompt", "reward_model.ground_truth"),
    ("question", "answer"),
)


def _has(row: Mapping, key: str) -> bool:
    try:
        lookup(row, key)
    except KeyPathError:
        return False
    return True


def _keys_of(row: Mapping, prompt_key: str | None, answer_key: str | None, where: str,
             fields: list[str]) -> tuple[str, str]:
    if prompt_key is not None and answer_key is not None:
        return prompt_key, answer_key
    if prompt_key is None and answer_key is None:
        for shape in KNOWN_SHAPES:
            if all(_has(row, k) for k in shape):
                return shape
        shapes = " or ".join(f"{{{p!r}, {a!r}}}" for p, a in KNOWN_SHAPES)
        raise ValueError(f"{where}: row has keys {fields}; expected {shapes} (or name the fields "
                         f"with data.prompt_key / data.answer_key)")
    side = 0 if prompt_key is None else 1
    for shape in KNOWN_SHAPES:
        if _has(row, shape[side]):
            return (shape[0], answer_key) if side == 0 else (prompt_key, shape[1])
    wanted = sorted({s[side] for s in KNOWN_SHAPES})
    name = "data.prompt_key" if side == 0 else "data.answer_key"
    raise ValueError(f"{where}: row has keys {fields}; none of {wanted} (set {name})")


IMAGES_FIELD = "images"  # a row's pictures (verl's column): a list of image files' bytes, or of {"bytes": ...}


def shape_columns(prompt_key: str | None, answer_key: str | None) -> set[str]:
    """Top-level fields a reader must load to build problems with these keys (all the known shapes' when
    a key is not given), and the images field."""
    keys = {k for k in (prompt_key, answer_key) if k is not None} | {IMAGES_FIELD}
    if prompt_key is None or answer_key is None:
        keys |= {k for shape in KNOWN_SHAPES for k in shape}
    return {k.split(".", 1)[0] for k in keys}


def _images_of(row: Mapping, where: str, read_picture: Callable[[str, str], bytes] | None) -> tuple[bytes, ...]:
    """The row's ``images`` as encoded files (module docstring), in order; () when it has none. A path is read by
    ``read_picture(path, where)``; None refuses paths."""
    raw = row.get(IMAGES_FIELD)
    if raw is None:
        return ()
    if not isinstance(raw, list | tuple):
        raise ValueError(f"{where}: {IMAGES_FIELD!r} must be a list of images, got {type(raw).__name__}")
    out = []
    for i, item in enumerate(raw):
        data = item.get("bytes") if isinstance(item, Mapping) else item
        path = item if isinstance(item, str) else item.get("path") if isinstance(item, Mapping) and not data else None
        if isinstance(path, str) and path:
            if read_picture is None:
                raise ValueError(f"{where}: {IMAGES_FIELD}[{i}] is a path ({path!r:.80}); pictures by path are read "
                                 f"under the data root, by the job's data loading")
            out.append(read_picture(path, f"{where}: {IMAGES_FIELD}[{i}]"))
            continue
        if not isinstance(data, bytes | bytearray) or not data:
            raise ValueError(f"{where}: {IMAGES_FIELD}[{i}] must be an image file's bytes (or {{'bytes': ...}}, as "
                             f"Parquet datasets store images), or its path under the data root, got "
                             f"{type(data).__name__}")
        out.append(bytes(data))
    return tuple(out)


def problem_from_row(row: Any, where: str, prompt_key: str | None = None, answer_key: str | None = None,
                     fields: Sequence[str] | None = None, read_picture: Callable[[str, str], bytes] | None = None
                     ) -> Problem:
    """The :class:`Problem` of one row.

    Args:
        row: a mapping (a JSON object, an Arrow row).
        where: the file and line or row, put first in every error message (``data.jsonl:3``).
        prompt_key: dotted path of the prompt (:mod:`fp8rl.data.keys`); None: from :data:`KNOWN_SHAPES`.
        answer_key: dotted path of the reference answer; None: likewise.
        fields: the row's fields as its file has them, for messages (a columnar reader loads only the columns the
            known shapes use); None: the row's own keys.
        read_picture: reads a picture given by path (:meth:`fp8rl.data.files.DataRoot.read_picture`); None: a
            path is refused.

    The prompt is text (kept as is; it must not be blank) or a list of ``{"role", "content"}`` chat messages.
    The answer is a string (stripped) or a number (``str`` of it).

    Raises:
        ValueError: the row is not a mapping, no key matches, a key is missing, the prompt is neither non-empty
            text nor a list of messages, or the answer is not a non-empty string or a number — the message
            starts with ``where``.
    """
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: expected an object (a mapping of field names), got {type(row).__name__}")
    listed = sorted(map(str, fields if fields is not None else row))
    prompt_key, answer_key = _keys_of(row, prompt_key, answer_key, where, listed)
    try:
        prompt, answer = lookup(row, prompt_key), lookup(row, answer_key)
    except KeyPathError as e:
        raise ValueError(f"{where}: {e}") from None
    if isinstance(prompt, list | tuple):
        try:
            prompt = as_messages(prompt)
        except ValueError as e:
            raise ValueError(f"{where}: {prompt_key!r} is a list but not chat messages: {e}") from None
    elif not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: {prompt_key!r} must be a non-empty string or a list of chat messages, "
                         f"got {prompt!r:.80}")
    # bool is an int subclass, but "True" is never a meaningful math answer.
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise ValueError(f"{where}: {answer_key!r} must be a string or number, got {answer!r:.80}")
    answer = answer.strip() if isinstance(answer, str) else str(answer)
    if not answer:
        raise ValueError(f"{where}: {answer_key!r} is empty")
    images = _images_of(row, where, read_picture)
    try:
        return Problem(prompt=prompt, answer=answer, images=images)
    except ValueError as e:  # what a problem refuses (a chat prompt with images), named by its row
        raise ValueError(f"{where}: {e}") from None
