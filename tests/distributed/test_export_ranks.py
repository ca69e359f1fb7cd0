"""Export from a sharded checkpoint written by 2 FSDP2 ranks (``.dcp``): transformers' logits equal fp8rl's.

The checkpoint is the real one: ``tests/distributed/rank_worker.py`` trains 2 steps on 2 torchrun ranks and saves
(every rank its shards); rank 0 also gathers the whole trained weights, which are the reference. The export runs
in this one process (DCP reshards 2 -> 1). The tolerance is the model tests' ``ATOL_HF``; the negative case is the
untrained model, far outside it.
"""

from __future__ import annotations

import pytest
import torch

from fp8rl.export import ExportError, export_checkpoint, load_checkpoint_policy
from fp8rl.model import save_hf_checkpoint
from fp8rl.model.tokenizer import CharTokenizer
from tests.distributed.rank_worker import policy
from tests.distributed.test_trainer_ranks import torchrun
from tests.unit.export.checks import assert_export_is_the_trained_policy

pytestmark = pytest.mark.distributed  # make test-distributed


def test_export_from_a_two_rank_dcp_checkpoint(tmp_path):
    ck = tmp_path / "ck" / "trainer-v000002.dcp"
    saved = torchrun(tmp_path, 2, "save", recipe="fp8_e2e", micro_batch_size=3, rows=10, steps=2, path=str(ck))
    assert sorted(p.name for p in ck.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    trained = {k.removeprefix("w/"): v for k, v in saved["state"].items() if k.startswith("w/")}
    start = policy()
    model = tmp_path / "model"  # the worker's model is built in memory: the checkpoint records no directory
    save_hf_checkpoint(start, start.config, model)
    CharTokenizer().save(model)
    with pytest.raises(ExportError, match="records no model directory .* pass --model"):
        export_checkpoint(ck, tmp_path / "hf", progress=False)

    res = export_checkpoint(ck, tmp_path / "hf", model=str(model), progress=False)
    assert_export_is_the_trained_policy(res, trained, start)
    loaded, _, _ = load_checkpoint_policy(ck, model=str(model))
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in trained.items())
