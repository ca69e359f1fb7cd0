"""Tokenizers behind one small protocol: a fixed character vocabulary, or a local HF tokenizer.

* :class:`CharTokenizer` — the tiny embedded preset's vocabulary: four specials, then printable
  ASCII and newline; deterministic, no files needed, saved as ``fp8rl_tokenizer.json``.
* :class:`HFTokenizer` — any tokenizer directory ``transformers.AutoTokenizer`` can read, loaded
  with ``local_files_only=True``: a model directory is always local, never fetched from a hub.
* :func:`load_tokenizer` — picks the right one for a directory.
* :func:`render_chat_prompt` — a prompt as the tokenizer's own chat template renders it (one user
  turn or a given list of messages, optional system turn, the assistant's generation prompt); encode
  the result with ``add_bos=False``: the template writes its own special tokens.

Invariants both keep: ``encode`` never adds EOS unless asked (SFT appends it to targets; prompts
for generation must not end in it), and ``decode(encode(t))`` round-trips text the vocabulary
covers when specials are skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "CHAR_TOKENIZER_FILE", "CharTokenizer", "HFTokenizer", "Tokenizer", "chat_template_of", "load_tokenizer",
    "render_chat_prompt", "stop_token_ids",
]

CHAR_TOKENIZER_FILE = "fp8rl_tokenizer.json"
# Files whose presence marks a directory as a Hugging Face tokenizer.
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@runtime_checkable
class Tokenizer(Protocol):
    """What engines, trainers and the loop need from a tokenizer.

    Attributes:
        vocab_size: number of distinct ids; every id ``encode`` returns is in ``[0, vocab_size)``.
            The model's embedding may be larger (padded); this is the real count.
        pad_id: id used to pad batches (never trained on).
        bos_id: id prepended by ``encode(add_bos=True)``; None when the tokenizer has none.
        eos_id: id that ends a sequence; generation stops on it.
    """

    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_id: int

    def encode(self, text: str, *, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``, with BOS first when ``add_bos`` (and the tokenizer has one)
        and EOS last when ``add_eos``."""
        ...

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped when ``skip_special``."""
        ...


REPLACEMENT_CHAR = "\ufffd"


class CharTokenizer:
    """One token per character over a fixed vocabulary.

    Ids: ``<pad>=0, <bos>=1, <eos>=2, <unk>=3``, then printable ASCII ``' '..'~'`` (ids 4-98),
    then ``'\\n'`` (99): ``vocab_size == 100``. Characters outside the vocabulary encode to
    ``<unk>`` (so ``decode`` cannot restore them).
    """

    SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
    pad_id = 0
    bos_id = 1
    eos_id = 2
    unk_id = 3

    def __init__(self, vocab: Sequence[str] | None = None):
        """Builds the tokenizer.

        Args:
            vocab: full id-ordered vocabulary, specials first (as saved by :meth:`save`); None
                uses the default described on the class.

        Raises:
            ValueError: ``vocab`` does not start with the four specials, has repeats, or has a
                non-special entry that is not exactly one character.
        """
        if vocab is None:
            vocab = self.default_vocab()
        vocab = list(vocab)
        if tuple(vocab[: len(self.SPECIALS)]) != self.SPECIALS:
            raise ValueError(f"CharTokenizer vocab must start with {list(self.SPECIALS)}, got {vocab[:4]!r}")
        chars = vocab[len(self.SPECIALS) :]
        bad = [c for c in chars if not isinstance(c, str) or len(c) != 1]
        if bad:
            raise ValueError(
                f"CharTokenizer vocab entries after the specials must be single characters: {bad[:5]!r}"
            )
        if len(set(vocab)) != len(vocab):
            raise ValueError("CharTokenizer vocab has repeated entries")
        self.vocab: list[str] = vocab
        self.vocab_size = len(vocab)
        self._char_to_id = {c: i for i, c in enumerate(vocab) if i >= len(self.SPECIALS)}

    @classmethod
    def default_vocab(cls) -> list[str]:
        """The specials, printable ASCII from space to ``'~'``, then newline."""
        return [*cls.SPECIALS, *(chr(c) for c in range(ord(" "), ord("~") + 1)), "\n"]

    def encode(self, text: str, *, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """Ids of ``text``, one per character; unknown characters give ``unk_id``.

        Raises:
            TypeError: ``text`` is not a string.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids = [self._char_to_id.get(c, self.unk_id) for c in text]
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        """Text of ``ids``; specials are dropped, or rendered as ``<name>`` when not skipped.

        Accepts any iterable of ints (a list, a 1-D tensor). Ids outside ``[0, vocab_size)`` —
        which a model whose embedding table is padded past the vocabulary can sample — decode
        as U+FFFD rather than raising: a sampled response must always reach the grader (which
        scores it 0), never crash the step.
        """
        out = []
        n_special = len(self.SPECIALS)
        for raw in ids:
            i = int(raw)
            if not 0 <= i < self.vocab_size:
                out.append(REPLACEMENT_CHAR)
                continue
            if i < n_special and skip_special:
                continue
            out.append(self.vocab[i])
        return "".join(out)

    def save(self, directory: str | Path) -> Path:
        """Writes ``fp8rl_tokenizer.json`` into ``directory`` (created if needed); returns its path."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / CHAR_TOKENIZER_FILE
        payload = {
            "type": "char",
            "version": 1,
            "vocab": self.vocab,
            "special_ids": {"pad": self.pad_id, "bos": self.bos_id, "eos": self.eos_id, "unk": self.unk_id},
        }
        path.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> CharTokenizer:
        """Reads a tokenizer written by :meth:`save`.

        Raises:
            FileNotFoundError: ``directory`` has no ``fp8rl_tokenizer.json``.
            ValueError: the file is not valid JSON, is not a char tokenizer, or its special ids
                disagree with this class (the message names the file).
        """
        path = Path(directory) / CHAR_TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"no {CHAR_TOKENIZER_FILE} in {directory}")
        try:
            payload = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(payload, dict) or payload.get("type") != "char":
            kind = payload.get("type") if isinstance(payload, dict) else type(payload).__name__
            raise ValueError(f"{path}: expected a tokenizer of type 'char', got {kind!r}")
        expected = {"pad": cls.pad_id, "bos": cls.bos_id, "eos": cls.eos_id, "unk": cls.unk_id}
        if payload.get("special_ids") != expected:
            raise ValueError(f"{path}: special_ids {payload.get('special_ids')!r} differ from {expected!r}")
        vocab = payload.get("vocab")
        if not isinstance(vocab, list):
            raise ValueError(f"{path}: 'vocab' must be a list")
        try:
            return cls(vocab)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


class HFTokenizer:
    """A local Hugging Face tokenizer behind the :class:`Tokenizer` protocol.

    ``eos_id`` comes from the tokenizer (required); ``pad_id`` falls back to ``eos_id`` when the
    tokenizer defines no pad token (common for causal LMs); ``bos_id`` is None when it has no BOS.
    ``encode`` adds BOS/EOS itself and never lets the tokenizer's post-processor add specials, so
    ``add_bos``/``add_eos`` mean the same thing for every tokenizer. ``eos_ids`` lists every id that
    ends generation: ``eos_id`` first, then the ``eos_token_id`` (int or list) of the directory's
    ``generation_config.json`` when there is one (chat models stop on their end-of-turn token).
    """

    def __init__(self, directory: str | Path):
        """Loads the tokenizer in ``directory`` (local files only, never a hub download).

        Raises:
            FileNotFoundError: ``directory`` does not exist.
            ValueError: the tokenizer defines no EOS token.
            OSError: transformers cannot read the directory as a tokenizer.
        """
        # Imported here so the character tokenizer (and everything that only uses it) does not
        # pay transformers' multi-second import.
        from transformers import AutoTokenizer

        directory = Path(directory)
        if not directory.is_dir():
            raise FileNotFoundError(f"tokenizer directory {directory} does not exist")
        self.hf_tokenizer: Any = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        eos = self.hf_tokenizer.eos_token_id
        if eos is None:
            raise ValueError(f"tokenizer in {directory} defines no eos_token; generation could never stop")
        self.eos_id: int = int(eos)
        pad = self.hf_tokenizer.pad_token_id
        self.pad_id: int = self.eos_id if pad is None else int(pad)
        bos = self.hf_tokenizer.bos_token_id
        self.bos_id: int | None = None if bos is None else int(bos)
        # len() counts added tokens too, which vocab_size (base vocabulary only) may not.
        self.vocab_size: int = len(self.hf_tokenizer)
        self.eos_ids: list[int] = [self.eos_id, *_generation_eos_ids(directory)]
        self.eos_ids = list(dict.fromkeys(self.eos_ids))  # de-duplicated, eos_id first

    def encode(self, text: str, *, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """Ids of ``text``; BOS is prepended only when asked and the tokenizer has one.

        Raises:
            TypeError: ``text`` is not a string.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids = list(self.hf_tokenizer.encode(text, add_special_tokens=False))
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        """Text of ``ids`` (a list or a 1-D tensor) as the HF tokenizer decodes it."""
        return self.hf_tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special)


