"""Tests for fp8rl.data.jsonl: both row shapes, explicit keys, limits, and line-numbered errors."""

from __future__ import annotations

import json

import pytest

from fp8rl.data import Problem, load_jsonl, wrap_math_prompt
from fp8rl.data.grading import extract_boxed


def _write(tmp_path, lines, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_own_shape_with_blank_lines_and_coercion(tmp_path):
    path = _write(
        tmp_path,
        [
            json.dumps({"prompt": "Q: 1+1=\nA: ", "answer": 2}),
            "",
            "   ",
            json.dumps({"prompt": "half?", "answer": 0.5, "extra": [1]}),
            json.dumps({"prompt": "name?", "answer": "  Ann "}),
        ],
    )
    assert load_jsonl(path) == [
        Problem("Q: 1+1=\nA: ", "2"),
        Problem("half?", "0.5"),
        Problem("name?", "Ann"),
    ]


def test_openmathinstruct_shape_is_detected(tmp_path):
    row = {"problem": "What is 6*7?", "generated_solution": "...", "expected_answer": "42"}
    path = _write(tmp_path, [json.dumps(row)] * 3)
    problems = load_jsonl(str(path))
    assert problems == [Problem("What is 6*7?", "42")] * 3


def test_explicit_keys_and_limit(tmp_path):
    path = _write(tmp_path, [json.dumps({"q": f"q{i}", "a": i}) for i in range(10)] + ["{broken"])
    # The broken last line is never read because the limit stops first.
    got = load_jsonl(path, prompt_key="q", answer_key="a", limit=4)
    assert got == [Problem(f"q{i}", str(i)) for i in range(4)]
    assert load_jsonl(path, prompt_key="q", answer_key="a", limit=0) == []
    with pytest.raises(ValueError, match=r"data\.jsonl:11: invalid JSON"):
        load_jsonl(path, prompt_key="q", answer_key="a")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"prompt": "x"}), "row has keys"),
        (json.dumps({"problem": "x", "answer": "1"}), "row has keys"),
        (json.dumps({"prompt": "", "answer": "1"}), "non-empty string"),
        (json.dumps({"prompt": 5, "answer": "1"}), "non-empty string"),
        (json.dumps({"prompt": "x", "answer": None}), "string or number"),
        (json.dumps({"prompt": "x", "answer": True}), "string or number"),
        (json.dumps({"prompt": "x", "answer": [1]}), "string or number"),
        (json.dumps({"prompt": "x", "answer": "  "}), "is empty"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, line, message):
    good = json.dumps({"prompt": "ok", "answer": "1"})
    path = _write(tmp_path, [good, "", line], name="bad.jsonl")
    with pytest.raises(ValueError, match=message) as info:
        load_jsonl(path)
    assert f"{path}:3:" in str(info.value)


def test_explicit_key_missing_is_reported(tmp_path):
    path = _write(tmp_path, [json.dumps({"q": "x", "a": 1}), json.dumps({"q": "y"})])
    with pytest.raises(ValueError, match=r":2: missing key 'a'"):
        load_jsonl(path, prompt_key="q", answer_key="a")


def test_bad_utf8_names_line(tmp_path):
    path = tmp_path / "enc.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": 1}\n{"prompt": "\xff", "answer": 1}\n')
    with pytest.raises(ValueError, match=r"enc\.jsonl:2: not valid UTF-8"):
        load_jsonl(path)


@pytest.mark.parametrize(
    "kwargs",
    [{"prompt_key": "q"}, {"answer_key": "a"}, {"limit": -1}, {"limit": 1.5}, {"limit": True}],
)
def test_bad_arguments(tmp_path, kwargs):
    path = _write(tmp_path, [json.dumps({"prompt": "x", "answer": 1})])
    with pytest.raises(ValueError):
        load_jsonl(path, **kwargs)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_jsonl(tmp_path / "nope.jsonl")


def test_wrap_math_prompt_asks_for_boxed_answer():
    prompt = wrap_math_prompt("  What is 6*7?  ")
    assert "What is 6*7?" in prompt
    assert "  What is" not in prompt
    assert "\\boxed{}" in prompt
    assert prompt.rstrip().endswith("Solution:")
    # The example in the instructions must itself be gradeable.
    assert extract_boxed(prompt) == "42"
    for bad in ("", "   ", None, 3):
        with pytest.raises(ValueError):
            wrap_math_prompt(bad)
