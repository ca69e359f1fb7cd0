"""Vision-language models. Qwen2.5-VL whole: the vision encoder, the image embeddings placed at the image tokens and
multimodal RoPE give transformers' logits on prompts with several images of several sizes (patches from
transformers' PIL image processor), and the positions equal transformers' ``get_rope_index``.

Vision-language checkpoints read as their language model alone (``policy.language_model_only``): a Qwen2.5-VL
(``model.*`` beside ``visual.*`` on disk) and a Qwen3-VL checkpoint (``model.language_model.*`` beside
``model.visual.*``) made by transformers load as the Qwen2 / Qwen3 text model and give transformers' logits of the
whole VLM on text prompts; the loop trains one exactly; an export writes the whole model back, the vision encoder
bitwise the source's, and transformers loads it; without the key, or of a multimodal type fp8rl does not read, the
load is refused by name.

transformers' ``*ForConditionalGeneration`` is the reference (random-init, weights redrawn at O(1) activations);
nothing downloads.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from fp8rl.model import load_hf_checkpoint
from fp8rl.model.hf_io import read_model_config
from fp8rl.model.tokenizer import CharTokenizer

from .test_transformer import ATOL_HF, _scramble

transformers = pytest.importorskip("transformers")

VOCAB = CharTokenizer().vocab_size
SPECIAL = dict(image_token_id=VOCAB - 4, video_token_id=VOCAB - 3, vision_start_token_id=VOCAB - 2,
               vision_end_token_id=VOCAB - 1)  # ids the text prompts below never use
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)


def _qwen2_5_vl(tok: CharTokenizer):
    cfg = transformers.Qwen2_5_VLConfig(
        text_config={**TEXT, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                                 "rope_theta": 50000.0},
                     "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id},
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=[0]), **SPECIAL)
    return transformers.Qwen2_5_VLForConditionalGeneration(cfg)


def _qwen3_vl(tok: CharTokenizer):
    cfg = transformers.Qwen3VLConfig(
        text_config={**TEXT, "head_dim": 16, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                                                 "mrope_interleaved": True, "rope_theta": 50000.0},
                     "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id},
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           deepstack_visual_indexes=[0, 1], num_position_embeddings=64), **SPECIAL)
    return transformers.Qwen3VLForConditionalGeneration(cfg)


BUILDERS = {"qwen2_5_vl": (_qwen2_5_vl, "qwen2", "visual."), "qwen3_vl": (_qwen3_vl, "qwen3", "model.visual.")}


def _checkpoint(kind: str, path, seed: int = 0):
    """transformers' VLM of ``kind`` saved (with fp8rl's character tokenizer) at ``path``; the reference model."""
    torch.manual_seed(seed)
    tok = CharTokenizer()
    ref = BUILDERS[kind][0](tok)
    _scramble(ref)
    ref.eval().save_pretrained(path)
    tok.save(path)
    return ref


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_the_language_model_gives_the_whole_vlms_logits_on_text(kind, tmp_path):
    ref = _checkpoint(kind, tmp_path)
    model, cfg = load_hf_checkpoint(tmp_path, language_model_only=True)
    assert cfg.architecture == BUILDERS[kind][1]
    assert not any("visual" in n for n in model.state_dict())
    ids = torch.randint(3, VOCAB - 4, (2, 11))
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = model(ids)
    assert torch.allclose(got, want, atol=ATOL_HF, rtol=0), (got - want).abs().max()


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_without_the_key_a_vlm_fp8rl_builds_loads_whole(kind, tmp_path):
    from fp8rl.presets import load_policy

    _checkpoint(kind, tmp_path)
    model = load_policy(str(tmp_path))[0]
    assert hasattr(model, "visual") and model.config.architecture == kind


def test_without_the_key_a_vlm_fp8rl_reads_as_text_only_is_refused_naming_it(tmp_path):
    """Qwen2-VL: fp8rl reads its language model (policy.language_model_only) but does not build it whole."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "vision_config": {"depth": 1},
                                                      "text_config": {**TEXT, "rope_parameters": {
                                                          "rope_type": "default", "mrope_section": [2, 3, 3]}}}))
    with pytest.raises(ValueError, match="policy.language_model_only"):
        read_model_config(tmp_path)
    assert read_model_config(tmp_path, language_model_only=True).architecture == "qwen2"


