"""services.trainer.checkpoints: names, never paths; everything inside the directory; bounded retention."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.trainer.checkpoints import (
    CheckpointDir,
    CheckpointLimitError,
    CheckpointNameError,
    check_name,
    resolve_checkpoint,
)


class FakeTrainer:
    """Writes a small file where a real backend writes its checkpoint."""

    def __init__(self) -> None:
        self.version = 0

    def save_checkpoint(self, path: str) -> None:
        Path(path).write_text(f"v{self.version}")


@pytest.mark.parametrize("name", ["best", "run-1.step_30", "A", "x" * 64, "v1.0"])
def test_plain_names_pass(name):
    assert check_name(name) == name


@pytest.mark.parametrize(("name", "rule"), [
    ("../x", "path separator"), ("/abs", "path separator"), ("a/b", "path separator"), ("a\\b", "path separator"),
    ("..", "'..'"), ("a..b", "'..'"), (".hidden", "starting with a letter or digit"),
    ("-rf", "starting with a letter or digit"), ("sp ace", "letters, digits"), ("x" * 65, "at most 64"),
    ("trainer-v000003", "reserved for the automatic"), ("nul\0", "path separator")])
def test_bad_names_name_the_rule(name, rule):
    with pytest.raises(CheckpointNameError, match=rule.replace(".", r"\.")):
        check_name(name)


def test_every_save_lands_in_the_directory_and_old_automatic_ones_are_pruned(tmp_path):
    ck, tr = CheckpointDir(tmp_path / "ck", keep=2, max_named=1), FakeTrainer()
    for v in range(1, 5):
        tr.version = v
        assert ck.save(tr) == f"trainer-v{v:06d}.pt"
    assert [f.name for f in ck.automatic()] == ["trainer-v000003.pt", "trainer-v000004.pt"]
    assert ck.save(tr, "best") == "best.pt" and ck.save(tr, "best") == "best.pt"  # a name is replaced
    with pytest.raises(CheckpointLimitError, match="--max-named-checkpoints 1"):
        ck.save(tr, "second")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["best.pt", "ck", "trainer-v000003.pt",
                                                           "trainer-v000004.pt"]
    assert resolve_checkpoint(str(tmp_path / "ck")).name == "trainer-v000004.pt"  # names never win a resume


def test_a_refused_name_writes_nothing(tmp_path):
    ck = CheckpointDir(tmp_path / "ck")
    for bad in ("../x", "/abs", "a/b"):
        with pytest.raises(CheckpointNameError):
            ck.save(FakeTrainer(), bad)
    assert list(tmp_path.iterdir()) == []


def test_limits_are_validated(tmp_path):
    with pytest.raises(ValueError, match="--keep-checkpoints must be >= 0"):
        CheckpointDir(tmp_path, keep=-1)
    ck, tr = CheckpointDir(tmp_path, keep=0, max_named=0), FakeTrainer()
    for v in range(3):
        tr.version = v
        ck.save(tr)
    assert len(ck.automatic()) == 3  # keep=0: every one kept
    with pytest.raises(CheckpointLimitError):
        ck.save(tr, "named")
