"""fp8rl.data.dataset: a user's own data — JSON lines, Parquet, Arrow (save_to_disk) directories — read locally,
confined and bounded, with nested keys, chat-message prompts and errors naming the file and the row."""

from __future__ import annotations

import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fp8rl.data import DataFileError, DataRoot, Problem, check_data_path, detect_format, load_problems, read_problems
from fp8rl.data.dataset import MAX_EXPANSION


def verl_rows(n: int) -> list[dict]:
    """Rows shaped like verl's preprocessed GSM8K: a chat prompt, the answer under reward_model.ground_truth."""
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"What is {i} + 1? Let's think step by step."}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
             "extra_info": {"split": "train", "index": i, "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}}
            for i in range(n)]


def chat(i: int) -> tuple:
    return (("user", f"What is {i} + 1? Let's think step by step."),)


def write_parquet(path, rows, **kwargs):
    pq.write_table(pa.Table.from_pylist(rows), path, **kwargs)
    return path


def save_to_disk(path, rows, monkeypatch, **kwargs):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # the tests' own writer stays offline too
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset.from_list(rows).save_to_disk(str(path), **kwargs)
    return path


# -- formats ---------------------------------------------------------------------------------------------------

def test_parquet_in_verls_shape_is_detected_and_nested_keys_read_it(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", verl_rows(5))
    assert detect_format(path) == "parquet"
    assert load_problems(path) == [Problem(chat(i), str(i + 1)) for i in range(5)]
    # an explicit nested key: GSM8K's worked answer kept by verl in extra_info
    got = load_problems(path, answer_key="extra_info.answer", limit=2)
    assert [p.answer for p in got] == ["0 + 1 = 1\n#### 1", "1 + 1 = 2\n#### 2"]
    assert got[0].is_chat and got[0].messages() == [{"role": "user", "content": chat(0)[0][1]}]
    # a list index inside a path: the first message's text as a text prompt
    got = load_problems(path, prompt_key="prompt.0.content", answer_key="reward_model.ground_truth", limit=1)
    assert got == [Problem(chat(0)[0][1], "1")]


def test_arrow_directory_written_by_save_to_disk(tmp_path, monkeypatch):
    path = save_to_disk(tmp_path / "gsm8k-train", verl_rows(7), monkeypatch, num_shards=2)
    assert sorted(p.name for p in path.iterdir()) == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow",
                                                      "dataset_info.json", "state.json"]
    assert detect_format(path) == "arrow"
    assert load_problems(path) == [Problem(chat(i), str(i + 1)) for i in range(7)]  # shards in state.json order
    assert [p.answer for p in load_problems(path, answer_key="extra_info.index", limit=3)] == ["0", "1", "2"]


def test_a_single_arrow_file_stream_or_file_format(tmp_path):
    table = pa.Table.from_pylist([{"prompt": f"{i} + 1 =", "answer": i + 1} for i in range(3)])
    for name, new in (("stream.arrow", pa.ipc.new_stream), ("file.arrow", pa.ipc.new_file)):
        with pa.OSFile(str(tmp_path / name), "wb") as sink, new(sink, table.schema) as writer:
            writer.write_table(table)
        assert load_problems(tmp_path / name) == [Problem(f"{i} + 1 =", str(i + 1)) for i in range(3)]


