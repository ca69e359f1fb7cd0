"""Opening a job's data file safely: a regular file under a data root, never blocking, read within limits.

A job's ``data.path`` comes from whoever submitted the job, and the controller reads it. So:

* it is resolved against a :class:`DataRoot` (relative paths are relative to the root) with every
  symlink followed, and must land inside the root — ``../x`` or a link pointing out is refused;
* it must be a *regular* file: a device (``/dev/zero``), FIFO, socket or directory is refused. It is
  opened with ``O_NONBLOCK`` and checked with ``fstat`` on the open descriptor, so a FIFO can never
  block the opener and a file swapped for one after :meth:`DataRoot.check` is still caught;
* at most ``max_bytes`` are read (counted while reading, so a file that grows is stopped too), each
  line at most :data:`fp8rl.limits.MAX_DATA_LINE_BYTES`.

Every refusal is a :class:`DataFileError` (a ``ValueError``) whose message starts with ``data.path:``
and names the path, the limit and the value.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from fp8rl.limits import MAX_DATA_BYTES, MAX_DATA_LINE_BYTES, MAX_DATA_ROWS

__all__ = ["DataFileError", "DataRoot", "open_regular_file", "read_lines"]


class DataFileError(ValueError):
    """A data file is outside the data root, not a regular file, or over a limit."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular_file(path: str | Path, max_bytes: int = MAX_DATA_BYTES) -> BinaryIO:
    """``path`` opened for binary reading, after checking it is a regular file of at most ``max_bytes``.

    Opened with ``O_NONBLOCK`` (a FIFO or device never blocks this call) and checked with ``fstat`` on the
    descriptor itself, so what is checked is what is read.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        DataFileError: it is not a regular file, or it is larger than ``max_bytes``.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except IsADirectoryError:
        raise DataFileError(f"data.path: {str(path)!r} is a directory, not a regular file") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DataFileError(f"data.path: {str(path)!r} is {_kind(st.st_mode)}, not a regular file")
        if st.st_size > max_bytes:
            raise DataFileError(f"data.path: {str(path)!r} is {st.st_size} bytes; the limit is {max_bytes} bytes")
        os.set_blocking(fd, True)  # a regular file: blocking reads are plain reads
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_lines(f: BinaryIO, name: str, max_bytes: int = MAX_DATA_BYTES,
               max_line_bytes: int = MAX_DATA_LINE_BYTES) -> Iterator[tuple[int, bytes]]:
    """``(1-based line number, raw line)`` of ``f``, refusing a line over ``max_line_bytes`` or a total over
    ``max_bytes`` (:class:`DataFileError` naming ``name``) before reading much past either."""
    total, lineno = 0, 0
    while True:
        raw = f.readline(max_line_bytes + 1)
        if not raw:
            return
        lineno += 1
        total += len(raw)
        if total > max_bytes:
            raise DataFileError(f"data.path: {name} holds more than {max_bytes} bytes (the limit); "
                                f"line {lineno} goes past it")
        if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
            raise DataFileError(f"data.path: {name}:{lineno}: the line is longer than {max_line_bytes} bytes "
                                f"(the limit)")
        yield lineno, raw


@dataclass(frozen=True)
class DataRoot:
    """The directory job data files must live in, and how much of one is read.

    Attributes:
        root: every ``data.path`` must resolve (symlinks followed) to a file inside this directory;
            relative paths are taken relative to it.
        max_bytes: largest data file, in bytes (checked on open and while reading).
        max_rows: most problems one data file may hold; a file with more is refused, not cut.
    """

    root: Path = Path(".")
    max_bytes: int = MAX_DATA_BYTES
    max_rows: int = MAX_DATA_ROWS

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"DataRoot.{name} must be >= 1, got {getattr(self, name)}")

    def resolve(self, path: str | Path) -> Path:
        """The real path of ``path`` (relative to :attr:`root`), refused unless it lies inside the root.

        Raises:
            DataFileError: it resolves outside the root (``..``, an absolute path elsewhere, a symlink out).
        """
        root = Path(os.path.realpath(self.root))
        real = Path(os.path.realpath(root / path))
        if not real.is_relative_to(root):
            raise DataFileError(f"data.path: {str(path)!r} resolves to {str(real)!r}, outside the data root "
                                f"{str(root)!r} (data files must live under the data root; symlinks out of it "
                                f"are refused)")
        return real

    def check(self, path: str | Path) -> Path:
        """:meth:`resolve`, then open and check the file without reading it; returns the real path.

        Raises:
            DataFileError: outside the root, missing, unopenable, not a regular file, or over :attr:`max_bytes`.
        """
        real = self.resolve(path)
        try:
            open_regular_file(real, self.max_bytes).close()
        except FileNotFoundError:
            raise DataFileError(f"data.path: {str(path)!r} does not exist under the data root "
                                f"{str(os.path.realpath(self.root))!r}") from None
        except PermissionError:
            raise DataFileError(f"data.path: {str(path)!r} is not readable by the controller") from None
        except OSError as exc:  # e.g. a UNIX socket (ENXIO), a path component that is a file (ENOTDIR)
            raise DataFileError(f"data.path: {str(path)!r} cannot be opened: {exc.strerror}") from None
        return real
