"""Opening a job's data file safely: a regular file under a data root, never blocking, read within limits.

A job's ``data.path`` (and ``data.validation_path``) comes from whoever submitted the job, and the controller
reads it. So:

* it is resolved against a :class:`DataRoot` (relative paths are relative to the root) with every
  symlink followed, and must land inside the root — ``../x`` or a link pointing out is refused;
* it must be a *regular* file: a device (``/dev/zero``), FIFO, socket or directory is refused. It is
  opened with ``O_NONBLOCK`` and checked with ``fstat`` on the open descriptor, so a FIFO can never
  block the opener and a file swapped for one after :meth:`DataRoot.check` is still caught;
* at most ``max_bytes`` are read (counted while reading, so a file that grows is stopped too), each
  line at most :data:`fp8rl.limits.MAX_DATA_LINE_BYTES`;
* a dataset *directory* (an Arrow dataset written by ``datasets.Dataset.save_to_disk``) is allowed where the
  caller says so (:meth:`DataRoot.check` ``directory=True``): it must itself resolve inside the root, every
  entry in it must resolve (symlinks followed) to a regular file inside that directory, and their sizes
  together are at most ``max_bytes``.

Every refusal is a :class:`DataFileError` (a ``ValueError``) whose message starts with the job key
(``data.path:``) and names the path, the limit and the value.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from fp8rl.limits import MAX_DATA_BYTES, MAX_DATA_LINE_BYTES, MAX_DATA_ROWS

__all__ = ["MAX_PICTURE_BYTES", "DataFileError", "DataRoot", "check_directory", "open_in_directory",
           "open_regular_file", "read_lines"]

MAX_PICTURE_BYTES = 8 << 20
"""Largest picture file a data row may name by path (the policy's image limits, checked when it is decoded, are
:class:`fp8rl.model.image_inputs.ImageLimits`; its default ``max_bytes`` is the same)."""


class DataFileError(ValueError):
    """A data file is outside the data root, not a regular file, or over a limit."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular_file(path: str | Path, max_bytes: int = MAX_DATA_BYTES, key: str = "data.path") -> BinaryIO:
    """``path`` opened for binary reading, after checking it is a regular file of at most ``max_bytes``.

    Opened with ``O_NONBLOCK`` (a FIFO or device never blocks this call) and checked with ``fstat`` on the
    descriptor itself, so what is checked is what is read. ``key`` (the job key naming the file) starts
    every error message.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        DataFileError: it is not a regular file, or it is larger than ``max_bytes``.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except IsADirectoryError:
        raise DataFileError(f"{key}: {str(path)!r} is a directory, not a regular file") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DataFileError(f"{key}: {str(path)!r} is {_kind(st.st_mode)}, not a regular file")
        if st.st_size > max_bytes:
            raise DataFileError(f"{key}: {str(path)!r} is {st.st_size} bytes; the limit is {max_bytes} bytes")
        os.set_blocking(fd, True)  # a regular file: blocking reads are plain reads
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_lines(f: BinaryIO, name: str, max_bytes: int = MAX_DATA_BYTES,
               max_line_bytes: int = MAX_DATA_LINE_BYTES, key: str = "data.path") -> Iterator[tuple[int, bytes]]:
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
            raise DataFileError(f"{key}: {name} holds more than {max_bytes} bytes (the limit); "
                                f"line {lineno} goes past it")
        if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
            raise DataFileError(f"{key}: {name}:{lineno}: the line is longer than {max_line_bytes} bytes "
                                f"(the limit)")
        yield lineno, raw


MAX_DIRECTORY_FILES = 1024  # entries of one dataset directory (datasets writes one .arrow file per shard)


def _inside(real: str, directory: str) -> bool:
    return Path(real).is_relative_to(directory) and real != directory


def open_in_directory(directory: str | Path, name: str, max_bytes: int = MAX_DATA_BYTES,
                      key: str = "data.path") -> BinaryIO:
    """File ``name`` of ``directory``, opened as :func:`open_regular_file` does, refused unless ``name`` is a plain
    file name that resolves (symlinks followed) inside ``directory``.

    Raises:
        FileNotFoundError: there is no such file.
        DataFileError: ``name`` is not a plain name, it resolves outside ``directory``, or it is not a regular
            file of at most ``max_bytes``.
    """
    if not isinstance(name, str) or not name or "/" in name or name in (".", "..") or "\0" in name:
        raise DataFileError(f"{key}: {name!r:.80} in {str(directory)!r} is not a plain file name (a dataset "
                            f"directory's files must be plain names inside it)")
    real_dir = os.path.realpath(directory)
    real = os.path.realpath(os.path.join(real_dir, name))
    if not _inside(real, real_dir):
        raise DataFileError(f"{key}: {os.path.join(str(directory), name)!r} resolves to {real!r}, outside its "
                            f"dataset directory {real_dir!r} (symlinks out of it are refused)")
    return open_regular_file(real, max_bytes, key)


def check_directory(directory: str | Path, max_bytes: int = MAX_DATA_BYTES, key: str = "data.path") -> int:
    """Check every entry of dataset directory ``directory`` (not recursive) without reading it: each resolves
    inside the directory to a regular file, at most :data:`MAX_DIRECTORY_FILES` of them, ``max_bytes`` together.
    Returns their total size in bytes.

    Raises:
        DataFileError: an entry is a link out, a subdirectory or another non-regular file, or over a limit.
    """
    total = 0
    with os.scandir(directory) as entries:
        for count, entry in enumerate(entries, 1):
            if count > MAX_DIRECTORY_FILES:
                raise DataFileError(f"{key}: {str(directory)!r} holds more than {MAX_DIRECTORY_FILES} entries "
                                    f"(the limit)")
            try:
                with open_in_directory(directory, entry.name, max_bytes, key) as f:
                    total += os.fstat(f.fileno()).st_size
            except FileNotFoundError:  # a dangling link, or removed meanwhile
                raise DataFileError(f"{key}: {entry.path!r} does not exist (a dangling link?)") from None
            except OSError as exc:  # not a DataFileError (that is a ValueError): e.g. a socket (ENXIO)
                raise DataFileError(f"{key}: {entry.path!r} cannot be opened: {exc.strerror}") from None
            if total > max_bytes:
                raise DataFileError(f"{key}: the files of {str(directory)!r} hold more than {max_bytes} bytes "
                                    f"(the limit); {entry.name!r} goes past it")
    return total


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

    def resolve(self, path: str | Path, key: str = "data.path") -> Path:
        """The real path of ``path`` (relative to :attr:`root`), refused unless it lies inside the root.

        Raises:
            DataFileError: it resolves outside the root (``..``, an absolute path elsewhere, a symlink out); the
                message starts with ``key``.
        """
        root = Path(os.path.realpath(self.root))
        real = Path(os.path.realpath(root / path))
        if not real.is_relative_to(root):
            raise DataFileError(f"{key}: {str(path)!r} resolves to {str(real)!r}, outside the data root "
                                f"{str(root)!r} (data files must live under the data root; symlinks out of it "
                                f"are refused)")
        return real

    def read_picture(self, path: str, where: str) -> bytes:
        """The bytes of a data row's picture given by ``path`` (relative to :attr:`root`): confined to the root, a
        regular file of at most :data:`MAX_PICTURE_BYTES` (decoded later, under the policy's image limits).

        Raises:
            ValueError: outside the root, missing, not a regular file, or too big — the message starts with ``where``.
        """
        try:
            with open_regular_file(self.resolve(path, where), MAX_PICTURE_BYTES, where) as f:
                data = f.read(MAX_PICTURE_BYTES + 1)
        except FileNotFoundError:
            raise ValueError(f"{where}: picture {path!r:.120} does not exist under the data root "
                             f"{str(os.path.realpath(self.root))!r}") from None
        except OSError as exc:  # (a DataFileError — outside the root, not a regular file, too big — goes as it is)
            raise ValueError(f"{where}: picture {path!r:.120} cannot be read: {exc.strerror}") from None
        if len(data) > MAX_PICTURE_BYTES:  # it grew after the check
            raise DataFileError(f"{where}: picture {path!r:.120} is over {MAX_PICTURE_BYTES} bytes")
        return data

    def check(self, path: str | Path, key: str = "data.path", directory: bool = False) -> Path:
        """:meth:`resolve`, then open and check the file without reading it; returns the real path.

        With ``directory`` a directory is allowed too (an Arrow dataset): :func:`check_directory` checks its
        entries, within :attr:`max_bytes` together.

        Raises:
            DataFileError: outside the root, missing, unopenable, not a regular file (nor, with ``directory``, a
                directory of them), or over :attr:`max_bytes`; the message starts with ``key``.
        """
        real = self.resolve(path, key)
        if directory and real.is_dir():
            check_directory(real, self.max_bytes, key)
            return real
        try:
            open_regular_file(real, self.max_bytes, key).close()
        except FileNotFoundError:
            raise DataFileError(f"{key}: {str(path)!r} does not exist under the data root "
                                f"{str(os.path.realpath(self.root))!r}") from None
        except PermissionError:
            raise DataFileError(f"{key}: {str(path)!r} is not readable by the controller") from None
        except OSError as exc:  # e.g. a UNIX socket (ENXIO), a path component that is a file (ENOTDIR)
            raise DataFileError(f"{key}: {str(path)!r} cannot be opened: {exc.strerror}") from None
        return real
