"""Export from the Megatron backend's checkpoint written by 2 tensor-parallel ranks: transformers' logits equal
fp8rl's.

The Megatron backend saves whole tensors in the TP = PP = 1 Megatron layout (fused ``linear_qkv`` grouped by KV
head, ``linear_fc1`` = [gate; up]) whatever its parallel layout; the export turns them into HF names and layout. The
reference is what the trainer itself publishes (``MegatronTrainer.state_dict``: gathered across the ranks and
converted by the trainer), which rank 0 of ``tests/distributed/rank_worker.py`` writes beside the checkpoint. The
tolerance is the model tests' ``ATOL_HF``; the negative case is the untrained model, far outside it.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from fp8rl.export import export_checkpoint, read_checkpoint
from fp8rl.fp8 import quantize_blockwise
from fp8rl.model import save_hf_checkpoint
from fp8rl.model.tokenizer import CharTokenizer
from tests.distributed.rank_worker import policy
from tests.distributed.test_trainer_ranks import torchrun
from tests.unit.export.checks import assert_export_is_the_trained_policy

pytestmark = pytest.mark.megatron  # make test-megatron

ALIGNED = dict(num_key_value_heads=4)  # each of 2 ranks holds 128-row slices of q/k/v, gate/up (FP8 blocks whole)


def test_export_from_a_tensor_parallel_megatron_checkpoint(megatron_core, tmp_path):
    ck = tmp_path / "ck" / "trainer-v000001.pt"
    saved = torchrun(tmp_path, 2, "save", backend="megatron", recipe="fp8_e2e", micro_batch_size=3, rows=10,
                     model=ALIGNED, tp=2, steps=1, path=str(ck))
    assert read_checkpoint(ck).kind == "megatron .pt"
    trained = {k.removeprefix("w/"): v for k, v in saved["state"].items() if k.startswith("w/")}  # HF names
    start = policy(**ALIGNED)
    model = tmp_path / "model"  # built in memory by the worker: the checkpoint records its config, no directory
    save_hf_checkpoint(start, start.config, model)
    CharTokenizer().save(model)

    res = export_checkpoint(ck, tmp_path / "hf", model=str(model), progress=False)
    assert_export_is_the_trained_policy(res, trained, start)

    fp8 = export_checkpoint(ck, tmp_path / "fp8", fmt="hf-fp8", model=str(model), progress=False)
    files = load_file(fp8.out / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj"
    q, s = quantize_blockwise(trained[f"{name}.weight"])  # what the rollout's refit makes of the published weights
    assert torch.equal(files[f"{name}.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(files[f"{name}.weight_scale_inv"], s)
    assert json.loads((fp8.out / "config.json").read_text())["quantization_config"]["modules_to_not_convert"] == \
        ["lm_head"]