def _generation_eos_ids(directory: Path) -> list[int]:
    """``eos_token_id`` of ``directory/generation_config.json`` as a list (empty when absent)."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise ValueError(f"{path}: not a JSON object ({e})") from None
    ids = [] if eos is None else [eos] if isinstance(eos, int) else eos
    if not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise ValueError(f"{path}: eos_token_id must be an int or a list of ints, got {eos!r}")
    return ids


def stop_token_ids(tok: Tokenizer) -> list[int]:
    """Every id that ends a generated sample: the tokenizer's ``eos_ids`` when it has them (an
    :class:`HFTokenizer` adds the checkpoint's generation config), else ``[eos_id]``."""
    return list(getattr(tok, "eos_ids", None) or [tok.eos_id])


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer stored in ``directory``.

    A :class:`CharTokenizer` when ``fp8rl_tokenizer.json`` is there, else an :class:`HFTokenizer`
    when any of ``tokenizer.json``, ``tokenizer_config.json``, ``tokenizer.model`` or
    ``vocab.json`` is.

    Raises:
        FileNotFoundError: the directory is missing or holds none of those files; the message
            lists what was looked for.
    """
    directory = Path(directory)
    if (directory / CHAR_TOKENIZER_FILE).is_file():
        return CharTokenizer.load(directory)
    if any((directory / name).is_file() for name in _HF_TOKENIZER_FILES):
        return HFTokenizer(directory)
    looked_for = ", ".join((CHAR_TOKENIZER_FILE, *_HF_TOKENIZER_FILES))
    state = "does not exist" if not directory.is_dir() else "holds none of them"
    raise FileNotFoundError(f"no tokenizer in {directory}: looked for {looked_for}; the directory {state}")


def chat_template_of(tok: Tokenizer) -> str | None:
    """The chat template (Jinja source) of ``tok``, or None when it has none (a :class:`CharTokenizer`)."""
    hf = getattr(tok, "hf_tokenizer", None)
    template = getattr(hf, "chat_template", None)
    return template if isinstance(template, str) and template else None


def render_chat_prompt(tok: Tokenizer, prompt: str | Sequence[tuple[str, str]],
                       system_prompt: str | None = None) -> str:
    """``prompt`` rendered by the tokenizer's own chat template with the assistant's generation prompt appended:
    text as one user turn, or a sequence of ``(role, content)`` messages as they are; ``system_prompt`` (when
    given) is a system turn put first unless the messages open with one of their own.

    The text equals ``AutoTokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``;
    it already holds the template's special tokens, so encode it with ``add_bos=False``.

    Raises:
        ValueError: ``tok`` has no chat template.
    """
    if chat_template_of(tok) is None:
        raise ValueError(f"tokenizer {type(tok).__name__} has no chat template")
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = [{"role": role, "content": content} for role, content in prompt]
    if system_prompt is not None and (not messages or messages[0]["role"] != "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return tok.hf_tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        messages, add_generation_prompt=True, tokenize=False)
