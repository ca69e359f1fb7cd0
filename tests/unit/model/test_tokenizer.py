"""Tests for fp8rl.model.tokenizer: the char vocabulary, save/load, the HF wrapper, the loader.

The HF tokenizer is a tiny WordLevel model trained here and saved to tmp_path: no network.
"""

from __future__ import annotations

import json

import pytest
import torch

from fp8rl.data import format_sft_example, generate_problems
from fp8rl.model.tokenizer import (
    CHAR_TOKENIZER_FILE,
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)

_SPECIAL_IDS = {"pad": 0, "bos": 1, "eos": 2, "unk": 3}

# --- CharTokenizer -------------------------------------------------------------------------------


def test_char_vocabulary_layout():
    tok = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert tok.vocab_size == 100
    assert tok.encode(" ", add_bos=False) == [4]
    assert tok.encode("~", add_bos=False) == [98]
    assert tok.encode("\n", add_bos=False) == [99]
    assert tok.encode("A", add_bos=False) == [4 + ord("A") - ord(" ")]
    assert isinstance(tok, Tokenizer)


def test_char_encode_bos_eos_and_roundtrip():
    tok = CharTokenizer()
    for p in generate_problems(20, seed=0):
        text = format_sft_example(p)
        ids = tok.encode(text, add_eos=True)
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        assert len(ids) == len(text) + 2
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode("ab", add_bos=False) == tok.encode("ab")[1:]
    assert tok.encode("") == [tok.bos_id]


def test_char_unknown_characters_and_special_rendering():
    tok = CharTokenizer()
    ids = tok.encode("a\té", add_bos=False)
    assert ids[1:] == [tok.unk_id, tok.unk_id]
    assert tok.decode(ids) == "a"
    assert tok.decode(tok.encode("hi", add_eos=True), skip_special=False) == "<bos>hi<eos>"
    assert tok.decode(torch.tensor(tok.encode("hi"))) == "hi"


@pytest.mark.parametrize("bad", [[-1], [100], [5, 1000]])
def test_char_decode_renders_out_of_range_ids_as_replacement(bad):
    text = CharTokenizer().decode(bad)
    assert text.count("\ufffd") == sum(1 for i in bad if not 0 <= i < 100)


def test_char_encode_rejects_non_text():
    with pytest.raises(TypeError):
        CharTokenizer().encode(b"bytes")


@pytest.mark.parametrize(
    "vocab",
    [["a", "b"], ["<pad>", "<bos>", "<eos>", "<unk>", "ab"], ["<pad>", "<bos>", "<eos>", "<unk>", "a", "a"]],
)
def test_char_rejects_bad_vocab(vocab):
    with pytest.raises(ValueError, match="CharTokenizer vocab"):
        CharTokenizer(vocab)


def test_char_save_load_roundtrip(tmp_path):
    custom = CharTokenizer([*CharTokenizer.SPECIALS, "0", "1", "+", "="])
    path = custom.save(tmp_path / "tok")
    assert path.name == CHAR_TOKENIZER_FILE
    payload = json.loads(path.read_text())
    assert payload["type"] == "char"
    assert payload["special_ids"] == _SPECIAL_IDS
    loaded = load_tokenizer(tmp_path / "tok")
    assert isinstance(loaded, CharTokenizer)
    assert loaded.vocab == custom.vocab and loaded.vocab_size == 8
    assert loaded.encode("10+1=2") == [1, 5, 4, 6, 5, 7, 3]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{broken", "not valid JSON"),
        (json.dumps({"type": "bpe"}), "type 'char'"),
        (json.dumps([1]), "type 'char'"),
        (json.dumps({"type": "char", "vocab": [], "special_ids": {"pad": 1}}), "special_ids"),
        (json.dumps({"type": "char", "vocab": "abc", "special_ids": _SPECIAL_IDS}), "must be a list"),
        (json.dumps({"type": "char", "vocab": ["x"], "special_ids": _SPECIAL_IDS}), "must start with"),
    ],
)
def test_char_load_rejects_bad_files(tmp_path, content, message):
    (tmp_path / CHAR_TOKENIZER_FILE).write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        CharTokenizer.load(tmp_path)
    assert CHAR_TOKENIZER_FILE in str(info.value)


# --- HFTokenizer -----------------------------------------------------------------------------------


def _save_hf_tokenizer(directory, *, pad: bool, bos: bool = True):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[UNK]", "[EOS]"] + (["[BOS]"] if bos else []) + (["[PAD]"] if pad else [])
    raw = RawTokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(
        ["Ann has 3 pens", "Bob gets 4 more", "How many pens ?"],
        trainer=trainers.WordLevelTrainer(special_tokens=specials),
    )
    kwargs = {"unk_token": "[UNK]", "eos_token": "[EOS]"}
    if bos:
        kwargs["bos_token"] = "[BOS]"
    if pad:
        kwargs["pad_token"] = "[PAD]"
    PreTrainedTokenizerFast(tokenizer_object=raw, **kwargs).save_pretrained(str(directory))
    return raw


def test_hf_tokenizer_protocol_and_specials(tmp_path):
    raw = _save_hf_tokenizer(tmp_path, pad=True)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert tok.eos_id == raw.token_to_id("[EOS]")
    assert tok.bos_id == raw.token_to_id("[BOS]")
    assert tok.pad_id == raw.token_to_id("[PAD]") != tok.eos_id
    assert tok.vocab_size == raw.get_vocab_size()

    body = [raw.token_to_id(w) for w in ("Ann", "has", "3", "pens")]
    assert tok.encode("Ann has 3 pens", add_bos=False) == body
    assert tok.encode("Ann has 3 pens") == [tok.bos_id, *body]
    assert tok.encode("Ann has 3 pens", add_eos=True)[-1] == tok.eos_id
    assert tok.encode("zebra", add_bos=False) == [raw.token_to_id("[UNK]")]
    ids = tok.encode("Ann has 3 pens", add_eos=True)
    assert tok.decode(ids) == "Ann has 3 pens"
    assert "[EOS]" in tok.decode(ids, skip_special=False)
    assert tok.decode(torch.tensor(ids)) == "Ann has 3 pens"
    with pytest.raises(TypeError):
        tok.encode(None)


def test_hf_pad_falls_back_to_eos_and_bos_may_be_absent(tmp_path):
    _save_hf_tokenizer(tmp_path, pad=False, bos=False)
    tok = HFTokenizer(tmp_path)
    assert tok.pad_id == tok.eos_id
    assert tok.bos_id is None
    assert tok.encode("Ann") == tok.encode("Ann", add_bos=False)


def test_hf_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        HFTokenizer(tmp_path / "absent")


# --- load_tokenizer ------------------------------------------------------------------------------


def test_load_tokenizer_prefers_char_file(tmp_path):
    _save_hf_tokenizer(tmp_path, pad=True)
    CharTokenizer().save(tmp_path)
    assert isinstance(load_tokenizer(tmp_path), CharTokenizer)


@pytest.mark.parametrize("make_dir", [True, False])
def test_load_tokenizer_empty_or_missing_directory(tmp_path, make_dir):
    target = tmp_path / "model"
    if make_dir:
        target.mkdir()
        (target / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError) as info:
        load_tokenizer(target)
    message = str(info.value)
    assert CHAR_TOKENIZER_FILE in message and "tokenizer.json" in message
    assert ("holds none" in message) == make_dir