def test_a_multimodal_type_fp8rl_does_not_read_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "vision_config": {}, "text_config": {}}))
    with pytest.raises(ValueError, match="'llava' is a multimodal checkpoint"):
        read_model_config(tmp_path, language_model_only=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "text_config": {
        **TEXT, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}}))
    with pytest.raises(ValueError, match="text RoPE type 'yarn'"):
        read_model_config(tmp_path, language_model_only=True)


def test_a_flat_legacy_config_reads_too(tmp_path):
    """Qwen2.5-VL files written before transformers 4.52 keep the text keys at the top level and M-RoPE as
    ``rope_scaling: {type: mrope}``."""
    flat = {"model_type": "qwen2_5_vl", **TEXT, "rope_theta": 50000.0,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}, "vision_config": {"depth": 1}, **SPECIAL}
    (tmp_path / "config.json").write_text(json.dumps(flat))
    cfg = read_model_config(tmp_path, language_model_only=True)
    assert (cfg.architecture, cfg.rope_theta, cfg.rope_scaling, cfg.hidden_size) == ("qwen2", 50000.0, None, 64)


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_the_export_writes_the_whole_vlm_back(kind, tmp_path):
    """The text tower trained (here: moved by hand), saved through the export path: transformers loads the whole
    VLM, its text tensors are the trained ones and every vision tensor is bitwise the source's."""
    from fp8rl.export import save_policy_hf

    src = tmp_path / "src"
    _checkpoint(kind, src)
    policy, _ = load_hf_checkpoint(src, language_model_only=True)
    with torch.no_grad():
        policy.model.layers[0].mlp.down_proj.weight.add_(0.5)
    policy.name_or_path = str(src)
    save_policy_hf(policy, src, tmp_path / "out")
    before, after = load_file(src / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert set(before) == set(after)
    vision = BUILDERS[kind][2]
    assert all(torch.equal(before[n], after[n]) for n in before if n.startswith(vision))
    assert sum(not torch.equal(before[n], after[n]) for n in before) == 1
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == \
        json.loads((src / "config.json").read_text())["architectures"]
    loaded = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(3, VOCAB - 4, (1, 9))
    with torch.no_grad():
        assert torch.allclose(policy(ids), loaded(input_ids=ids).logits, atol=ATOL_HF, rtol=0)


def test_other_export_formats_of_a_vlm_are_refused(tmp_path):
    from fp8rl.export import save_policy_hf
    from fp8rl.export.readers import ExportError

    _checkpoint("qwen2_5_vl", tmp_path / "src")
    policy, _ = load_hf_checkpoint(tmp_path / "src", language_model_only=True)
    with pytest.raises(ExportError, match="vision-language model.*--format hf"):
        save_policy_hf(policy, tmp_path / "src", tmp_path / "out", fmt="hf-fp8")
    assert not (tmp_path / "out").exists()


def test_the_loop_trains_a_vlms_language_model_exactly(tmp_path):
    """The in-process GRPO loop with ``policy.language_model_only`` on a Qwen2.5-VL checkpoint (fp8_e2e, FP8 KV,
    batch invariance): every step's rollout and trainer logprobs are equal (max |Δlogprob| 0), and its final
    checkpoint exports as the whole VLM."""
    from fp8rl.config import JobConfig
    from fp8rl.export import export_checkpoint
    from fp8rl.loop import LoopConfig, run
    from fp8rl.rl.metrics import MAX_ABS_LOGPROB_DIFF

    _checkpoint("qwen2_5_vl", tmp_path / "vl")
    job = JobConfig().with_settings({"policy.language_model_only": True})
    out = run(LoopConfig.from_flags(job=job, model=str(tmp_path / "vl"), recipe="fp8_e2e", kv_cache_dtype="fp8",
                                    batch_invariant=True, steps=2, prompts_per_step=3, group_size=2, max_tokens=6,
                                    micro_batch_size=6, calibration_max_sequences=4, eval_size=2, seed=0,
                                    out_dir=str(tmp_path / "run")), progress=False)
    assert [h[MAX_ABS_LOGPROB_DIFF] for h in out["steps"]] == [0.0, 0.0]
    checkpoint = sorted((tmp_path / "run").rglob("*.pt"))
    assert checkpoint, sorted(p.name for p in (tmp_path / "run").rglob("*"))
    export_checkpoint(checkpoint[-1], tmp_path / "export", progress=False)
    assert json.loads((tmp_path / "export" / "config.json").read_text())["model_type"] == "qwen2_5_vl"
    transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "export")


