"""Bad input is refused with one message naming the path or key, and nothing is lost: ``--out`` is untouched and
no temporary directory is left beside it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from fp8rl.export import ExportError, export_checkpoint, load_checkpoint_policy
from fp8rl.export.__main__ import main as export_main
from fp8rl.model import CausalLM

from .conftest import model_dir, moe_config


def leftovers(parent) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_missing_truncated_and_foreign_files(tiny_arith, tmp_path, capsys):
    with pytest.raises(ExportError, match="nothing.pt does not exist"):
        export_checkpoint(tmp_path / "nothing.pt", tmp_path / "out", progress=False)
    data = tiny_arith.ckpt.read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ExportError, match=r"cut.pt is not a readable trainer checkpoint \(truncated"):
        export_checkpoint(tmp_path / "cut.pt", tmp_path / "out", progress=False)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(ExportError, match="junk.pt is not a readable trainer checkpoint"):
        export_checkpoint(tmp_path / "junk.pt", tmp_path / "out", progress=False)
    torch.save({"format": "someone-else/3", "model": {}}, tmp_path / "other.pt")
    with pytest.raises(ExportError, match="format 'someone-else/3', expected 'fp8rl-torch-trainer/1'"):
        export_checkpoint(tmp_path / "other.pt", tmp_path / "out", progress=False)
    (tmp_path / "plain").mkdir()
    with pytest.raises(ExportError, match="neither fp8rl.json .* nor config.json"):
        export_checkpoint(tmp_path / "plain", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
    # the command line: exit 2, the message on stderr
    assert export_main([str(tmp_path / "cut.pt"), "--out", str(tmp_path / "out")]) == 2
    assert "error: " in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the trainer's one-rank DCP save says so
def test_dcp_with_a_truncated_or_missing_shard(tiny_arith, tmp_path):
    ck = tmp_path / "trainer-v000001.dcp"
    tiny_arith.trainer.save_checkpoint(str(ck))
    shard = next(ck.glob("*.distcp"))
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) - 1])  # one byte short, in the AdamW state an export never reads
    with pytest.raises(ExportError, match=rf"shard {shard.name} is truncated: {len(whole) - 1} bytes"):
        export_checkpoint(ck, tmp_path / "out", progress=False)
    shard.write_bytes(whole[:100] + bytes(len(whole) - 100))  # whole length, bytes zeroed: DCP's reader refuses it
    with pytest.raises(ExportError, match="shards cannot be read whole"):
        export_checkpoint(ck, tmp_path / "out", progress=False)
    shard.unlink()
    with pytest.raises(ExportError, match=f"shard {shard.name} is missing"):
        export_checkpoint(ck, tmp_path / "out", progress=False)
    (ck / ".metadata").unlink()
    with pytest.raises(ExportError, match=r"DCP metadata \(.metadata\) cannot be read"):
        export_checkpoint(ck, tmp_path / "out", progress=False)
    (ck / "fp8rl.json").write_text("{")
    with pytest.raises(ExportError, match="fp8rl.json is not valid JSON"):
        export_checkpoint(ck, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_unknown_format_and_non_empty_out(tiny_arith, tmp_path, capsys):
    with pytest.raises(ExportError, match="unknown export format 'gguf': expected one of hf, hf-fp8"):
        export_checkpoint(tiny_arith.ckpt, tmp_path / "out", fmt="gguf", progress=False)
    assert export_main([str(tiny_arith.ckpt), "--out", str(tmp_path / "out"), "--format", "gguf"]) == 2
    assert "invalid choice: 'gguf'" in capsys.readouterr().err
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(ExportError, match="out .* is not empty; .* --force"):
        export_checkpoint(tiny_arith.ckpt, out, progress=False)
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    with pytest.raises(ExportError, match="would replace the checkpoint .* itself"):
        export_checkpoint(tiny_arith.ckpt, tiny_arith.ckpt.parent, progress=False, force=True)
    (tmp_path / "file").write_text("")
    with pytest.raises(ExportError, match="is a file"):
        export_checkpoint(tiny_arith.ckpt, tmp_path / "file", progress=False)
    res = export_checkpoint(tiny_arith.ckpt, out, progress=False, force=True)  # replaced whole
    assert not (out / "mine.txt").exists() and (res.out / "model.safetensors").is_file()
    assert leftovers(tmp_path) == []


def test_keys_that_are_not_the_models_leave_out_as_it_was(tiny_arith, moe, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    # --model names another model than the one the checkpoint records
    with pytest.raises(ExportError, match="trained on another model than .*hidden_size: 256 vs 128"):
        export_checkpoint(tiny_arith.ckpt, out, model=moe.source, progress=False, force=True)
    # a checkpoint from before the record: the model must be named, and its keys must fit it
    state = torch.load(tiny_arith.ckpt, weights_only=True)
    for key in ("model_config", "model_source", "recipe"):
        del state[key]
    torch.save(state, tmp_path / "old.pt")
    with pytest.raises(ExportError, match="does not record its model .* pass --model"):
        export_checkpoint(tmp_path / "old.pt", out, progress=False, force=True)
    with pytest.raises(ExportError, match=r"weights do not match the qwen3_moe model .* missing tensor\(s\): "
                                          r"model.layers.0.mlp.experts.0.down_proj.weight"):
        export_checkpoint(tmp_path / "old.pt", out, model=moe.source, progress=False, force=True)
    renamed = dict(state["model"])
    renamed["model.layers.0.mlp.gate_proj.weights"] = renamed.pop("model.layers.0.mlp.gate_proj.weight")
    torch.save({**state, "model": renamed}, tmp_path / "renamed.pt")
    with pytest.raises(ExportError, match=r"1 missing tensor\(s\): model.layers.0.mlp.gate_proj.weight; "
                                          r"1 unexpected tensor\(s\): model.layers.0.mlp.gate_proj.weights"):
        export_checkpoint(tmp_path / "renamed.pt", out, model="tiny-arith", progress=False, force=True)
    assert [p.name for p in out.iterdir()] == ["mine.txt"] and leftovers(tmp_path) == []
    # named, the old checkpoint exports and loads
    res = export_checkpoint(tmp_path / "old.pt", tmp_path / "old", model="tiny-arith", progress=False)
    assert json.loads((res.out / "fp8rl_export.json").read_text())["model_source"] == "tiny-arith"


def test_a_recorded_model_that_is_gone_or_unknown(tmp_path):
    torch.manual_seed(0)
    policy = CausalLM(moe_config())
    policy.name_or_path = str(model_dir(policy, tmp_path / "model"))
    from fp8rl.fp8 import recipe_for_role

    from .conftest import train

    train(policy, recipe_for_role("bf16", "trainer"), tmp_path / "ck.pt")
    shutil.rmtree(tmp_path / "model")
    with pytest.raises(ExportError, match="records its model as .*model', which is not here .* pass --model"):
        load_checkpoint_policy(tmp_path / "ck.pt")
    with pytest.raises(ExportError, match="model 'no-such-model' is neither a preset"):
        load_checkpoint_policy(tmp_path / "ck.pt", model="no-such-model")
