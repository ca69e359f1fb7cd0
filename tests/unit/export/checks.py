"""One check every export test of a trained checkpoint makes (the 2-rank ``.dcp``, the tensor-parallel Megatron
``.pt``): the exported weights are the trained ones bitwise, and transformers' model on the directory gives fp8rl's
logits within ``ATOL_HF`` while the untrained model is far outside it (so the check can fail)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from fp8rl.export import ExportResult
from fp8rl.model import CausalLM
from tests.unit.model.test_transformer import ATOL_HF


def assert_export_is_the_trained_policy(res: ExportResult, trained: dict[str, torch.Tensor], start: CausalLM) -> None:
    """``res`` (an ``hf`` export) holds ``trained`` (HF names) bitwise; transformers' logits on it equal fp8rl's."""
    files = load_file(Path(res.out) / "model.safetensors")
    assert set(files) == set(trained) and all(torch.equal(files[k], trained[k]) for k in trained)  # bitwise
    ours = CausalLM(start.config).eval()
    ours.load_state_dict(trained)
    ids = torch.randint(3, 128, (3, 20), generator=torch.Generator().manual_seed(0))
    hf = AutoModelForCausalLM.from_pretrained(res.out, attn_implementation="eager").eval()
    with torch.no_grad():
        got = hf(ids).logits.float()
        torch.testing.assert_close(got, ours(ids), atol=ATOL_HF, rtol=0)
        assert (start.eval()(ids) - got).abs().max() > 100 * ATOL_HF  # the training steps moved it