def test_the_controller_reads_the_text_tower_and_vllm_is_refused(tmp_path):
    from fp8rl.config import JobConfig
    from fp8rl.controller.plan import model_config_of
    from fp8rl.engines.factory import make_rollout_engine

    _checkpoint("qwen3_vl", tmp_path)
    job = JobConfig().with_settings({"policy.model": str(tmp_path), "policy.language_model_only": True})
    assert model_config_of(job).architecture == "qwen3"
    assert model_config_of(job.with_settings({"policy.language_model_only": False})).architecture == "qwen3_vl"
    with pytest.raises(ValueError, match="embedded rollout"):
        make_rollout_engine(job.with_settings({"policy.generation.backend": "vllm"}), None, tmp_path,
                            eos_token_ids=[2], pad_token_id=0)


def test_the_stack_takes_a_vlm_single_turn_on_one_torch_trainer_process(tmp_path):
    """SubmitJob's check: the pictures ride with the Generate, TrainStep and Calibrate calls, which the Megatron
    trainer, a trainer's ranks and multi-turn trajectories do not take."""
    from fp8rl.config import ConfigError, JobConfig
    from services.controller.runner import JobRunner

    _checkpoint("qwen2_5_vl", tmp_path)
    job = JobConfig().with_settings({"policy.model": str(tmp_path)})
    JobRunner._check_vision(None, job)  # taken
    JobRunner._check_vision(None, job.with_settings({"policy.language_model_only": True,
                                                     "policy.training.dp_size": 2}))  # its text tower: any trainer
    for key, value, why in (("policy.training.backend", "megatron", "backend must be torch"),
                            ("policy.training.dp_size", 2, "dp_size must be 1"),
                            ("env.name", "calculator", "env / agent jobs train text trajectories")):
        with pytest.raises(ConfigError, match=f"is a vision-language model, .*{why}"):
            JobRunner._check_vision(None, job.with_settings({key: value}))


