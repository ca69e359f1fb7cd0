"""``--format hf``: trained checkpoints exported and loaded by transformers, whose logits equal fp8rl's.

The reference is transformers' own model (``AutoModelForCausalLM``), which shares no code with the export. Its
logits are compared with an fp8rl :class:`CausalLM` holding the trainer's master weights under
``ATOL_HF`` — the tolerance the model tests name for fp8rl vs transformers on the same FP32 weights. The
negative case: the model the run started from is more than 100x that far away, so a test that exported the
wrong weights (or none of the step's) fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from fp8rl.export import export_checkpoint, load_checkpoint_policy, read_checkpoint, save_policy_hf
from fp8rl.export.__main__ import main as export_main
from fp8rl.model import CausalLM
from fp8rl.model.tokenizer import CharTokenizer, load_tokenizer
from fp8rl.sdk.cli import main as cli_main
from tests.unit.model.test_transformer import ATOL_HF

REPO = Path(__file__).resolve().parents[3]


def ours(trainer, config) -> CausalLM:
    """A plain FP32 CausalLM holding the trainer's master weights (what the checkpoint must carry)."""
    m = CausalLM(config).eval()
    m.load_state_dict(trainer.state_dict(), strict=not config.tie_word_embeddings)
    m.tie_weights()
    return m


@torch.no_grad()
def hf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    return hf(ids).logits.float()


def test_pt_export_loads_in_transformers_with_our_logits(tiny_arith, tmp_path):
    t = tiny_arith
    res = export_checkpoint(t.ckpt, tmp_path / "hf", progress=False)  # the model it records: tiny-arith
    assert res.out == tmp_path / "hf" and res.fmt == "hf" and res.seconds > 0
    files = {p.name for p in res.out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "fp8rl_tokenizer.json", "fp8rl_export.json"} <= files
    assert res.bytes_written == sum(p.stat().st_size for p in res.out.iterdir())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left beside it
    cfg = json.loads((res.out / "config.json").read_text())
    assert cfg["torch_dtype"] == "float32" and "quantization_config" not in cfg
    assert {v.dtype for v in load_file(res.out / "model.safetensors").values()} == {torch.float32}
    record = json.loads((res.out / "fp8rl_export.json").read_text())
    assert record["kind"] == "torch .pt" and record["version"] == 1 and record["model_source"] == "tiny-arith"

    config = t.trainer.model.config
    want = ours(t.trainer, config)(t.ids)
    got = hf_logits(res.out, t.ids)
    torch.testing.assert_close(got, want, atol=ATOL_HF, rtol=0)
    start = CausalLM(config).eval()  # negative case: the weights the step started from are far from it
    start.load_state_dict(t.start)
    with torch.no_grad():
        assert (start(t.ids) - got).abs().max() > 100 * ATOL_HF

    # the tokenizer: transformers' reads the directory and encodes as fp8rl's character tokenizer does
    hf_tok, text = AutoTokenizer.from_pretrained(res.out), "Q: 12+7=\nA: "
    assert hf_tok(text).input_ids == CharTokenizer().encode(text)
    assert (hf_tok.eos_token_id, hf_tok.pad_token_id) == (config.eos_token_id, config.pad_token_id)
    assert json.loads((res.out / "generation_config.json").read_text())["eos_token_id"] == config.eos_token_id
    assert isinstance(load_tokenizer(res.out), CharTokenizer)  # fp8rl keeps reading its own file


def test_load_checkpoint_policy_gives_the_trained_weights(tiny_arith):
    policy, tok, path = load_checkpoint_policy(tiny_arith.ckpt)
    want = tiny_arith.trainer.state_dict()
    got = policy.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert isinstance(tok, CharTokenizer) and (path / "config.json").is_file()
    assert policy.name_or_path == "tiny-arith" and not policy.training


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the trainer's one-rank DCP save says so
def test_live_model_and_one_rank_dcp_export_the_same_bytes(tiny_arith, tmp_path):
    t = tiny_arith
    pt = export_checkpoint(t.ckpt, tmp_path / "pt", progress=False)
    live = save_policy_hf(t.trainer.model, load_checkpoint_policy(t.ckpt)[2], tmp_path / "live")
    t.trainer.save_checkpoint(str(tmp_path / "trainer-v000001.dcp"))  # one rank's DCP directory
    dcp = export_checkpoint(tmp_path / "trainer-v000001.dcp", tmp_path / "dcp", progress=False)
    assert read_checkpoint(tmp_path / "trainer-v000001.dcp").kind == "torch .dcp"
    a = load_file(pt.out / "model.safetensors")
    for other in (live, dcp):
        b = load_file(other.out / "model.safetensors")
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
        assert (other.out / "config.json").read_text() == (pt.out / "config.json").read_text()


def test_moe_export_loads_in_transformers_with_our_logits(moe, tmp_path):
    res = export_checkpoint(moe.ckpt, tmp_path / "hf", progress=False)
    cfg = json.loads((res.out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    names = set(load_file(res.out / "model.safetensors"))
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names and "model.layers.1.mlp.gate.weight" in names
    config = moe.trainer.model.config
    want = ours(moe.trainer, config)(moe.ids)
    got = hf_logits(res.out, moe.ids)
    torch.testing.assert_close(got, want, atol=ATOL_HF, rtol=0)
    start = CausalLM(config).eval()
    start.load_state_dict(moe.start)
    with torch.no_grad():
        assert (start(moe.ids) - got).abs().max() > 100 * ATOL_HF


def test_both_command_lines(tiny_arith, tmp_path, capsys):
    assert export_main([str(tiny_arith.ckpt), "--out", str(tmp_path / "a"), "--no-progress"]) == 0
    assert cli_main(["export", str(tiny_arith.ckpt), "--out", str(tmp_path / "b"), "--format", "hf-fp8",
                     "--model", "tiny-arith", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"-> {tmp_path / 'a'} (hf," in out and f"-> {tmp_path / 'b'} (hf-fp8," in out
    assert json.loads((tmp_path / "b" / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    assert cli_main(["export", "--help"]) == 0
    assert "--format {hf,hf-fp8,peft}" in capsys.readouterr().out
    # the module runs as a program too (its own process: the entry point, the exit code)
    p = subprocess.run([sys.executable, "-m", "fp8rl.export", str(tmp_path / "nothing.pt"), "--out",
                        str(tmp_path / "c")], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 2 and "nothing.pt does not exist" in p.stderr and not (tmp_path / "c").exists()
