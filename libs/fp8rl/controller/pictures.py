"""A vision-language step's pictures, sequence by sequence, in the step's record.

A step's calibration runs on its sequences (prompt + response token ids). Prompts do not tell pictures apart — the
counting task asks every picture the same question, so its prompts are the same token ids — so each sequence's
pictures are recorded beside it, by position: :func:`step_pictures` writes them into the step's record (JSON, as
the stack keeps it in Redis: each distinct file once, base64), :func:`sequence_files` reads them back.
:func:`picture_table` is the one way a list of rows' files becomes each distinct file once plus per-row indices
(the step's record here, the stack's TrainStep and Calibrate requests).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

__all__ = ["picture_table", "sequence_files", "step_pictures"]


def picture_table(files: Sequence[Sequence[bytes]]) -> tuple[list[bytes], list[list[int]]]:
    """Rows' image files as every distinct file once and, per row, the indices of its own."""
    table: dict[bytes, int] = {}
    indices = [[table.setdefault(f, len(table)) for f in row] for row in files]
    return list(table), indices


def step_pictures(problems: Sequence[Any], samples: Sequence[tuple[int, Any]]) -> dict | None:
    """``{"files": [base64 file, ...], "of": [[file index, ...] per sample]}`` of ``samples`` (``(problem index,
    sample)``, the step's order), None when no problem has pictures."""
    if not any(p.images for p in problems):
        return None
    files, of = picture_table([problems[i].images for i, _ in samples])
    return {"files": [base64.b64encode(f).decode("ascii") for f in files], "of": of}


def sequence_files(pictures: dict, n: int) -> list[tuple[bytes, ...]]:
    """Per sequence its image files, from a :func:`step_pictures` record of ``n`` sequences.

    Raises:
        ValueError: the record is not one of ``n`` sequences.
    """
    files = [base64.b64decode(f) for f in pictures["files"]]
    of = pictures["of"]
    if len(of) != n:
        raise ValueError(f"the step's pictures are of {len(of)} sequences, calibration has {n}")
    return [tuple(files[j] for j in idx) for idx in of]
