"""Problems from a user's own data file: JSON lines, Parquet, or an Arrow dataset directory, read locally.

The format is told by the path (:func:`detect_format`):

* ``*.jsonl`` / ``*.json`` — JSON lines, one object per line (:func:`fp8rl.data.jsonl.load_jsonl`);
* ``*.parquet`` — one Parquet file (verl's preprocessed GSM8K / MATH, a Hub split's ``train-00000-of-00001.parquet``);
* a directory written by ``datasets.Dataset.save_to_disk`` (``state.json``, ``dataset_info.json``,
  ``data-00000-of-00001.arrow`` ...), or one ``*.arrow`` file (Arrow IPC, stream or file format).

Rows become problems by :func:`fp8rl.data.rows.problem_from_row` (known shapes, or dotted ``prompt_key`` /
``answer_key``); a bad row's message names the file and its line (JSON lines, 1-based) or row (Parquet and
Arrow, 0-based as ``dataset[i]``).

Safety: only local files are read, with ``pyarrow`` on descriptors this module opened and checked
(:mod:`fp8rl.data.files`: regular files, no blocking, size limits). The ``datasets`` library is never imported —
so nothing here can reach the network or the Hub cache — and nothing is unpickled: a ``save_to_disk``
directory is read from its ``state.json`` file list (plain names inside the directory only; a name with a
separator or a link out is refused) and its Arrow files. Decoded data is bounded too: at most
:data:`MAX_EXPANSION` × ``max_bytes`` of Arrow buffers (a small file of dictionary-encoded strings can decode
to far more than its size).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fp8rl.limits import MAX_DATA_BYTES

from .files import MAX_DIRECTORY_FILES, DataFileError, DataRoot, open_in_directory, open_regular_file
from .jsonl import load_jsonl
from .keys import top_level
from .problem import Problem
from .rows import problem_from_row, shape_columns

__all__ = ["FORMATS", "MAX_EXPANSION", "check_data_path", "detect_format", "load_problems", "read_problems"]

FORMATS = ("jsonl", "parquet", "arrow")
_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
_DATASET_MARKERS = ("state.json", "dataset_info.json")
MAX_EXPANSION = 8  # decoded Arrow bytes per byte of file, at most
_BATCH_ROWS = 256  # Parquet rows decoded at once: bounds one batch's memory when single rows are large
_MAX_STATE_BYTES = 1 << 20  # state.json is a few hundred bytes


def detect_format(path: str | Path, key: str = "data.path") -> str:
    """The format of ``path`` (one of :data:`FORMATS`), from its name, or for a directory from its files.

    Raises:
        DataFileError: a ``datasets.DatasetDict`` directory (name one split's directory), a directory that is no
            Arrow dataset, or a file name of no known format — the message says what is understood.
    """
    path = Path(path)
    if path.is_dir():
        with os.scandir(path) as it:
            names = {e.name for e in itertools.islice(it, MAX_DIRECTORY_FILES + 1)}
        if "dataset_dict.json" in names:
            splits = sorted(n for n in names if (path / n).is_dir())
            raise DataFileError(f"{key}: {str(path)!r} is a DatasetDict saved with save_to_disk (splits: "
                                f"{', '.join(splits) or 'none'}); name one split's directory, e.g. "
                                f"{str(path / (splits[0] if splits else 'train'))!r}")
        if any(n in names for n in _DATASET_MARKERS) or any(n.endswith(".arrow") for n in names):
            return "arrow"
        raise DataFileError(f"{key}: {str(path)!r} is a directory but no Arrow dataset (no state.json, "
                            f"dataset_info.json or *.arrow in it); name a .jsonl, .json, .parquet or .arrow file, or "
                            f"a directory written by datasets' save_to_disk")
    fmt = _SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise DataFileError(f"{key}: cannot tell the format of {str(path)!r} from its name: use .jsonl or .json "
                            f"(JSON lines), .parquet, .arrow, or a directory written by datasets' save_to_disk")
    return fmt


def check_data_path(root: DataRoot, path: str | Path, key: str = "data.path", fmt: str | None = None) -> str:
    """Submit-time check of a data path without reading rows: inside ``root``, a known format (or ``fmt``), a
    regular file — or for ``arrow`` possibly a directory of them — within ``root.max_bytes``. Returns the format.

    Raises:
        DataFileError: see :meth:`DataRoot.check` and :func:`detect_format`.
    """
    real = root.resolve(path, key)
    if fmt is None and not real.exists():
        root.check(path, key)  # "does not exist under the data root", before any word about formats
    fmt = fmt or detect_format(real, key)
    root.check(path, key, directory=fmt == "arrow")
    return fmt


def read_problems(root: DataRoot, path: str | Path, *, key: str = "data.path", fmt: str | None = None,
                  prompt_key: str | None = None, answer_key: str | None = None,
                  limit: int | None = None) -> list[Problem]:
    """:func:`load_problems` of ``path`` resolved under ``root`` (confined to it), within its limits."""
    real = root.resolve(path, key)
    return load_problems(real, fmt or detect_format(real, key), prompt_key=prompt_key, answer_key=answer_key,
                         limit=limit, max_rows=root.max_rows, max_bytes=root.max_bytes, key=key,
                         read_picture=root.read_picture)


def load_problems(path: str | Path, fmt: str | None = None, *, prompt_key: str | None = None,
                  answer_key: str | None = None, limit: int | None = None, max_rows: int | None = None,
                  max_bytes: int = MAX_DATA_BYTES, key: str = "data.path",
                  read_picture: Callable[[str, str], bytes] | None = None) -> list[Problem]:
    """The problems of one data file or Arrow dataset directory, in file order.

    Args:
        path: the file or directory (not confined here: :func:`read_problems` confines it to a data root).
        fmt: one of :data:`FORMATS`; None detects it (:func:`detect_format`).
        prompt_key, answer_key: dotted paths (:func:`fp8rl.data.rows.problem_from_row`); None: the known shapes.
        limit: stop after this many problems (the rest is not read); None reads all.
        max_rows: refuse (never cut) more rows than this; Parquet is checked from its footer before reading.
        max_bytes: refuse files (a directory's together) larger than this, or decoding to more than
            :data:`MAX_EXPANSION` times it.
        key: the job key naming the path, first in a :class:`DataFileError`'s message.
        read_picture: reads a row's picture given by path (:meth:`DataRoot.read_picture`); None refuses them.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        DataFileError: not a regular file (or a dataset directory of them), a link out, or over a limit.
        ValueError: an unreadable file, a missing column, or a bad row — naming the file and the line or row.
    """
    path = Path(path)
    fmt = fmt or detect_format(path, key)
    if fmt not in FORMATS:
        raise ValueError(f"load_problems: fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"load_problems: limit must be a non-negative int or None, got {limit!r}")
    if fmt == "jsonl":
        if path.suffix.lower() == ".json":
            _refuse_json_array(path, max_bytes, key)
        return load_jsonl(path, prompt_key=prompt_key, answer_key=answer_key, limit=limit, max_rows=max_rows,
                          max_bytes=max_bytes, key=key, read_picture=read_picture)
    problems: list[Problem] = []
    if limit == 0:
        return problems
    columns = shape_columns(prompt_key, answer_key)
    rows = (_parquet_rows if fmt == "parquet" else _arrow_rows)(path, columns, max_rows, max_bytes, key)
    checked = None
    try:
        for where, row, names in rows:
            if names is not checked:  # once per file: a named key's column must be there
                for k in (prompt_key, answer_key):
                    if k is not None and top_level(k) not in names:
                        raise ValueError(f"{where}: no column {top_level(k)!r} for key {k!r} (columns: "
                                         f"{sorted(names)})")
                checked = names
            problems.append(problem_from_row(row, where, prompt_key, answer_key, fields=names,
                                             read_picture=read_picture))
            if limit is not None and len(problems) >= limit:
                break
    finally:
        rows.close()  # closes the file of a reader stopped early
    return problems


def _refuse_json_array(path: Path, max_bytes: int, key: str) -> None:
    with open_regular_file(path, max_bytes, key) as f:
        head = f.read(4096).lstrip()
    if head.startswith(b"["):
        raise ValueError(f"{path}: holds one JSON array; a .json data file is read as JSON lines (one object per "
                         f"line): convert it, e.g. jq -c '.[]' {path.name} > {path.stem}.jsonl")


def _budget(max_bytes: int) -> int:
    return max_bytes * MAX_EXPANSION


def _parquet_rows(path: Path, columns: set[str], max_rows: int | None, max_bytes: int,
                  key: str) -> Iterator[tuple[str, dict, list[str]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open_regular_file(path, max_bytes, key) as f:
        try:
            pf = pq.ParquetFile(f)
            names = pf.schema_arrow.names
            n = pf.metadata.num_rows
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{path}: not a readable Parquet file ({e})") from None
        if max_rows is not None and n > max_rows:
            raise DataFileError(f"{key}: {path} holds {n} rows; the limit is {max_rows} rows")
        wanted = [c for c in names if c in columns]
        batches = pf.iter_batches(batch_size=_BATCH_ROWS, columns=wanted)
        for row, batch in _checked_batches(batches, path, str(path), key, max_bytes, 0, [0]):
            for i, r in enumerate(batch.to_pylist()):
                yield f"{path}: row {row + i}", r, names


def _checked_batches(batches: Iterator, where: Path, what: str, key: str, max_bytes: int, first_row: int,
                     decoded: list[int], wanted: list[str] | None = None) -> Iterator[tuple[int, Any]]:
    """``(first row, record batch)`` of ``batches`` (columns ``wanted`` when given), each checked: a read error
    names ``where`` and the first row it could not read, and the bytes decoded so far (``decoded[0]``, running over
    every file of a dataset) stay within ``MAX_EXPANSION`` x ``max_bytes``."""
    import pyarrow as pa

    row = first_row
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{where}: row {row} onwards cannot be read ({e})") from None
        if batch is None:
            return
        if wanted is not None:
            batch = batch.select(wanted)
        decoded[0] += batch.nbytes
        if decoded[0] > _budget(max_bytes):
            raise DataFileError(f"{key}: {what} decodes to more than {_budget(max_bytes)} bytes ({MAX_EXPANSION} x "
                                f"the {max_bytes}-byte limit) by row {row + batch.num_rows}")
        yield row, batch
        row += batch.num_rows


def _arrow_files(directory: Path, max_bytes: int, key: str) -> list[str]:
    """The Arrow files of a save_to_disk directory, in dataset order: ``state.json``'s list, or without one every
    ``*.arrow`` by name (``cache-*.arrow`` files, which ``datasets`` leaves beside its data, excluded)."""
    try:
        f = open_in_directory(directory, "state.json", min(max_bytes, _MAX_STATE_BYTES), key)
    except FileNotFoundError:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".arrow") and not n.startswith("cache-"))
        if not names:
            raise DataFileError(f"{key}: {str(directory)!r} holds no state.json and no .arrow files") from None
        return names
    with f:
        try:
            state = json.loads(f.read().decode("utf-8"))
            files = [d["filename"] for d in state["_data_files"]]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{directory / 'state.json'}: not a datasets state file (no _data_files list of "
                             f"{{'filename': ...}}: {type(e).__name__})") from None
    if not files or not all(isinstance(n, str) for n in files):
        raise ValueError(f"{directory / 'state.json'}: _data_files lists no file names")
    return files


def _arrow_rows(path: Path, columns: set[str], max_rows: int | None, max_bytes: int,
                key: str) -> Iterator[tuple[str, dict, list[str]]]:
    import pyarrow as pa
    import pyarrow.ipc as ipc

    if path.is_dir():
        opens = [(path / n, lambda n=n: open_in_directory(path, n, max_bytes, key))
                 for n in _arrow_files(path, max_bytes, key)]
    else:
        opens = [(path, lambda: open_regular_file(path, max_bytes, key))]
    row, size, decoded = 0, 0, [0]
    for name, opener in opens:
        with opener() as f:
            size += os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise DataFileError(f"{key}: the Arrow files of {str(path)!r} hold more than {max_bytes} bytes (the "
                                    f"limit); {name.name!r} goes past it")
            magic = f.read(6)  # the IPC file format starts with it; datasets writes the stream format
            f.seek(0)
            try:
                if magic == b"ARROW1":
                    reader: Any = ipc.open_file(f)
                    batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
                else:
                    reader = ipc.open_stream(f)
                    batches = iter(reader)
                names = reader.schema.names
            except (pa.ArrowException, OSError) as e:
                raise ValueError(f"{name}: not a readable Arrow file ({e})") from None
            wanted = [c for c in names if c in columns]
            start = row  # rows of the earlier files
            for first, batch in _checked_batches(batches, name, repr(str(path)), key, max_bytes, start, decoded,
                                                 wanted):
                if max_rows is not None and first + batch.num_rows > max_rows:
                    raise DataFileError(f"{key}: {str(path)!r} holds more than {max_rows} rows (the limit); "
                                        f"{name.name} row {max_rows - start} is past it")
                for i, r in enumerate(batch.to_pylist()):
                    yield f"{path}: row {first + i}", r, names
                row = first + batch.num_rows