def _pil_images(sizes, seed=0):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def _vl_prompts(cfg, sizes_per_row, texts):
    """Prompts of text and images, laid out as the processor lays them (vision start, one image token per merged
    cell, vision end): ``(token lists, per prompt its ImageBatch or None)``; patches from transformers' PIL image
    processor."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from fp8rl.model.vision import ImageBatch

    patch = cfg.vision_config.get("patch_size", 14)
    side = patch * cfg.vision_config.get("spatial_merge_size", 2)  # a merged cell's pixels
    proc = Qwen2VLImageProcessorPil(min_pixels=side * side, max_pixels=side * side * 12, patch_size=patch)
    prompts, images = [], []
    g = torch.Generator().manual_seed(1)
    for sizes, n_text in zip(sizes_per_row, texts, strict=True):
        row = torch.randint(3, VOCAB - 4, (n_text,), generator=g).tolist()
        pixels, grids = [], []
        for img in _pil_images(sizes, seed=len(prompts)):
            out = proc(images=[img], return_tensors="pt")
            t, h, w = out["image_grid_thw"][0].tolist()
            pixels.append(out["pixel_values"])
            grids.append(out["image_grid_thw"])
            row += [cfg.vision_start_token_id] + [cfg.image_token_id] * (t * h * w // 4) + [cfg.vision_end_token_id]
            row += torch.randint(3, VOCAB - 4, (3,), generator=g).tolist()
        prompts.append(row)
        images.append(ImageBatch(torch.cat(pixels), torch.cat(grids)) if pixels else None)
    return prompts, images


def _vl_batch(cfg, sizes_per_row, texts, pad_to):
    """:func:`_vl_prompts` left-padded into one batch: ``(input_ids, attention_mask, ImageBatch)``."""
    from fp8rl.model.vision import ImageBatch

    prompts, images = _vl_prompts(cfg, sizes_per_row, texts)
    ids = torch.zeros(len(prompts), pad_to, dtype=torch.long)
    mask = torch.zeros(len(prompts), pad_to, dtype=torch.long)
    for b, row in enumerate(prompts):
        ids[b, pad_to - len(row):] = torch.tensor(row)
        mask[b, pad_to - len(row):] = 1
    return ids, mask, ImageBatch.concat(images)


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_a_whole_vlm_gives_transformers_logits_on_images(kind, tmp_path):
    """Qwen2.5-VL (window attention, blocked M-RoPE) and Qwen3-VL (learned positions, DeepStack into two layers,
    interleaved M-RoPE, its own checkpoint names)."""
    from fp8rl.model.mrope import mrope_positions

    ref = _checkpoint(kind, tmp_path)
    model, cfg = load_hf_checkpoint(tmp_path)
    assert cfg.architecture == kind and hasattr(model, "visual")
    ids, mask, images = _vl_batch(cfg, [[(60, 90), (40, 40)], [(100, 30)], []], [4, 6, 9], pad_to=40)
    assert images.grid_thw.shape[0] == 3 and len({tuple(g) for g in images.grid_thw.tolist()}) == 3
    mm = (ids == cfg.image_token_id).int()
    want_pos, want_delta = ref.model.get_rope_index(ids, mm, image_grid_thw=images.grid_thw, attention_mask=mask)
    pos, delta = mrope_positions(ids, mask, images.grid_thw, cfg.image_token_id, model.visual.merge)
    keep = mask.bool()
    assert torch.equal(pos[:, keep], want_pos[:, keep]) and torch.equal(delta, want_delta.view(-1))
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, pixel_values=images.pixel_values,
                   image_grid_thw=images.grid_thw, mm_token_type_ids=mm).logits
        got = model(ids, attention_mask=mask, images=images)
    assert torch.allclose(got[keep], want[keep], atol=ATOL_HF, rtol=0), (got[keep] - want[keep]).abs().max()
    with torch.no_grad():  # the images matter: another picture moves the logits of the tokens after it
        other = model(ids, attention_mask=mask, images=type(images)(images.pixel_values.flip(0), images.grid_thw))
    assert (other[keep] - got[keep]).abs().max() > 100 * ATOL_HF


def test_image_tokens_that_do_not_fit_the_images_are_refused(tmp_path):
    _checkpoint("qwen2_5_vl", tmp_path)
    model, cfg = load_hf_checkpoint(tmp_path)
    ids, mask, images = _vl_batch(cfg, [[(60, 90)]], [4], pad_to=30)
    short = ids.clone()
    short[0, (ids[0] == cfg.image_token_id).nonzero()[0]] = 5  # one image token fewer than its grid's cells
    with pytest.raises(ValueError, match="image tokens"):
        model(short, attention_mask=mask, images=images)
    with pytest.raises(ValueError, match="grids"):
        model(ids, attention_mask=mask, images=type(images)(images.pixel_values[:-4], images.grid_thw))


@pytest.mark.parametrize("interleaved", [False, True])
def test_mrope_tables_equal_transformers(interleaved):
    """Blocked sections (Qwen2.5-VL) and interleaved ones (Qwen3-VL) on positions that differ per axis: transformers'
    cos/sin tables, bitwise (the same FP32 products and the same cos/sin kernels)."""
    from fp8rl.model.mrope import mrope_axes, mrope_cos_sin

    section, theta, dim = [2, 3, 3], 50000.0, 16
    pos = torch.randint(0, 300, (3, 2, 7))
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    cos, sin = mrope_cos_sin(inv, mrope_axes(section, interleaved), pos, torch.float32)
    x = torch.zeros(1, dtype=torch.float32)
    params = {"rope_type": "default", "rope_theta": theta, "mrope_section": section}
    if interleaved:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

        rot = Qwen3VLTextRotaryEmbedding(transformers.Qwen3VLTextConfig(
            head_dim=dim, rope_parameters={**params, "mrope_interleaved": True}))
    else:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

        rot = Qwen2_5_VLRotaryEmbedding(transformers.Qwen2_5_VLTextConfig(
            hidden_size=dim * 4, num_attention_heads=4, rope_parameters=params))
    want_cos, want_sin = rot(x, pos)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_fp8_and_batch_invariance_leave_the_vision_encoder_in_high_precision(tmp_path):
    """fp8_e2e converts the language model's projections only; with batch invariance and FP8 linears the model still
    takes its images, and a row's logits do not depend on the other rows of its batch."""
    from fp8rl.fp8 import Fp8Linear, convert_model, recipe_for_role

    _checkpoint("qwen2_5_vl", tmp_path)
    model, cfg = load_hf_checkpoint(tmp_path)
    convert_model(model, recipe_for_role("fp8_e2e", "trainer"), mode="train")
    model.enable_batch_invariance()
    fp8 = [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    assert fp8 and all(n.startswith("model.layers.") for n in fp8)
    assert not any(isinstance(m, Fp8Linear) for m in model.visual.modules())
    ids, mask, images = _vl_batch(cfg, [[(60, 90)], [(40, 40)]], [4, 6], pad_to=32)
    with torch.no_grad():
        both = model(ids, attention_mask=mask, images=images)
        first = model(ids[:1], attention_mask=mask[:1], images=type(images)(
            images.pixel_values[:int(images.grid_thw[0].prod())], images.grid_thw[:1]))
    keep = mask[0].bool()  # a pad query's row is finite garbage
    assert torch.isfinite(both).all() and torch.equal(first[0][keep], both[0][keep])


def test_the_encoders_linears_go_fp8_only_when_asked_and_the_rollout_stays_the_trainer_bitwise(tmp_path):
    """``policy.generation.vllm_cfg.fp8_vision_encoder``: the encoder's blocks' and merger's linears in FP8 in every
    engine (the patch embedding stays), named for the refit; the rollout's logprobs stay the trainer's bitwise under
    invariance, and the encoder's outputs are not the high-precision encoder's. Off (the default), nothing in it is."""
    from fp8rl.config import JobConfig
    from fp8rl.engines.base import SamplingParams
    from fp8rl.engines.batch import build_train_batch
    from fp8rl.engines.calibrator import QKVCalibrator
    from fp8rl.engines.torch_rollout import TorchRolloutEngine
    from fp8rl.engines.torch_trainer import TorchTrainer, TrainerConfig
    from fp8rl.fp8 import Fp8InferenceLinear, Fp8Linear, fp8_linear_names

    _checkpoint("qwen2_5_vl", tmp_path)
    model, cfg = load_hf_checkpoint(tmp_path)
    job = JobConfig().with_settings({"policy.numerics.batch_invariant": True})
    assert not any(n.startswith("visual.") for n in fp8_linear_names(model, job.fp8_recipe("rollout")))
    job = job.with_settings({"policy.generation.vllm_cfg.fp8_vision_encoder": True})
    rr, tr = job.fp8_recipe("rollout"), job.fp8_recipe("trainer")
    names = [n for n in fp8_linear_names(model, rr) if n.startswith("visual.")]
    linears = [n for n, m in model.visual.named_modules() if isinstance(m, torch.nn.Linear)]
    assert names == [f"visual.{n}" for n in linears] and "visual.merger.mlp.0" in names
    tok = CharTokenizer()
    engine = TorchRolloutEngine(model, rr, eos_token_ids=[tok.eos_id], pad_token_id=tok.pad_id, max_batch_size=3)
    trainer = TorchTrainer(model, tr, TrainerConfig(micro_batch_size=4, lr=1e-2))
    for m, kind in ((engine.model, Fp8InferenceLinear), (trainer.model, Fp8Linear)):
        assert sum(isinstance(x, kind) for x in m.visual.modules()) == len(linears)
    prompts, images = _vl_prompts(cfg, [[(60, 90)], [(40, 40)]], [4, 7])
    with torch.no_grad():
        assert not torch.equal(trainer.model.visual(images[0]), model.visual(images[0]))  # the FP8 encoder's own
    scales = QKVCalibrator(trainer.model, pad_token_id=tok.pad_id).calibrate(0, prompts, images)
    engine.load_scales(scales)
    trainer.load_qkv_scales(scales)
    samples = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=3), images=images)
    batch = build_train_batch(samples, torch.ones(len(samples)), 2, tok.pad_id)
    mask = batch.loss_mask.bool()
    got, want = trainer.compute_logprobs(batch)[mask], batch.gen_logprobs[mask]
    assert got.numel() > 10 and torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} differ"


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_the_rollout_is_bitwise_the_trainer_on_image_prompts(kind, tmp_path):
    """fp8_e2e + FP8 KV + batch invariance on a Qwen2.5-VL policy: the rollout encodes each prompt's images once,
    prefills them with their multimodal positions and decodes the text after them; the trainer encodes them once
    per step and recomputes the whole rows — the logprobs are equal bit for bit (prompts with two images, one, none;
    engine batches that cut a group). Negative control: the trainer given the other prompt's images (same grids)
    differs. The step trains the language model and leaves the frozen encoder bitwise as it was."""
    from fp8rl.engines.base import SamplingParams
    from fp8rl.engines.batch import build_train_batch
    from fp8rl.engines.calibrator import QKVCalibrator
    from fp8rl.engines.torch_rollout import TorchRolloutEngine
    from fp8rl.engines.torch_trainer import TorchTrainer, TrainerConfig
    from fp8rl.fp8 import recipe_for_role

    _checkpoint(kind, tmp_path)
    model, cfg = load_hf_checkpoint(tmp_path)
    tok = CharTokenizer()
    rr = recipe_for_role("fp8_e2e", "rollout", kv_cache_dtype="fp8", batch_invariant=True)
    tr = recipe_for_role("fp8_e2e", "trainer", kv_cache_dtype="fp8", batch_invariant=True)
    engine = TorchRolloutEngine(model, rr, eos_token_ids=[tok.eos_id], pad_token_id=tok.pad_id, max_batch_size=3)
    trainer = TorchTrainer(model, tr, TrainerConfig(micro_batch_size=4, lr=1e-2, share_prefix=True))
    prompts, images = _vl_prompts(cfg, [[(60, 90), (40, 40)], [], [(60, 90), (40, 40)]], [4, 7, 2])
    scales = QKVCalibrator(model, pad_token_id=tok.pad_id).calibrate(0, prompts)
    engine.load_scales(scales)
    trainer.load_qkv_scales(scales)
    samples = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=5), images=images)
    assert [s.images is images[s.prompt_index] for s in samples] == [True] * 6
    batch = build_train_batch(samples, torch.tensor([(-1.0) ** i for i in range(len(samples))]), 2, tok.pad_id)
    mask = batch.loss_mask.bool()
    got, want = trainer.compute_logprobs(batch)[mask], batch.gen_logprobs[mask]
    assert got.numel() > 20 and torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} differ"

    swapped = [images[2 - s.prompt_index] if s.images is not None else None for s in samples]
    other = trainer.compute_logprobs(dataclasses.replace(batch, prev_logprobs=None, images=swapped))[mask]
    assert not torch.equal(other, want)

    vision = {n: p.detach().clone() for n, p in trainer.model.visual.named_parameters()}
    text = trainer.model.model.layers[0].mlp.down_proj.weight.detach().clone()
    assert trainer.train_step(batch)["grad_norm"] > 0
    assert all(torch.equal(p, vision[n]) for n, p in trainer.model.visual.named_parameters())
    assert not torch.equal(trainer.model.model.layers[0].mlp.down_proj.weight, text)


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_decode_after_images_is_bitwise_the_full_forward_even_through_a_sampled_image_token(kind, tmp_path):
    """Under batch invariance, the rollout's way — prefill the image prompts at their multimodal positions, then
    decode each token at its index shifted by the row's delta — gives the full forward's logits bit for bit; a
    response token that is the image token is text on both paths (the row's images are spent)."""
    from fp8rl.model import KVCache
    from fp8rl.model.mrope import mrope_positions
    from fp8rl.model.vision import ImageBatch

    _checkpoint(kind, tmp_path)
    model, cfg = load_hf_checkpoint(tmp_path)
    model.enable_batch_invariance()
    prompts, images = _vl_prompts(cfg, [[(60, 90)], [], [(40, 40), (30, 60)]], [4, 9, 2])
    response = [5, cfg.image_token_id, 7]
    P, B = max(map(len, prompts)), len(prompts)
    ids = torch.zeros(B, P + len(response), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p + response)
        mask[b, P - len(p):] = 1
    batch = ImageBatch.concat(images)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, images=batch)
        pos, delta = mrope_positions(ids[:, :P], mask[:, :P], batch.grid_thw, cfg.image_token_id, model.visual.merge,
                                     batch.rows)
        cache = KVCache.for_model(model, B, ids.shape[1])
        steps = [model(ids[:, :P], attention_mask=mask[:, :P], kv_cache=cache, position_ids=pos, images=batch,
                       logits_to_keep=1)[:, -1]]
        for t in range(len(response)):
            step_pos = (mask[:, :P + t + 1].sum(-1) - 1 + delta)[:, None]
            steps.append(model(ids[:, P + t:P + t + 1], attention_mask=mask[:, :P + t + 1], kv_cache=cache,
                               position_ids=step_pos, logits_to_keep=1)[:, -1])
    for t, got in enumerate(steps):
        assert torch.equal(got, full[:, P - 1 + t]), t


