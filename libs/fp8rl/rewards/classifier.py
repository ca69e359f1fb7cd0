"""Sequence-classification reward models: a transformers ``*ForSequenceClassification`` checkpoint (a decoder whose
score head reads the hidden state of the last token) loaded into the embedded engines' :class:`CausalLM`, its
score head standing in for the LM head.

transformers pools the position of the rightmost token that is not the pad token; :func:`classify` left-pads a
batch, so every row's last position is its last token, and its logits are transformers' of the row alone up to
FP32 summation order (``tests/unit/rewards/test_classifier.py``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from fp8rl.model import CausalLM, ModelConfig
from fp8rl.model.hf_io import CONFIG_FILE, checked_model, load_hf_tensors

__all__ = ["SequenceClassifier", "classify", "label_scores", "left_padded", "load_classifier"]

SUFFIX = "ForSequenceClassification"
SCORE_WEIGHT = "score.weight"


class SequenceClassifier(nn.Module):
    """A :class:`CausalLM` whose ``lm_head`` is the checkpoint's score head (``num_labels`` outputs, no bias)."""

    def __init__(self, lm: CausalLM, score: nn.Linear) -> None:
        super().__init__()
        lm.lm_head = score  # the backbone's forward ends in it: logits over labels instead of the vocabulary
        self.lm = lm

    @property
    def num_labels(self) -> int:
        return self.lm.lm_head.out_features

    @property
    def config(self) -> ModelConfig:
        return self.lm.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``(B, num_labels)`` FP32 logits of the last position of every (left-padded) row."""
        return self.lm(input_ids, attention_mask=attention_mask, logits_to_keep=1)[:, -1]


def load_classifier(path: str | Path, *, dtype: torch.dtype = torch.float32) -> SequenceClassifier:
    """The ``*ForSequenceClassification`` checkpoint in directory ``path``.

    Raises:
        FileNotFoundError: the directory, its ``config.json`` or its weights are missing.
        ValueError: not a sequence-classification checkpoint (its ``architectures`` name another head), no or a
            misshapen ``score.weight``, or the backbone's tensors do not match its config (named).
    """
    path = Path(path)
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in reward model directory {path}")
    d = json.loads(cfg_path.read_text())
    archs = d.get("architectures") or []
    if not any(isinstance(a, str) and a.endswith(SUFFIX) for a in archs):
        raise ValueError(f"reward model {path}: config.json's architectures {archs} name no *{SUFFIX} head (a "
                         f"classifier reward model is a transformers sequence-classification checkpoint)")
    num_labels = d.get("num_labels") or len(d.get("id2label") or {}) or 2  # transformers' default: 2 labels
    # the backbone loads with its LM head tied to the embeddings (no tensor of its own), then takes the score head
    config = dataclasses.replace(ModelConfig.from_hf_dict(d), tie_word_embeddings=True)
    tensors = load_hf_tensors(path)
    score = tensors.pop(SCORE_WEIGHT, None)
    tensors.pop("lm_head.weight", None)
    if score is None:
        raise ValueError(f"reward model {path}: no {SCORE_WEIGHT} tensor (the classification head)")
    if tuple(score.shape) != (num_labels, config.hidden_size):
        raise ValueError(f"reward model {path}: {SCORE_WEIGHT} has shape {tuple(score.shape)}, config.json implies "
                         f"({num_labels}, {config.hidden_size})")
    lm = checked_model(path, config, tensors, dtype)
    head = nn.Linear(config.hidden_size, num_labels, bias=False, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(score)
    return SequenceClassifier(lm, head).eval()


def left_padded(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)``, ``(B, T)`` each: ``sequences`` left-padded with ``pad_id`` into one batch (mask 1 on tokens),
    so every row's last position is its last token."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("a left-padded batch needs non-empty sequences")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, width - len(s):] = torch.tensor(list(s), dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids, mask


def classify(model: nn.Module, sequences: Sequence[Sequence[int]], pad_id: int) -> torch.Tensor:
    """``(B, num_labels)`` logits of ``model`` (a :class:`SequenceClassifier`, FP8-converted or not) on token-id
    ``sequences``, left-padded into one batch."""
    ids, mask = left_padded(sequences, pad_id)
    with torch.inference_mode():
        return model(ids, mask)


def label_scores(logits: torch.Tensor, positive_label: int) -> torch.Tensor:
    """Scores in [0, 1] from ``(B, num_labels)`` logits: the softmax probability of ``positive_label`` (-1: the
    last), or the sigmoid of a one-label head's logit (a Bradley-Terry reward model's)."""
    if logits.shape[-1] == 1:
        return torch.sigmoid(logits[:, 0].double())
    if not -logits.shape[-1] <= positive_label < logits.shape[-1]:
        raise ValueError(f"positive_label {positive_label} is not a label of a {logits.shape[-1]}-label head")
    return torch.softmax(logits.double(), dim=-1)[:, positive_label]
