"""tiny-vl: tiny-arith's language tower in a small Qwen2.5-VL, warm-started on the counting pictures; the picture
task (data.task: shapes) is a pure function of its seed; the preset loads as transformers' Qwen2.5-VL, and its
tokenizer as transformers' with fp8rl's ids (vision tokens included; AutoProcessor too where torchvision imports)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from fp8rl.data.shapes import ShapesDataset
from fp8rl.model.hf_io import load_hf_checkpoint
from fp8rl.model.image_inputs import PromptImages, VisionProcessor, decode_image
from fp8rl.model.tokenizer import CharTokenizer, load_tokenizer
from fp8rl.model.transformer import CausalLM
from fp8rl.presets import tiny_vl as V
from fp8rl.presets.tiny_arith import META_FILE, prepare_tiny_arith

transformers = pytest.importorskip("transformers")


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


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    """A tiny-vl written after two supervised steps (what the cached preset is, but for its training)."""
    return V.prepare_tiny_vl(tmp_path_factory.mktemp("preset") / "vl", max_steps=2, eval_every=1, eval_size=4,
                             target_accuracy=2.0, progress=False)


def _ours_and_processors_text(out, problems):
    """Each problem's prompt ids as fp8rl builds them (its picture's cells in place of ``<image>``), and its text as
    a user of transformers' processor writes it (one ``<|image_pad|>`` between the vision start and end)."""
    _, cfg = load_hf_checkpoint(out)
    images, tok = PromptImages(VisionProcessor.from_model_dir(out, cfg.vision_config), cfg), CharTokenizer.load(out)
    ours = [images.prompt(p.prompt, p.images, lambda piece, first: tok.encode(piece, add_bos=first)) for p in problems]
    texts = [p.prompt.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>") for p in problems]
    return ours, texts


def test_a_few_steps_write_a_loadable_preset(preset):
    out = preset
    meta = json.loads((out / META_FILE).read_text())
    assert meta["preset"] == V.TINY_VL and meta["sft_steps"] == 2 and 0.0 <= meta["greedy_accuracy"] <= 1.0
    model, cfg = load_hf_checkpoint(out)
    assert isinstance(model, CausalLM) and cfg.architecture == "qwen2_5_vl" and cfg.image_token_id == 124
    pre = json.loads((out / "preprocessor_config.json").read_text())
    assert pre["min_pixels"] == pre["max_pixels"] == 56 * 56
    ref = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(out).eval()
    ids = torch.randint(4, 99, (1, 10))
    with torch.no_grad():
        assert torch.allclose(model(ids), ref(input_ids=ids).logits, atol=1e-4, rtol=0)


def test_transformers_tokenizer_of_the_preset_gives_fp8rls_ids(preset):
    """AutoTokenizer reads the preset: the character tokenizer's ids on every character it knows (BOS as
    ``encode`` adds it), the vision tokens at the config's ids, matched whole; fp8rl itself still reads its
    character file."""
    hf = transformers.AutoTokenizer.from_pretrained(preset)
    tok = CharTokenizer.load(preset)
    text = "".join(tok.vocab[4:]) + "Q: <image>How many squares?\nA: 3"
    assert hf(text)["input_ids"] == tok.encode(text) and hf.decode(tok.encode(text), skip_special_tokens=True) == text
    _, cfg = load_hf_checkpoint(preset)
    names = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
    assert hf.convert_tokens_to_ids(names) == [cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id,
                                               cfg.vision_end_token_id]
    a = tok.encode("a", add_bos=False)
    got = hf("a<|vision_start|><|image_pad|>", add_special_tokens=False)["input_ids"]
    assert got == [*a, cfg.vision_start_token_id, cfg.image_token_id]
    assert isinstance(load_tokenizer(preset), CharTokenizer)


def test_the_processors_rule_on_the_preset_gives_fp8rls_prompt_ids(preset):
    """Qwen2.5-VL's processor replaces each ``<|image_pad|>`` by as many as the image's merged cells (its image
    processor's grid / merge²) and tokenizes: on the preset's files that gives fp8rl's prompt ids for each picture.
    (The processor class itself needs torchvision for its video half: the next test, where that imports.)"""
    problems = ShapesDataset(0).eval_set(3)
    ours, texts = _ours_and_processors_text(preset, problems)
    hf = transformers.AutoTokenizer.from_pretrained(preset)
    ip = transformers.AutoImageProcessor.from_pretrained(preset)
    for p, want, text in zip(problems, ours, texts, strict=True):
        grid = ip(images=[decode_image(p.images[0])], return_tensors="pt")["image_grid_thw"][0]
        cells = int(grid.prod()) // ip.merge_size ** 2
        assert hf(text.replace("<|image_pad|>", "<|image_pad|>" * cells))["input_ids"] == want


def test_auto_processor_loads_the_preset_and_its_export(preset, tmp_path):
    """Where torchvision imports (not beside this venv's CPU torch: ``make test-processor`` runs it in a side venv),
    transformers' AutoProcessor loads the preset and its whole-VLM export, and gives fp8rl's prompt ids and picture
    grids."""
    pytest.importorskip("torchvision", exc_type=ImportError)
    from fp8rl.export import save_policy_hf

    save_policy_hf(load_hf_checkpoint(preset)[0], preset, tmp_path / "out")
    problems = ShapesDataset(0).eval_set(3)
    ours, texts = _ours_and_processors_text(preset, problems)
    for where in (preset, tmp_path / "out"):
        proc = transformers.AutoProcessor.from_pretrained(where)
        for p, want, text in zip(problems, ours, texts, strict=True):
            got = proc(text=[text], images=[decode_image(p.images[0])], return_tensors="pt")
            assert got["input_ids"][0].tolist() == want and got["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_a_preset_cached_before_the_tokenizer_file_gets_it_and_nothing_else_changes(preset, tmp_path):
    old = shutil.copytree(preset, tmp_path / "old")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (old / name).unlink()
    before = {f.name: f.read_bytes() for f in old.iterdir()}
    assert V.prepare_tiny_vl(old, progress=False) == old
    after = {f.name: f.read_bytes() for f in old.iterdir()}
    assert {n: after[n] for n in before} == before
    assert sorted(set(after) - set(before)) == ["tokenizer.json", "tokenizer_config.json"]
    assert after["tokenizer.json"] == (preset / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("with_hf_file", [True, False])
def test_the_export_of_tiny_vl_carries_a_tokenizer_with_the_vision_tokens(preset, tmp_path, with_hf_file):
    """The whole-VLM export copies the preset's tokenizer.json as it is; from a directory with only the character
    file it writes one with the config's vision tokens. Either way AutoTokenizer finds the image token."""
    from fp8rl.export import save_policy_hf

    src = shutil.copytree(preset, tmp_path / "src")
    if not with_hf_file:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (src / name).unlink()
    model, cfg = load_hf_checkpoint(src)
    save_policy_hf(model, src, tmp_path / "out")
    if with_hf_file:
        assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert hf.convert_tokens_to_ids("<|image_pad|>") == cfg.image_token_id
    assert (tmp_path / "out" / "preprocessor_config.json").is_file()