@pytest.mark.parametrize("train_encoder", [False, True])
def test_the_loop_trains_a_vlm_on_pictures_exactly(tmp_path, monkeypatch, train_encoder):
    """The in-process GRPO loop on a Qwen2.5-VL checkpoint with ``data.task: shapes`` (a generated picture per
    prompt): fp8_e2e, FP8 KV calibrated on the multimodal sequences, batch invariance — every step's rollout and
    trainer logprobs are equal (max |Δlogprob| 0), the validation runs on pictures too, and the exported policy's
    encoder is the start's (frozen) or moved (``train_vision_encoder``: the rollout then samples with the trained
    encoder, or step 2 would not be exact)."""
    from fp8rl.config import JobConfig
    from fp8rl.loop import LoopConfig, run
    from fp8rl.model.vision import VisionEncoder
    from fp8rl.rl.metrics import MAX_ABS_LOGPROB_DIFF

    encoded = []  # the pictures the encoder saw: each step's prompts, in the rollout, the trainer and the calibrator
    forward = VisionEncoder.forward
    monkeypatch.setattr(VisionEncoder, "forward", lambda self, images: encoded.append(images) or forward(self, images))
    _checkpoint("qwen2_5_vl", tmp_path / "vl")
    job = JobConfig().with_settings({"data.task": "shapes", "policy.training.train_vision_encoder": train_encoder})
    out = run(LoopConfig.from_flags(job=job, model=str(tmp_path / "vl"), recipe="fp8_e2e", kv_cache_dtype="fp8",
                                    batch_invariant=True, steps=3, prompts_per_step=3, group_size=2, max_tokens=4,
                                    micro_batch_size=3, calibration_max_sequences=4, eval_size=2, seed=0, lr=1e-2,
                                    out_dir=str(tmp_path / "run")), progress=False)
    assert [h[MAX_ABS_LOGPROB_DIFF] for h in out["steps"]] == [0.0, 0.0, 0.0]
    before, after = load_file(tmp_path / "vl" / "model.safetensors"), \
        load_file(next((tmp_path / "run").rglob("policy/model.safetensors")))
    moved = [n for n in before if n.startswith("visual.") and not torch.equal(before[n], after[n].to(before[n].dtype))]
    assert bool(moved) == train_encoder, moved[:3]
    report = next((tmp_path / "run").rglob("pictures.md")).read_text()  # the report shows pictures and answers
    assert "![picture 0-0](pictures/0-0.png)" in report and "reference `" in report and "sampled `" in report
    if train_encoder:  # the run's trainer checkpoint exports as the whole VLM, as the loop's own export wrote it
        from fp8rl.export import export_checkpoint

        export_checkpoint(sorted((tmp_path / "run").rglob("*.pt"))[-1], tmp_path / "export", progress=False)
        again = load_file(tmp_path / "export" / "model.safetensors")
        assert set(again) == set(after) and all(torch.equal(again[n], after[n]) for n in again)
    # per step: 3 prompts encoded once by the rollout, once by the trainer, plus the calibrator's batches
    assert len(encoded) >= 2 * (3 + 3) and all(int(i.grid_thw.shape[0]) >= 1 for i in encoded)


