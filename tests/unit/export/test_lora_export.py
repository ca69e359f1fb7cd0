"""Export of a LoRA checkpoint (issue 33): a PEFT adapter directory that PEFT itself loads onto transformers' model
of the base (the independent reference), that reads back into fp8rl with identical logits, and the merged model.
"""

from __future__ import annotations

import json

import pytest
import torch

from fp8rl.engines import TorchTrainer, TrainerConfig
from fp8rl.export import export_checkpoint
from fp8rl.export.peft import ADAPTER_CONFIG, read_peft_dir
from fp8rl.export.readers import ExportError
from fp8rl.fp8 import recipe_for_role
from fp8rl.model import CausalLM
from fp8rl.model.lora import LoraSettings
from fp8rl.presets import load_policy, prepare_preset

from .conftest import batch

# FP32 throughout; fp8rl and transformers + PEFT (or the merged weight) differ only in op order: a few ulps of O(1)
# logits (the model tests' ATOL_HF)
ATOL = 1e-4
LORA = LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    policy, _, _ = load_policy("tiny-arith")
    tr = TorchTrainer(policy, recipe_for_role("bf16", "trainer"), TrainerConfig(lr=3e-2, micro_batch_size=8,
                                                                                lora=LORA))
    for s in range(2):
        tr.train_step(batch(seed=s))
    ck = tmp_path_factory.mktemp("lora") / "trainer-v000002.pt"
    tr.save_checkpoint(str(ck))
    ids = torch.randint(4, 100, (2, 15), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits = tr.model(ids).float()
    assert any(p.abs().max() > 0 for n, p in tr.model.named_parameters() if n.endswith("lora_B.weight"))
    return tr, ck, ids, logits


def test_peft_loads_the_exported_adapter_onto_transformers_model_with_the_same_logits(lora_run, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    tr, ck, ids, logits = lora_run
    out = tmp_path / "adapter"
    res = export_checkpoint(ck, out, fmt="peft", progress=False)
    assert res.fmt == "peft" and res.bytes_written > 0
    cfg = json.loads((out / ADAPTER_CONFIG).read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["base_model_name_or_path"]) == (4, 8.0, "tiny-arith")
    base = AutoModelForCausalLM.from_pretrained(prepare_preset("tiny-arith", progress=False), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(out)).eval()
    with torch.no_grad():
        theirs = model(ids).logits.float()
    torch.testing.assert_close(theirs, logits, atol=ATOL, rtol=0)
    with model.disable_adapter(), torch.no_grad():  # control: the adapters do move the logits
        plain = model(ids).logits.float()
    assert (plain - logits).abs().max() > 100 * ATOL


def test_the_adapter_directory_reads_back_into_fp8rl_with_identical_logits(lora_run, tmp_path):
    tr, ck, ids, logits = lora_run
    out = tmp_path / "adapter"
    export_checkpoint(ck, out, fmt="peft", progress=False)
    settings, adapters = read_peft_dir(out)
    assert settings == LORA
    mine = {n: t for n, t in tr.state_dict(adapters_only=True).items()}
    assert adapters.keys() == mine.keys() and all(torch.equal(adapters[n], t) for n, t in mine.items())
    policy, _, _ = load_policy("tiny-arith")
    again = TorchTrainer(policy, recipe_for_role("bf16", "trainer"), TrainerConfig(lora=settings))
    again.model.load_state_dict(adapters, strict=False)
    with torch.no_grad():
        assert torch.equal(again.model(ids).float(), logits)


def test_hf_export_of_a_lora_checkpoint_merges_the_adapters(lora_run, tmp_path):
    tr, ck, ids, logits = lora_run
    out = tmp_path / "merged"
    export_checkpoint(ck, out, fmt="hf", progress=False)
    merged, _, _ = load_policy(str(out))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).float(), logits, atol=ATOL, rtol=0)
    assert not any("lora" in n for n in merged.state_dict())


def test_lora_exports_refuse_the_wrong_base_and_a_full_checkpoint(lora_run, tmp_path):
    _, ck, _, _ = lora_run
    other, _, _ = load_policy("tiny-arith")
    with torch.no_grad():
        other.model.norm.weight.add_(1e-3)
    from fp8rl.model import save_hf_checkpoint
    from fp8rl.model.tokenizer import CharTokenizer

    d = tmp_path / "other"
    save_hf_checkpoint(other, other.config, d)
    CharTokenizer().save(d)
    with pytest.raises(ExportError, match="trained on a base with checksum"):
        export_checkpoint(ck, tmp_path / "m", fmt="hf", model=str(d), progress=False)
    assert not (tmp_path / "m").exists()
    policy, _, _ = load_policy("tiny-arith")
    full = TorchTrainer(policy, recipe_for_role("bf16", "trainer"), TrainerConfig())
    fck = tmp_path / "full.pt"
    full.save_checkpoint(str(fck))
    with pytest.raises(ExportError, match="needs a LoRA checkpoint"):
        export_checkpoint(fck, tmp_path / "p", fmt="peft", progress=False)
    # a model directory that is not a PEFT adapter
    with pytest.raises(ExportError, match="not a readable PEFT adapter directory"):
        read_peft_dir(d)


