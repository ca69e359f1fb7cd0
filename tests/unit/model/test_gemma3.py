"""Gemma 3 text (issue 49's proof that a family is files only): a ``gemma3_text`` checkpoint made by transformers
loads and gives transformers' logits — sliding windows shorter than the sequence, a RoPE base per layer type, linear
scaling on the global layers, (1 + w) norms before and after attention and MLP, scaled tied embeddings, GeGLU,
QK-norm, ``query_pre_attn_scalar`` —; decode through the KV cache equals the full forward; the rollout and the
trainer agree bitwise under fp8_e2e + FP8 KV + batch invariance; the loop trains it exactly; what it cannot run is
refused by name.

transformers' ``Gemma3ForCausalLM`` is the reference (random-init, its norm weights randomized: they are zero at
init, which would hide a ``w`` used for ``1 + w``); nothing downloads.
"""

from __future__ import annotations

import json

import pytest
import torch

from fp8rl.engines.base import SamplingParams
from fp8rl.engines.batch import build_train_batch
from fp8rl.engines.calibrator import QKVCalibrator
from fp8rl.engines.torch_rollout import TorchRolloutEngine
from fp8rl.engines.torch_trainer import TorchTrainer, TrainerConfig
from fp8rl.fp8 import Fp8Linear, recipe_for_role
from fp8rl.model import KVCache, ModelConfig, load_hf_checkpoint, save_hf_checkpoint
from fp8rl.model.family import get_family

from .test_transformer import ATOL_CACHE, ATOL_HF

transformers = pytest.importorskip("transformers")

