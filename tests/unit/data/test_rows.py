"""fp8rl.data.keys, .rows and .problem: dotted key paths, the known row shapes, text or chat-message prompts, and
the Problem record staying frozen, hashable and JSON-able."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from fp8rl.data import Problem
from fp8rl.data.keys import KeyPathError, lookup, parse_key
from fp8rl.data.rows import problem_from_row, shape_columns

VERL = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "6*7?"}],
        "reward_model": {"style": "rule", "ground_truth": 42}, "extra_info": {"answer": "6*7=42\n#### 42"}}


def test_dotted_paths_read_nested_mappings_and_list_items():
    assert lookup(VERL, "reward_model.ground_truth") == 42
    assert lookup(VERL, "prompt.1.content") == "6*7?"
    assert parse_key("extra_info.answer") == ("extra_info", "answer")
    for bad in ("", "a..b", ".a", "a.", " a", "x" * 300, None):
        with pytest.raises(KeyPathError):
            parse_key(bad)
    with pytest.raises(KeyPathError, match=r"missing key 'reward_model.truth': no 'truth' under 'reward_model' "
                                           r"\(keys there: \['ground_truth', 'style'\]\)"):
        lookup(VERL, "reward_model.truth")
    with pytest.raises(KeyPathError, match=r"'prompt' has 2 items, no item 5"):
        lookup(VERL, "prompt.5.content")
    with pytest.raises(KeyPathError, match=r"'reward_model.ground_truth' is a int, not a mapping with 'x'"):
        lookup(VERL, "reward_model.ground_truth.x")


@pytest.mark.parametrize(("row", "want"), [
    ({"prompt": "1+1=", "answer": 2}, Problem("1+1=", "2")),
    ({"problem": "p", "expected_answer": " 3 "}, Problem("p", "3")),
    (VERL, Problem((("system", "Be brief."), ("user", "6*7?")), "42")),
    ({"question": "q", "answer": "work\n#### 7"}, Problem("q", "work\n#### 7")),  # graders read the #### part
])
def test_the_known_shapes_are_detected(row, want):
    assert problem_from_row(row, "f:1") == want


def test_one_key_given_takes_the_other_from_the_known_shapes():
    assert problem_from_row(VERL, "f:1", answer_key="extra_info.answer").answer == "6*7=42\n#### 42"
    assert problem_from_row({"q": "x", "answer": 1}, "f:1", prompt_key="q") == Problem("x", "1")
    with pytest.raises(ValueError, match=r"^f:1: row has keys \['q'\]; none of \['answer', "):
        problem_from_row({"q": "x"}, "f:1", prompt_key="q")
    assert shape_columns("prompt.0.content", "reward_model.ground_truth") == {"prompt", "reward_model", "images"}
    assert "question" in shape_columns("prompt", None)


def test_chat_prompts_are_checked():
    for prompt, message in (([], "non-empty list"), ([{"role": "user"}], "needs 'role' and 'content'"),
                            ([{"role": "user", "content": [{"type": "video"}]}], "content part 0 is"),
                            ([{"role": "user", "content": " "}], "every message's content is empty"),
                            (["hi"], "expected {'role': ..., 'content': ...}")):
        with pytest.raises(ValueError, match=rf"^f:2: 'prompt' is a list but not chat messages: .*{message}"):
            problem_from_row({"prompt": prompt, "answer": "1"}, "f:2")


def test_a_problem_with_a_chat_prompt_is_frozen_hashable_and_json_able():
    p = Problem([{"role": "user", "content": "6*7?"}], "42")  # lists of mappings become a tuple of pairs
    assert p.prompt == (("user", "6*7?"),) and p.is_chat and not Problem("x", "1").is_chat
    assert p.messages() == [{"role": "user", "content": "6*7?"}]
    assert len({p, Problem((("user", "6*7?"),), "42")}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.answer = "1"  # type: ignore[misc]
    assert Problem(**json.loads(json.dumps(dataclasses.asdict(p)))) == p  # what a recorded problem reads back as
    with pytest.raises(ValueError, match="prompt is text"):
        Problem("x", "1").messages()


def test_a_rows_images_are_read_and_checked_against_its_placeholders():
    from fp8rl.data.rows import problem_from_row

    png = b"\x89PNG\r\n\x1a\n..."
    p = problem_from_row({"prompt": "Q: <image> and <image>?", "answer": 2, "images": [png, {"bytes": png}]}, "f:1")
    assert p.images == (png, png) and p.answer == "2"
    assert problem_from_row({"prompt": "Q: 1+1=", "answer": 2, "images": None}, "f:2").images == ()
    with pytest.raises(ValueError, match=r"f:3: .*1 <image> placeholder\(s\) in the prompt for 2 image\(s\)"):
        problem_from_row({"prompt": "<image>", "answer": 1, "images": [png, png]}, "f:3")
    with pytest.raises(ValueError, match=r"f:4: images\[0\] is a path \('pic.png'\); pictures by path are read under"):
        problem_from_row({"prompt": "<image>", "answer": 1, "images": ["pic.png"]}, "f:4")  # no data root here
    with pytest.raises(ValueError, match=r"f:4: images\[0\] must be an image file's bytes"):
        problem_from_row({"prompt": "<image>", "answer": 1, "images": [3]}, "f:4")
    with pytest.raises(ValueError, match="f:5: 'images' must be a list"):
        problem_from_row({"prompt": "<image>", "answer": 1, "images": png}, "f:5")
    chat = [{"role": "system", "content": "Count."},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}, {"type": "image"}]}]
    p = problem_from_row({"prompt": chat, "answer": 1, "images": [png, png]}, "f:6")  # image parts: placeholders
    assert p.prompt == (("system", "Count."), ("user", "<image>How many?<image>")) and len(p.images) == 2
    with pytest.raises(ValueError, match=r"f:7: Problem.images: 2 <image> placeholder\(s\) in the prompt for 1"):
        problem_from_row({"prompt": chat, "answer": 1, "images": [png]}, "f:7")
    with pytest.raises(ValueError, match=r"f:8: .*content part 0 is .*expected \{'type': 'text'"):
        problem_from_row({"prompt": [{"role": "user", "content": [{"type": "video"}]}], "answer": 1}, "f:8")


def test_pictures_by_path_are_read_under_the_data_root_and_nowhere_else(tmp_path):
    from fp8rl.data.dataset import read_problems
    from fp8rl.data.files import MAX_PICTURE_BYTES, DataRoot

    root = tmp_path / "data"
    (root / "pics").mkdir(parents=True)
    (root / "pics" / "a.png").write_bytes(b"A" * 10)
    (root / "pics" / "b.png").write_bytes(b"B" * 10)
    (tmp_path / "secret.png").write_bytes(b"S" * 10)
    (root / "pics" / "big.png").write_bytes(b"")
    os.truncate(root / "pics" / "big.png", MAX_PICTURE_BYTES + 1)

    def read(*images, prompt="<image> <image>"):
        (root / "rows.jsonl").write_text(json.dumps({"prompt": prompt, "answer": 1, "images": list(images)}) + "\n")
        return read_problems(DataRoot(root), "rows.jsonl")

    assert read("pics/a.png", {"path": "pics/b.png", "bytes": None})[0].images == (b"A" * 10, b"B" * 10)
    outside = "outside the data root"
    for bad, why in (("../secret.png", outside), (str(tmp_path / "secret.png"), outside),
                     ("pics/none.png", "does not exist under the data root"), ("pics", "is a directory"),
                     ("pics/big.png", f"the limit is {MAX_PICTURE_BYTES} bytes")):
        with pytest.raises(ValueError, match=rf"rows.jsonl:1: images\[1\].*({why})"):
            read("pics/a.png", bad)
