"""fp8rl.data.files: data files confined to a root, regular files only (never blocking), read within limits."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from fp8rl.config import parse_job_config
from fp8rl.controller.plan import check_data, problem_source
from fp8rl.data import DataFileError, DataRoot, load_jsonl
from fp8rl.data.files import open_regular_file, read_lines


def rows(n: int) -> str:
    return "".join(json.dumps({"prompt": f"{i} + 1 =", "answer": str(i + 1)}) + "\n" for i in range(n))


@pytest.fixture
def root(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "ok.jsonl").write_text(rows(5))
    return DataRoot(data, max_bytes=10_000, max_rows=10)


def test_a_regular_file_under_the_root_loads(root):
    assert root.check("ok.jsonl") == (root.root / "ok.jsonl").resolve()
    job = parse_job_config({"data": {"task": "jsonl", "path": "ok.jsonl"}, "grpo": {"num_prompts_per_step": 2}})
    check_data(job, root)
    assert [p.answer for p in problem_source(job, root)(1)] == ["3", "4"]


@pytest.mark.parametrize("path", ["../outside.jsonl", "/etc/passwd", "sub/../../outside.jsonl"])
def test_paths_outside_the_root_are_refused(root, path):
    (root.root.parent / "outside.jsonl").write_text(rows(1))
    with pytest.raises(DataFileError, match="outside the data root"):
        root.check(path)


def test_a_symlink_out_of_the_root_is_refused_and_one_inside_is_followed(root):
    (root.root.parent / "secret.jsonl").write_text(rows(1))
    os.symlink(root.root.parent / "secret.jsonl", root.root / "link-out.jsonl")
    os.symlink(root.root / "ok.jsonl", root.root / "link-in.jsonl")
    with pytest.raises(DataFileError, match="resolves to .*secret.jsonl.*outside the data root"):
        root.check("link-out.jsonl")
    assert root.check("link-in.jsonl").name == "ok.jsonl"


def test_devices_fifos_and_directories_are_refused_without_blocking(root, tmp_path):
    os.mkfifo(root.root / "fifo.jsonl")
    (root.root / "dir.jsonl").mkdir()
    t0 = time.monotonic()
    with pytest.raises(DataFileError, match="is a FIFO, not a regular file"):
        root.check("fifo.jsonl")  # opened O_NONBLOCK: no writer, and still no wait
    with pytest.raises(DataFileError, match="is a directory"):
        root.check("dir.jsonl")
    with pytest.raises(DataFileError, match="is a character device"):
        DataRoot("/dev").check("zero")
    with pytest.raises(DataFileError, match="is a FIFO"):
        load_jsonl(root.root / "fifo.jsonl")  # every reader checks, not only DataRoot
    assert time.monotonic() - t0 < 2
    with pytest.raises(DataFileError, match="does not exist under the data root"):
        root.check("missing.jsonl")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(root.root / "sock.jsonl"))
    with sock, pytest.raises(DataFileError, match="sock.jsonl' cannot be opened"):
        root.check("sock.jsonl")


def test_byte_row_and_line_limits(root):
    (root.root / "big.jsonl").write_text(rows(400))
    with pytest.raises(DataFileError, match=r"big.jsonl' is \d+ bytes; the limit is 10000 bytes"):
        root.check("big.jsonl")
    (root.root / "many.jsonl").write_text(rows(11))
    with pytest.raises(DataFileError, match="holds more than 10 problems"):
        load_jsonl(root.resolve("many.jsonl"), max_rows=root.max_rows)
    assert len(load_jsonl(root.resolve("many.jsonl"), limit=3, max_rows=root.max_rows)) == 3
    (root.root / "long.jsonl").write_bytes(b"x" * 3000)
    with pytest.raises(DataFileError, match="longer than 100 bytes"), open_regular_file(root.root / "long.jsonl") as f:
        list(read_lines(f, "long.jsonl", max_line_bytes=100))
    with pytest.raises(ValueError, match="max_rows must be >= 1"):
        DataRoot(root.root, max_rows=0)
