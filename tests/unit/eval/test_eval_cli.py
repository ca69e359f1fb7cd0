"""``python -m fp8rl.eval`` (and ``fp8rl eval``): a preset, a trainer checkpoint and its HF export scored on a user's
Parquet file. The checkpoint and its export hold the same weights, so they must score identically (same engine,
same seeds); the preset the checkpoint started from scores through the same command. Bad input exits 2 naming
it."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fp8rl.config import JobConfig
from fp8rl.data import ArithDataset
from fp8rl.eval.__main__ import main
from fp8rl.export import export_checkpoint
from fp8rl.sdk.cli import main as cli_main
from tests.unit.export.conftest import tiny_arith  # noqa: F401 - the session fixture: tiny-arith after one step

KEYS = {"model", "data", "recipe", "problems", "dropped_prompts", "k", "temperature", "max_new_tokens",
        "val_accuracy", "val/pass@1", "val/pass@2", "val/mean@2", "val_weight_version", "seconds"}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    problems = ArithDataset(JobConfig().arith_config(), seed=3).eval_set(12)
    path = tmp_path_factory.mktemp("eval") / "val.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": p.prompt, "reward_model": {"ground_truth": p.answer}}
                                         for p in problems]), path)
    return path


def _score(tmp_path, model, data_file, *extra) -> dict:
    out = tmp_path / f"r{len(list(tmp_path.iterdir()))}.json"
    args = [str(model), "--data", str(data_file), "--k", "2", "--answer-key", "reward_model.ground_truth",
            "--limit", "12", "--out", str(out), "--no-progress", *extra]
    assert main(args) == 0
    return json.loads(out.read_text())


def test_a_checkpoint_and_its_hf_export_score_the_same(tmp_path, data_file,
                                                                                tiny_arith):  # noqa: F811
    exported = export_checkpoint(tiny_arith.ckpt, tmp_path / "hf", progress=False).out
    ck, hf = _score(tmp_path, tiny_arith.ckpt, data_file), _score(tmp_path, exported, data_file)
    start = _score(tmp_path, "tiny-arith", data_file)
    assert set(ck) == KEYS and ck["problems"] == 12 and ck["recipe"] == "fp8_e2e"
    same = ("val_accuracy", "val/pass@1", "val/pass@2", "val/mean@2")
    assert {k: ck[k] for k in same} == {k: hf[k] for k in same}
    assert 0 <= ck["val/pass@1"] <= ck["val/pass@2"] <= 1
    assert start["model"] == "tiny-arith" and set(start) == KEYS


def test_the_cli_word_runs_it_and_bad_input_exits_2(tmp_path, data_file, capsys):
    assert cli_main(["eval", "tiny-arith", "--data", str(data_file), "--k", "0", "--limit", "4",
                     "--answer-key", "reward_model.ground_truth", "--no-progress"]) == 0
    assert "val_accuracy" in capsys.readouterr().out
    assert main(["tiny-arith", "--data", str(tmp_path / "missing.parquet"), "--no-progress"]) == 2
    assert main([str(tmp_path / "no-such-checkpoint.pt"), "--data", str(data_file), "--no-progress"]) == 2
    assert main(["tiny-arith", "--data", str(data_file), "--k", "-1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "missing.parquet" in err and "no-such-checkpoint.pt" in err and "eval.k" in err
