"""Sequence-classifier reward models (issue 52): a transformers ``*ForSequenceClassification`` checkpoint, built
random-init by transformers and saved, loads into the embedded engine's model with its score head and gives
transformers' logits — each row alone as the reference, ours left-padded in one batch — for Qwen2 and Llama, one
label and several; what is not a classifier checkpoint is refused naming why. Served by :class:`RewardModel`
(bf16 and FP8 linears), its scores are the labels' probabilities of those logits."""

from __future__ import annotations

import json

import pytest
import torch

from fp8rl.config import parse_job_config
from fp8rl.fp8.linear import Fp8InferenceLinear
from fp8rl.model.tokenizer import CharTokenizer
from fp8rl.rewards.classifier import classify, label_scores, load_classifier
from fp8rl.rewards.items import ModelItem
from fp8rl.rewards.model import RewardModel

transformers = pytest.importorskip("transformers")

# FP32 on both sides; the implementations differ in op order only (as for the causal LMs' logits:
# tests/unit/model/test_transformer.py), so a few ulps of O(1) logits.
ATOL_HF = 1e-4

HF = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForSequenceClassification),
      "llama": (transformers.LlamaConfig, transformers.LlamaForSequenceClassification)}


def _classifier(tmp_path, arch: str, num_labels: int):
    """A random-init transformers classifier (its norms and head scrambled) saved with the character tokenizer."""
    cfg_cls, model_cls = HF[arch]
    tok = CharTokenizer()
    cfg = cfg_cls(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, num_labels=num_labels,
                  pad_token_id=tok.pad_id, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                  tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(3)
    ref = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    ref.save_pretrained(tmp_path)
    tok.save(tmp_path)
    return ref, tok


@pytest.mark.parametrize("arch,num_labels", [("qwen2", 1), ("qwen2", 3), ("llama", 2)])
def test_logits_equal_transformers_row_by_row(tmp_path, arch, num_labels):
    ref, tok = _classifier(tmp_path, arch, num_labels)
    ours = load_classifier(tmp_path)
    assert ours.num_labels == num_labels
    g = torch.Generator().manual_seed(7)
    rows = [torch.randint(3, 120, (n,), generator=g).tolist() for n in (5, 17, 9, 1)]
    got = classify(ours, rows, tok.pad_id)  # left-padded, one batch
    with torch.no_grad():
        want = torch.cat([ref(torch.tensor([r])).logits for r in rows])  # each row alone
    assert got.shape == (len(rows), num_labels)
    torch.testing.assert_close(got, want, atol=ATOL_HF, rtol=0)
    scores = label_scores(got, -1)
    expect = torch.sigmoid(want[:, 0].double()) if num_labels == 1 else torch.softmax(want.double(), -1)[:, -1]
    torch.testing.assert_close(scores, expect, atol=ATOL_HF, rtol=0)


def test_what_is_not_a_classifier_checkpoint_is_refused_naming_why(tmp_path):
    _classifier(tmp_path, "qwen2", 2)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(ValueError, match="ForSequenceClassification"):
        load_classifier(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_labels": 5, "id2label": None}))
    with pytest.raises(ValueError, match=r"score.weight has shape \(2, 64\)"):
        load_classifier(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_classifier(tmp_path / "absent")
    with pytest.raises(ValueError, match="positive_label 4"):
        label_scores(torch.zeros(1, 2), 4)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_the_served_classifier_scores_items_by_their_label_probability(tmp_path, precision):
    ref, tok = _classifier(tmp_path, "qwen2", 2)
    job = parse_job_config({"reward": {"model": {"kind": "classifier", "model": str(tmp_path),
                                                 "precision": precision, "positive_label": 1}}})
    rm = RewardModel(job.reward.model)
    try:
        fp8 = any(isinstance(m, Fp8InferenceLinear) for m in rm.net.modules())
        assert fp8 == (precision == "fp8")
        items = [ModelItem("12+3=", "15"), ModelItem("7-2=", "9"), ModelItem("1+1=", "2")]
        got = rm.score(items)
        assert all(s.score is not None and 0.0 <= s.score <= 1.0 and s.error == "" for s in got)
        if precision == "bf16":  # the probability of label 1 of transformers' logits of question + response
            with torch.no_grad():
                want = [torch.softmax(ref(torch.tensor([tok.encode(i.question + i.response)])).logits.double(),
                                      -1)[0, 1].item() for i in items]
            assert [s.score for s in got] == pytest.approx(want, abs=ATOL_HF)
    finally:
        rm.close()