WINDOW = 5  # keys a sliding layer sees: shorter than every sequence below
TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def _reference(vocab=128, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = transformers.Gemma3TextConfig(**{
        "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "sliding_window": WINDOW,
        "query_pre_attn_scalar": 24, "max_position_embeddings": 128, "layer_types": TYPES,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
        "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, **kw})
    ref = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n.endswith("norm.weight"):
                p.normal_(0, 0.3)
    return ref


def _load(ref, tmp_path):
    ref.save_pretrained(tmp_path / "hf")
    model, cfg = load_hf_checkpoint(tmp_path / "hf")
    return model.eval(), cfg


def test_logits_equal_transformers_with_windows_shorter_than_the_sequence(tmp_path):
    ref = _reference()
    model, cfg = _load(ref, tmp_path)
    assert cfg.layer_types == tuple(TYPES) and cfg.sliding_window == WINDOW and cfg.tie_word_embeddings
    assert cfg.rope_linear_factor == 2.0 and cfg.rope_theta == 50000.0 and cfg.rope_local_base_freq == 1000.0
    assert model.lm_head.weight is model.model.embed_tokens.weight
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (3, 17), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :6] = 0  # left padding: the window counts from the row's first real token
    with torch.no_grad():
        want, got = ref(ids).logits, model(ids)
        want_pad, got_pad = ref(ids, attention_mask=mask).logits, model(ids, attention_mask=mask)
    torch.testing.assert_close(got, want, atol=ATOL_HF, rtol=0)
    torch.testing.assert_close(got_pad[mask.bool()], want_pad[mask.bool()], atol=ATOL_HF, rtol=0)
    model.enable_batch_invariance()  # split-KV attention: the window in its key layout, not in an additive mask
    with torch.no_grad():
        got_inv = model(ids, attention_mask=mask)
    torch.testing.assert_close(got_inv[mask.bool()], want_pad[mask.bool()], atol=ATOL_HF, rtol=0)
    model.set_batch_invariance(None)
    # and back: fp8rl's save is transformers' checkpoint
    save_hf_checkpoint(model, cfg, tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["architectures"] == ["Gemma3ForCausalLM"] and written["layer_types"] == TYPES
    again = transformers.Gemma3ForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, want, atol=ATOL_HF, rtol=0)


def test_each_gemma_piece_shows_in_the_logits(tmp_path):
    """Negative controls: without the window, or with one RoPE table for both layer types, the logits leave
    transformers' by far more than the tolerance."""
    ref = _reference()
    model, cfg = _load(ref, tmp_path)
    ids = torch.randint(3, 128, (2, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(ids).logits
        torch.testing.assert_close(model(ids), want, atol=ATOL_HF, rtol=0)
        windows = [layer.self_attn.window for layer in model.model.layers]
        for layer in model.model.layers:
            layer.self_attn.window = None
        assert float((model(ids) - want).abs().max()) > 100 * ATOL_HF
        for layer, w in zip(model.model.layers, windows, strict=True):
            layer.self_attn.window = w
        model._inv_freqs["sliding_attention"] = model._inv_freqs["full_attention"]
        model._inv_freq_by_device.clear()
        assert float((model(ids) - want).abs().max()) > 100 * ATOL_HF


def test_decode_through_the_cache_equals_the_full_forward(tmp_path):
    model, _ = _load(_reference(), tmp_path)
    ids = torch.randint(3, 128, (2, 15), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache.for_model(model, batch_size=2, max_len=15)
        steps = [model(ids[:, :4], kv_cache=cache)]
        steps += [model(ids[:, t:t + 1], kv_cache=cache) for t in range(4, 15)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=ATOL_CACHE, rtol=0)


def test_rollout_is_bitwise_the_trainer_in_fp8_with_an_fp8_cache(tmp_path):
    """fp8_e2e + FP8 KV (calibrated scales) + batch invariance: the rollout decodes past the window through the E4M3
    cache, the trainer recomputes the whole sequences with the window in its mask; the logprobs are equal bit for
    bit, and every projection (GeGLU's included) is FP8."""
    model, _ = _load(_reference(), tmp_path)
    rr = recipe_for_role("fp8_e2e", "rollout", kv_cache_dtype="fp8", batch_invariant=True)
    tr = recipe_for_role("fp8_e2e", "trainer", kv_cache_dtype="fp8", batch_invariant=True)
    engine = TorchRolloutEngine(model, rr, eos_token_ids=[1], max_batch_size=3)
    trainer = TorchTrainer(model, tr, TrainerConfig(micro_batch_size=5, lr=1e-2, share_prefix=True))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (2, 9, 5, 14)]
    scales = QKVCalibrator(model, pad_token_id=0).calibrate(0, prompts)
    engine.load_scales(scales)
    trainer.load_qkv_scales(scales)
    samples = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=12, n=2, seed=5))
    batch = build_train_batch(samples, torch.tensor([(-1.0) ** i for i in range(len(samples))]), 2, 0)
    mask = batch.loss_mask.bool()
    got, want = trainer.compute_logprobs(batch)[mask], batch.gen_logprobs[mask]
    assert got.numel() > 40 and int(batch.attention_mask.sum(-1).max()) > 2 * WINDOW
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} logprobs differ"
    fp8 = {n.rsplit(".", 1)[-1] for n, m in trainer.model.named_modules() if isinstance(m, Fp8Linear)}
    assert fp8 == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert trainer.train_step(batch)["grad_norm"] > 0


def test_the_loop_trains_gemma_exactly(tmp_path):
    """The in-process GRPO loop on a Gemma 3 checkpoint (fp8_e2e, FP8 KV recalibrated every step, batch
    invariance): every step's rollout and trainer logprobs are equal (max |Δlogprob| 0)."""
    from fp8rl.loop import LoopConfig, run
    from fp8rl.model.tokenizer import CharTokenizer
    from fp8rl.rl.metrics import MAX_ABS_LOGPROB_DIFF

    tok = CharTokenizer()
    ref = _reference(pad_token_id=tok.pad_id, eos_token_id=tok.eos_id, bos_token_id=tok.bos_id)
    ref.save_pretrained(tmp_path)
    tok.save(tmp_path)
    steps = run(LoopConfig.from_flags(model=str(tmp_path), recipe="fp8_e2e", kv_cache_dtype="fp8",
                                      batch_invariant=True, steps=2, prompts_per_step=3, group_size=2, max_tokens=6,
                                      micro_batch_size=6, calibration_max_sequences=4, eval_size=2, seed=0),
                progress=False)["steps"]
    assert len(steps) == 2
    assert [h[MAX_ABS_LOGPROB_DIFF] for h in steps] == [0.0, 0.0]


def test_what_gemma_cannot_run_is_refused_by_name(tmp_path):
    fam = get_family("gemma3_text")
    assert fam.refusal("torch") is None
    for engine in ("vllm", "megatron"):
        with pytest.raises(ValueError, match=f"gemma3_text models do not run on the {engine} engine"):
            fam.require(engine)
    ref = _reference()
    ref.save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    for key, value, match in [("final_logit_softcapping", 30.0, "final_logit_softcapping=30.0"),
                              ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
                              ("use_bidirectional_attention", True, "bidirectional"),
                              ("hidden_activation", "gelu", "hidden_activation 'gelu'"),
                              ("layer_types", ["sliding_attention"], "layer_types must name")]:
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf_dict({**d, key: value})
    with pytest.raises(ValueError, match="build it with that class"):
        ModelConfig("gemma3_text", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                    num_attention_heads=1)
