"""The trainer's checkpoint directory: where SaveCheckpoint writes, what it may be called, how many are kept.

Invariants:

* Every checkpoint is a file directly inside the one directory the trainer was configured with
  (``--checkpoint-dir``); a request never supplies a path. A name is a plain file stem
  (:data:`NAME_PATTERN`: no separators, no ``..``, at most 64 characters), so ``<dir>/<name>.pt``
  cannot leave the directory.
* A checkpoint is a ``.pt`` file (one rank) or a ``.dcp`` directory of per-rank shards (a trainer over
  ``policy.training.dp_size`` ranks); both kinds count, prune and resume alike.
* Disk use is bounded: automatic checkpoints (``trainer-v<version>.pt``, what the controller asks for
  every ``job.checkpoint_every`` steps) are pruned to the newest ``keep`` by version after each save;
  named checkpoints are never pruned, but at most ``max_named`` distinct names exist (saving under an
  existing name replaces it).
* A checkpoint appears whole or not at all (the backends write a temporary file or directory and rename it).
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

from fp8rl.engines import TrainerBackend

log = logging.getLogger(__name__)

__all__ = ["AUTO_PATTERN", "NAME_PATTERN", "CheckpointDir", "CheckpointLimitError", "CheckpointNameError",
           "resolve_checkpoint"]

AUTO_PATTERN = re.compile(r"trainer-v(\d+)\.(?:pt|dcp)")  # the automatic checkpoints; --resume DIR picks the newest
SUFFIXES = (".pt", ".dcp")
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")
MAX_NAME_CHARS = 64


class CheckpointNameError(ValueError):
    """A requested checkpoint name is not a plain, allowed name (the message says which rule it broke)."""


class CheckpointLimitError(RuntimeError):
    """Saving would exceed the number of named checkpoints the trainer keeps."""


def check_name(name: str) -> str:
    """``name`` if it may name a checkpoint, else :class:`CheckpointNameError` naming the rule broken."""
    shown = repr(name[:80] + ("..." if len(name) > 80 else ""))
    if len(name) > MAX_NAME_CHARS:
        raise CheckpointNameError(f"checkpoint name {shown} is {len(name)} characters; at most {MAX_NAME_CHARS}")
    if "/" in name or "\\" in name or "\0" in name:
        raise CheckpointNameError(f"checkpoint name {shown} holds a path separator: give a plain name, never a path "
                                  f"(the trainer writes into its own checkpoint directory)")
    if ".." in name:
        raise CheckpointNameError(f"checkpoint name {shown} holds '..'")
    if not NAME_PATTERN.fullmatch(name):
        raise CheckpointNameError(f"checkpoint name {shown} must be letters, digits, '_', '.' or '-', starting with "
                                  f"a letter or digit")
    if AUTO_PATTERN.fullmatch(f"{name}.pt"):
        raise CheckpointNameError(f"checkpoint name {shown} is reserved for the automatic checkpoints "
                                  f"(trainer-v<version>); leave the name empty to write one")
    return name


def resolve_checkpoint(path: str) -> Path:
    """A checkpoint file, or the newest automatic ``trainer-v*.pt`` in a directory written by SaveCheckpoint.

    Raises:
        FileNotFoundError: no such file, or a directory without an automatic checkpoint.
    """
    p = Path(path)
    if p.is_dir() and not is_sharded_checkpoint(p):
        found = sorted((int(m.group(1)), f) for f in p.iterdir() if (m := AUTO_PATTERN.fullmatch(f.name)))
        if not found:
            raise FileNotFoundError(f"--resume {path}: no trainer-v*.pt or trainer-v*.dcp checkpoint in that directory")
        return found[-1][1]
    if not (p.is_file() or p.is_dir()):
        raise FileNotFoundError(f"--resume {path}: no such checkpoint file or directory")
    return p


def is_sharded_checkpoint(p: Path) -> bool:
    """Whether directory ``p`` is itself a checkpoint (``torch.distributed.checkpoint``'s ``.metadata`` inside)."""
    return (p / ".metadata").is_file()


def _remove(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


class CheckpointDir:
    """One trainer's checkpoint directory and its retention rules (module docstring).

    Args:
        directory: where every checkpoint goes (made absolute; created on the first save).
        keep: automatic checkpoints kept, newest by version; 0 keeps every one (unbounded disk use).
        max_named: distinct named checkpoints allowed; 0 refuses names.

    Raises:
        ValueError: ``keep`` or ``max_named`` negative.
    """

    def __init__(self, directory: str | Path, *, keep: int = 5, max_named: int = 8) -> None:
        if keep < 0:
            raise ValueError(f"--keep-checkpoints must be >= 0 (0 keeps every one), got {keep}")
        if max_named < 0:
            raise ValueError(f"--max-named-checkpoints must be >= 0 (0 refuses names), got {max_named}")
        self.directory = Path(directory).resolve()
        self.keep, self.max_named = keep, max_named

    def file_name(self, name: str, version: int, suffix: str = ".pt") -> str:
        """The file (or ``.dcp`` directory) a save under ``name`` ("" = automatic) at ``version`` writes.

        Raises:
            CheckpointNameError: a malformed name.
            CheckpointLimitError: a new name while ``max_named`` named checkpoints exist.
        """
        if suffix not in SUFFIXES:
            raise ValueError(f"checkpoint suffix {suffix!r} is not one of {', '.join(SUFFIXES)}")
        if not name:
            return f"trainer-v{version:06d}{suffix}"
        file = f"{check_name(name)}{suffix}"
        named = self.named()
        if file not in named and len(named) >= self.max_named:
            raise CheckpointLimitError(
                f"the trainer already keeps {len(named)} named checkpoints (--max-named-checkpoints "
                f"{self.max_named}); save under an existing name, or leave the name empty for an automatic one")
        return file

    def save(self, trainer: TrainerBackend, name: str = "") -> str:
        """Writes ``trainer``'s checkpoint under ``name``, prunes old automatic ones; returns the file name.

        Raises:
            CheckpointNameError, CheckpointLimitError: see :meth:`file_name` (nothing is written).
            OSError: the directory or file could not be written.
        """
        file = self.file_name(name, trainer.version, getattr(trainer, "checkpoint_suffix", ".pt"))
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.directory / file
        if target.parent != self.directory:  # cannot happen after check_name; kept as the invariant's guard
            raise CheckpointNameError(f"checkpoint {file!r} would be written outside {self.directory}")
        trainer.save_checkpoint(str(target))
        if not name:
            self.prune()
        return file

    def automatic(self) -> list[Path]:
        """The automatic checkpoints, oldest version first."""
        if not self.directory.is_dir():
            return []
        found = sorted((int(m.group(1)), f) for f in self.directory.iterdir()
                       if (m := AUTO_PATTERN.fullmatch(f.name)) and (f.is_file() or is_sharded_checkpoint(f)))
        return [f for _, f in found]

    def named(self) -> set[str]:
        """File names of the named checkpoints now in the directory."""
        if not self.directory.is_dir():
            return set()
        return {f.name for f in self.directory.iterdir()
                if f.suffix in SUFFIXES and not AUTO_PATTERN.fullmatch(f.name) and NAME_PATTERN.fullmatch(f.stem)}

    def prune(self) -> list[Path]:
        """Deletes all but the newest ``keep`` automatic checkpoints; returns what was deleted."""
        if self.keep == 0:
            return []
        old = self.automatic()[:-self.keep]
        for f in old:
            _remove(f)
        if old:
            log.info("pruned %d old checkpoint(s) (--keep-checkpoints %d): %s", len(old), self.keep,
                     ", ".join(f.name for f in old))
        return old