def test_json_lines_by_suffix_and_gsm8k_shape(tmp_path):
    rows = [{"question": "Ann has 3 pens and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"}]
    for name in ("a.jsonl", "a.json"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert detect_format(tmp_path / name) == "jsonl"
        assert load_problems(tmp_path / name) == [Problem(rows[0]["question"], rows[0]["answer"])]
    (tmp_path / "array.json").write_text(json.dumps(rows))
    with pytest.raises(ValueError, match=r"array.json: holds one JSON array.*jq -c"):
        load_problems(tmp_path / "array.json")


def test_formats_that_cannot_be_told_are_refused_with_what_is_understood(tmp_path, monkeypatch):
    (tmp_path / "data.csv").write_text("prompt,answer\n")
    with pytest.raises(DataFileError, match=r"data.csv' from its name: use .jsonl or .json"):
        detect_format(tmp_path / "data.csv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataFileError, match="is a directory but no Arrow dataset"):
        detect_format(tmp_path / "empty")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    datasets.DatasetDict({"train": datasets.Dataset.from_list(verl_rows(2)),
                          "test": datasets.Dataset.from_list(verl_rows(1))}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataFileError, match=r"is a DatasetDict saved with save_to_disk \(splits: test, train\); "
                                            r"name one split's directory, e.g. .*dd/test"):
        detect_format(tmp_path / "dd")
    assert len(load_problems(tmp_path / "dd" / "train")) == 2


# -- bad rows and columns ----------------------------------------------------------------------------------------

TEXT = {"prompt": "1 + 1 =", "reward_model": {"style": "rule", "ground_truth": "2"}}
CHAT = {"prompt": [{"role": "user", "content": "1 + 1 ="}], "reward_model": {"style": "rule", "ground_truth": "2"}}


@pytest.mark.parametrize(("good", "bad", "message"), [
    (CHAT, CHAT | {"prompt": [{"role": "user", "content": None}]}, r"'prompt' is a list but not chat messages: "
                                                                    r"message 0: 'content' must be a string"),
    (CHAT, CHAT | {"prompt": [{"role": "", "content": "x"}]}, r"message 0: 'role' must be a non-empty string"),
    (TEXT, TEXT | {"prompt": "  "}, r"'prompt' must be a non-empty string or a list of chat messages"),
    (TEXT, TEXT | {"reward_model": {"style": "rule", "ground_truth": None}},
     r"'reward_model.ground_truth' must be a string or number, got None"),
])
def test_a_bad_row_names_its_file_and_row(tmp_path, good, bad, message):
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in (good, good, bad)))
    parquet = write_parquet(tmp_path / "bad.parquet", [good, good, bad])
    # JSON lines: 1-based line numbers; Parquet and Arrow: 0-based rows, as dataset[i]
    for path, where in ((jsonl, f"{jsonl}:3: "), (parquet, f"{parquet}: row 2: ")):
        with pytest.raises(ValueError, match=message) as info:
            load_problems(path)
        assert str(info.value).startswith(where), str(info.value)


def test_a_named_column_that_is_not_there_is_reported_with_the_columns(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", verl_rows(2))
    with pytest.raises(ValueError, match=r"row 0: no column 'solution' for key 'solution.text' \(columns: "
                                         r"\['ability', 'data_source', 'extra_info', 'prompt', 'reward_model'\]"):
        load_problems(path, answer_key="solution.text")
    with pytest.raises(ValueError, match=r"missing key 'reward_model.truth': no 'truth' under 'reward_model' "
                                         r"\(keys there: \['ground_truth', 'style'\]\)"):
        load_problems(path, answer_key="reward_model.truth")


def test_a_corrupt_parquet_file_is_a_value_error_naming_it(tmp_path):
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match=r"junk.parquet: not a readable Parquet file"):
        load_problems(tmp_path / "junk.parquet")


# -- limits and confinement --------------------------------------------------------------------------------------

def test_rows_over_the_limit_are_refused_not_cut(tmp_path, monkeypatch):
    rows = [{"prompt": f"{i} + 1 =", "answer": str(i + 1)} for i in range(12)]
    pq_path = write_parquet(tmp_path / "many.parquet", rows)
    with pytest.raises(DataFileError, match=r"many.parquet holds 12 rows; the limit is 10 rows"):
        load_problems(pq_path, max_rows=10)  # from the footer, before any row is decoded
    arrow = save_to_disk(tmp_path / "many", rows, monkeypatch)
    with pytest.raises(DataFileError, match=r"holds more than 10 rows \(the limit\)"):
        load_problems(arrow, max_rows=10)
    assert len(load_problems(arrow, max_rows=12)) == 12


