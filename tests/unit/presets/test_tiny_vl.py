"""tiny-vl: tiny-arith's language tower in a small Qwen2.5-VL, warm-started on the counting pictures; the picture
task (data.task: shapes) is a pure function of its seed; the preset loads as transformers' Qwen2.5-VL."""

from __future__ import annotations

import json

import torch

from fp8rl.data.shapes import ShapesDataset
from fp8rl.model.hf_io import load_hf_checkpoint
from fp8rl.model.image_inputs import decode_image
from fp8rl.model.transformer import CausalLM
from fp8rl.presets import tiny_vl as V
from fp8rl.presets.tiny_arith import META_FILE, prepare_tiny_arith


def test_the_task_is_a_pure_function_of_its_seed_and_draws_every_count():
    a, b = ShapesDataset(3).batch(5, 64), ShapesDataset(3).batch(5, 64)
    assert a == b and a != ShapesDataset(4).batch(5, 64) and a != ShapesDataset(3).batch(6, 64)
    assert {p.answer for p in a} == {"1", "2", "3", "4"}
    assert ShapesDataset(3).eval_set(8) == ShapesDataset(3).eval_set(8) != ShapesDataset(3).batch(0, 8)
    p = a[0]
    assert p.prompt.count("<image>") == 1 == len(p.images) and decode_image(p.images[0]).size == (56, 56)


def test_a_vl_twin_of_tiny_arith_computes_tiny_arith_on_text():
    """Before any training, the VLM built from tiny-arith (zero q/k/v biases, multimodal RoPE equal on text) gives
    tiny-arith's logits on a text prompt."""
    text, cfg = load_hf_checkpoint(prepare_tiny_arith(progress=False))
    vl = V._from_text(text, V.tiny_vl_config(cfg)).eval()
    ids = torch.randint(4, 99, (2, 12))
    with torch.no_grad():
        assert torch.equal(vl(ids), text(ids))


def test_a_few_steps_write_a_loadable_preset(tmp_path):
    out = V.prepare_tiny_vl(tmp_path / "vl", max_steps=2, eval_every=1, eval_size=4, target_accuracy=2.0,
                            progress=False)
    meta = json.loads((out / META_FILE).read_text())
    assert meta["preset"] == V.TINY_VL and meta["sft_steps"] == 2 and 0.0 <= meta["greedy_accuracy"] <= 1.0
    model, cfg = load_hf_checkpoint(out)
    assert isinstance(model, CausalLM) and cfg.architecture == "qwen2_5_vl" and cfg.image_token_id == 124
    pre = json.loads((out / "preprocessor_config.json").read_text())
    assert pre["min_pixels"] == pre["max_pixels"] == 56 * 56
    import transformers

    ref = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(out).eval()
    ids = torch.randint(4, 99, (1, 10))
    with torch.no_grad():
        assert torch.allclose(model(ids), ref(input_ids=ids).logits, atol=1e-4, rtol=0)