def test_a_dcp_of_an_fp8_lora_trainer_exports_like_its_pt(tmp_path):
    """The trainer holds its FP8 base as E4M3 + scales, and a .dcp saves that form: the merged export takes the base
    from the model source (checked by its checksum) whatever the checkpoint kind, so .dcp and .pt export the same
    bytes."""
    from safetensors.torch import load_file

    policy, _, _ = load_policy("tiny-arith")
    tr = TorchTrainer(policy, recipe_for_role("fp8_e2e", "trainer"), TrainerConfig(lr=3e-2, micro_batch_size=8,
                                                                                   lora=LORA))
    tr.train_step(batch(seed=0))
    tr.save_checkpoint(str(tmp_path / "v1.pt"))
    tr.save_checkpoint(str(tmp_path / "v1.dcp"))
    for kind in ("pt", "dcp"):
        export_checkpoint(tmp_path / f"v1.{kind}", tmp_path / kind, fmt="hf", progress=False)
    a, b = (load_file(str(tmp_path / k / "model.safetensors")) for k in ("pt", "dcp"))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.fixture(scope="module", params=[False, True], ids=["per-expert", "shared"])
def moe_lora_run(tmp_path_factory, request):
    """The small Qwen3-MoE with adapters on attention and on every expert's three projections (each expert its own,
    or one per projection shared by a layer's experts), two steps on."""
    from .conftest import model_dir, moe_config

    torch.manual_seed(3)
    policy = CausalLM(moe_config())
    with torch.no_grad():
        for name, p in policy.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) / p.shape[-1] ** 0.5)
    root = tmp_path_factory.mktemp("moe-lora")
    policy.name_or_path = str(model_dir(policy, root / "model"))
    settings = LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "gate_proj", "up_proj", "down_proj"),
                            share_experts=request.param)
    tr = TorchTrainer(policy, recipe_for_role("bf16", "trainer"), TrainerConfig(lr=3e-2, micro_batch_size=8,
                                                                                lora=settings))
    for s in range(2):
        tr.train_step(batch(seed=s))
    ck = root / "trainer-v000002.pt"
    tr.save_checkpoint(str(ck))
    ids = torch.randint(4, 100, (2, 15), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits = tr.model(ids).float()
    experts = [n for n, p in tr.model.named_parameters() if ".experts." in n and n.endswith("lora_B.weight")]
    assert experts and all(p.abs().max() > 0 for n, p in tr.model.named_parameters() if n in experts)
    assert all(".experts.0." in n for n in experts) == request.param
    return tr, ck, ids, logits, root / "model", settings


def test_expert_adapters_load_through_peft_target_parameters_over_transformers_fused_experts(moe_lora_run, tmp_path):
    """transformers 5's Qwen3-MoE holds its experts fused (``mlp.experts.gate_up_proj`` / ``down_proj``): the
    export's expert adapters are PEFT's ``target_parameters`` form, and PEFT loads them with fp8rl's logits.
    Control: without the expert adapters (the attention ones kept) the logits move."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    tr, ck, ids, logits, model, _ = moe_lora_run
    out = tmp_path / "adapter"
    export_checkpoint(ck, out, fmt="peft", progress=False)
    cfg = json.loads((out / ADAPTER_CONFIG).read_text())
    assert cfg["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert cfg["target_modules"] == ["q_proj"] and cfg["rank_pattern"] == {"gate_up_proj": 8}
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    assert base.model.layers[0].mlp.experts.gate_up_proj.dim() == 3  # fused: no per-expert module to target
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(base, str(out)).eval()(ids).logits.float()
    torch.testing.assert_close(theirs, logits, atol=ATOL, rtol=0)
    weights = load_file(str(out / "adapter_model.safetensors"))
    save_file({n: t for n, t in weights.items() if ".experts." not in n}, str(out / "adapter_model.safetensors"))
    (out / ADAPTER_CONFIG).write_text(json.dumps({**cfg, "target_parameters": None, "rank_pattern": {}}))
    with torch.no_grad():
        attention_only = peft.PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), str(out)).eval()(ids).logits.float()
    assert (attention_only - logits).abs().max() > 100 * ATOL


def test_fused_expert_adapters_read_back_per_expert_bitwise(moe_lora_run, tmp_path):
    tr, ck, ids, logits, _, settings = moe_lora_run
    out = tmp_path / "adapter"
    export_checkpoint(ck, out, fmt="peft", progress=False)
    got_settings, adapters = read_peft_dir(out)
    assert got_settings == settings
    mine = tr.state_dict(adapters_only=True)
    assert adapters.keys() == mine.keys() and all(torch.equal(adapters[n], t) for n, t in mine.items())


def test_a_fused_adapter_fp8rl_cannot_hold_per_expert_is_refused(moe_lora_run, tmp_path):
    """Another tool's gate_up adapter of one rank over both halves (gate and up sharing A) is not two per-expert
    adapters: refused by name, not read wrongly."""
    from safetensors.torch import load_file, save_file

    _, ck, _, _, _, _ = moe_lora_run
    out = tmp_path / "adapter"
    export_checkpoint(ck, out, fmt="peft", progress=False)
    weights = load_file(str(out / "adapter_model.safetensors"))
    name = next(n for n in weights if n.endswith("experts.base_layer.lora_B.weight"))
    weights[name] = torch.ones_like(weights[name])  # every gate row and up row on every column
    save_file(weights, str(out / "adapter_model.safetensors"))
    with pytest.raises(ExportError, match="mixes gate and up rows"):
        read_peft_dir(out)