def test_a_small_file_that_decodes_to_far_more_is_refused(tmp_path):
    big = "x" * 4000  # one dictionary entry repeated: a few KB of Parquet, megabytes once decoded
    path = write_parquet(tmp_path / "bomb.parquet", [{"prompt": big, "answer": "1"}] * 2000, compression="zstd")
    size = path.stat().st_size
    assert size * MAX_EXPANSION < 2000 * len(big)
    with pytest.raises(DataFileError, match=rf"bomb.parquet decodes to more than {size * MAX_EXPANSION} bytes"):
        load_problems(path, max_bytes=size)


def test_a_dataset_directory_is_confined_and_bounded(tmp_path, monkeypatch):
    root = DataRoot(tmp_path / "root", max_bytes=1 << 20)
    root.root.mkdir()
    ds = save_to_disk(root.root / "ds", verl_rows(3), monkeypatch)
    assert check_data_path(root, "ds") == "arrow"
    assert len(read_problems(root, "ds")) == 3
    with pytest.raises(DataFileError, match="is a directory, not a regular file"):
        check_data_path(root, "ds", fmt="jsonl")  # task jsonl keeps refusing directories

    # a shard swapped for a link out of the directory: refused at submit and when read
    outside = tmp_path / "outside.arrow"
    os.replace(ds / "data-00000-of-00001.arrow", outside)
    os.symlink(outside, ds / "data-00000-of-00001.arrow")
    for call in (lambda: check_data_path(root, "ds"), lambda: read_problems(root, "ds")):
        with pytest.raises(DataFileError, match=r"data-00000-of-00001.arrow' resolves to .*outside its dataset "
                                                r"directory"):
            call()
    os.unlink(ds / "data-00000-of-00001.arrow")
    os.replace(outside, ds / "data-00000-of-00001.arrow")

    # a state.json naming a file elsewhere
    state = json.loads((ds / "state.json").read_text())
    good_state = json.dumps(state)
    state["_data_files"] = [{"filename": "../outside.arrow"}]
    (ds / "state.json").write_text(json.dumps(state))
    with pytest.raises(DataFileError, match=r"'../outside.arrow' in .* is not a plain file name"):
        read_problems(root, "ds")
    (ds / "state.json").write_text(good_state)

    # a subdirectory, a FIFO, or too many bytes together
    (ds / "sub").mkdir()
    with pytest.raises(DataFileError, match=r"sub' is a directory, not a regular file"):
        check_data_path(root, "ds")
    (ds / "sub").rmdir()
    os.mkfifo(ds / "fifo")
    with pytest.raises(DataFileError, match=r"fifo' is a FIFO, not a regular file"):
        check_data_path(root, "ds")
    os.unlink(ds / "fifo")
    total = sum(p.stat().st_size for p in ds.iterdir())
    small = DataRoot(root.root, max_bytes=total - 1)
    with pytest.raises(DataFileError, match=rf"hold more than {total - 1} bytes"):
        check_data_path(small, "ds")
    shards = save_to_disk(root.root / "shards", verl_rows(4), monkeypatch, num_shards=2)
    sizes = [(shards / f"data-0000{i}-of-00002.arrow").stat().st_size for i in range(2)]
    with pytest.raises(DataFileError, match=rf"the Arrow files of .*shards' hold more than {max(sizes)} bytes"):
        read_problems(DataRoot(root.root, max_bytes=max(sizes)), "shards")  # each shard fits, the two do not

    # the directory itself must be under the root (a link to one elsewhere is refused), and the key is named
    shutil.copytree(ds, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", root.root / "link-out")
    for path in ("link-out", "../elsewhere"):
        with pytest.raises(DataFileError, match=rf"^data.validation_path: '{path}' resolves to .*elsewhere', "
                                                rf"outside the data root"):
            check_data_path(root, path, "data.validation_path")


def test_a_parquet_row_of_no_known_shape_names_the_files_own_columns(tmp_path):
    """The columnar reader loads only the known shapes' columns; the message still lists the file's fields."""
    path = write_parquet(tmp_path / "alpaca.parquet", [{"instruction": "2+2?", "output": "4"}])
    with pytest.raises(ValueError, match=r"alpaca.parquet: row 0: row has keys \['instruction', 'output'\]"):
        load_problems(path)