def test_a_picture_task_needs_a_vision_language_policy():
    from fp8rl.config import ConfigError, JobConfig
    from fp8rl.controller.plan import JobPlan

    with pytest.raises(ConfigError, match="data.task: shapes is a picture task"):
        JobPlan("j", JobConfig().with_settings({"data.task": "shapes"}))


def _shapes_parquet(path, problems, bad_row: int | None = None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": p.prompt, "answer": p.answer, "images": [{"bytes": b, "path": None} for b in p.images]}
            for p in problems]
    if bad_row is not None:
        rows[bad_row]["images"] = [{"bytes": b"\x89PNG not really", "path": None}]
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_a_parquet_file_of_pictures_trains_and_a_bad_picture_is_refused_by_its_problem(tmp_path):
    """verl's layout — an ``images`` column of ``{bytes, path}`` structs beside a prompt with ``<image>`` — read from
    Parquet: the loop trains on it exactly; a row whose image does not decode stops the job before it runs, naming
    the problem."""
    from fp8rl.config import ConfigError, JobConfig
    from fp8rl.controller.plan import JobPlan
    from fp8rl.data.shapes import ShapesDataset
    from fp8rl.loop import LoopConfig, run
    from fp8rl.rl.metrics import MAX_ABS_LOGPROB_DIFF

    _checkpoint("qwen2_5_vl", tmp_path / "vl")
    _shapes_parquet(tmp_path / "train.parquet", ShapesDataset(5).batch(0, 8))
    job = JobConfig().with_settings({"data.task": "dataset", "data.path": "train.parquet"})
    out = run(LoopConfig.from_flags(job=job, model=str(tmp_path / "vl"), recipe="fp8_e2e", batch_invariant=True,
                                    steps=1, prompts_per_step=4, group_size=2, max_tokens=3, micro_batch_size=8,
                                    eval_size=2, seed=0, data_root=str(tmp_path)), progress=False)
    assert out["steps"][0][MAX_ABS_LOGPROB_DIFF] == 0.0

    from fp8rl.data import DataRoot

    _shapes_parquet(tmp_path / "bad.parquet", ShapesDataset(5).batch(0, 8), bad_row=5)
    bad = job.with_settings({"data.path": "bad.parquet", "policy.model": str(tmp_path / "vl")})
    with pytest.raises(ConfigError, match="bad.parquet: problem 5, image 0: not a decodable image"):
        JobPlan("j", bad, DataRoot(tmp_path))


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_a_whole_vlm_saves_under_its_checkpoint_names(kind, tmp_path):
    """Loaded whole and saved again: the same tensor names and values as transformers wrote (Qwen3-VL's
    ``model.language_model.*`` / ``model.visual.*`` included), and the export of it loads in transformers."""
    from fp8rl.export import save_policy_hf
    from fp8rl.model import save_hf_checkpoint

    _checkpoint(kind, tmp_path / "src")
    model, cfg = load_hf_checkpoint(tmp_path / "src")
    save_hf_checkpoint(model, cfg, tmp_path / "again")
    before = load_file(tmp_path / "src" / "model.safetensors")
    after = load_file(tmp_path / "again" / "model.safetensors")
    assert set(before) == set(after) and all(torch.equal(before[n], after[n]) for n in before)
    model.name_or_path = str(tmp_path / "src")
    save_policy_hf(model, tmp_path / "src", tmp_path / "out")
    assert set(load_file(tmp_path / "out" / "model.safetensors")) == set(before)
    transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "out")
