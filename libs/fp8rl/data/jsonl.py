"""Problems from JSON-lines files, plus the chain-of-thought prompt used for real math data.

Rows are read by :func:`fp8rl.data.rows.problem_from_row`: the known shapes (this project's
``{"prompt", "answer"}``, OpenMathInstruct-2's ``{"problem", "expected_answer"}``, verl's and GSM8K's) are
auto-detected per row; other shapes load with explicit (dotted) ``prompt_key`` / ``answer_key``. A prompt is
text, taken as is, or a list of chat messages; wrap raw math problems with :func:`wrap_math_prompt` before
sending them to a policy.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from fp8rl.limits import MAX_DATA_BYTES

from .files import DataFileError, open_regular_file, read_lines
from .problem import Problem
from .rows import KNOWN_SHAPES, problem_from_row

__all__ = ["KNOWN_SHAPES", "load_jsonl", "wrap_math_prompt"]


def load_jsonl(
    path: str | Path,
    *,
    prompt_key: str | None = None,
    answer_key: str | None = None,
    limit: int | None = None,
    max_rows: int | None = None,
    max_bytes: int = MAX_DATA_BYTES,
    key: str = "data.path",
    read_picture: Callable[[str, str], bytes] | None = None,
) -> list[Problem]:
    """Reads one :class:`Problem` per non-blank line of a UTF-8 JSON-lines file.

    Only a regular file is read (opened without blocking, see :func:`fp8rl.data.files.open_regular_file`),
    at most ``max_bytes`` of it.

    Args:
        path: the ``.jsonl`` file.
        prompt_key: dotted path of the prompt (text or chat messages); None: from :data:`KNOWN_SHAPES`
            (see :func:`fp8rl.data.rows.problem_from_row`).
        answer_key: dotted path of the reference answer. Strings are kept (stripped); ints and
            floats are converted with ``str``.
        limit: stop after this many problems (the rest of the file is not read); None reads all.
        max_rows: refuse a file holding more problems than this (None: no bound but ``max_bytes``).
        max_bytes: refuse a file larger than this.
        key: the job key naming the file, first in a :class:`DataFileError`'s message.
        read_picture: reads a row's picture given by path (under the data root); None refuses them.

    Returns:
        The problems in file order.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        DataFileError: ``path`` is not a regular file (a device, FIFO, directory), or it holds more than
            ``max_bytes`` bytes, a line over the line limit or more than ``max_rows`` problems.
        ValueError: bad arguments, or a line that is not UTF-8 JSON, a row that is not an
            object, lacks a key, has an empty prompt or one that is neither text nor chat messages, or an
            answer that is not a string or number — the message names the file and the 1-based line number.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"load_jsonl: limit must be a non-negative int or None, got {limit!r}")
    path = Path(path)
    problems: list[Problem] = []
    if limit == 0:
        return problems
    with open_regular_file(path, max_bytes, key) as f:  # bytes, so a bad encoding is reported with its line number
        for lineno, raw in read_lines(f, str(path), max_bytes, key=key):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid UTF-8 ({e.reason})") from None
            if not line.strip():
                continue
            if max_rows is not None and len(problems) >= max_rows:
                raise DataFileError(f"{key}: {path} holds more than {max_rows} problems (the limit); "
                                    f"line {lineno} is past it")
            problems.append(_parse_row(line, path, lineno, prompt_key, answer_key, read_picture))
            if limit is not None and len(problems) >= limit:
                break
    return problems


def _parse_row(line: str, path: Path, lineno: int, prompt_key: str | None, answer_key: str | None,
               read_picture: Callable[[str, str], bytes] | None = None) -> Problem:
    where = f"{path}:{lineno}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    return problem_from_row(row, where, prompt_key, answer_key, read_picture=read_picture)


def wrap_math_prompt(problem_text: str) -> str:
    """Builds a chain-of-thought prompt that asks for the final answer inside ``\\boxed{}``.

    The wording pairs with :func:`fp8rl.data.grading.extract_boxed`: graders read the last
    ``\\boxed{...}`` of the response.

    Raises:
        ValueError: ``problem_text`` is not a string or is blank.
    """
    if not isinstance(problem_text, str) or not problem_text.strip():
        raise ValueError(
            f"wrap_math_prompt: problem_text must be a non-empty string, got {problem_text!r:.80}"
        )
    return (
        "Work through the problem below one step at a time, showing your reasoning. "
        "When you are done, write the final answer alone inside \\boxed{}, for example \\boxed{42}.\n\n"
        f"Problem: {problem_text.strip()}\n\n"
        "Solution:"
    )
