"""The trainer's rank group, the parts that need no second process: the dp_size check, the command header's
validation, the megatron refusal, and .dcp checkpoints in the checkpoint directory (the group itself runs in
``make test-distributed``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fp8rl.config import JobConfig
from fp8rl.engines import make_trainer_backend
from fp8rl.engines.parallel import group_for
from services.trainer.checkpoints import CheckpointDir, resolve_checkpoint
from services.trainer.ranks import MAX_HEADER_BYTES, GroupFailure, decode_header


def test_dp_size_must_match_the_world_torchrun_started(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"policy.training.dp_size is 2, but this trainer runs as 1 rank.*torchrun "
                                         r"--nproc-per-node 2"):
        group_for(2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"dp_size is 2, but this trainer runs as 4 rank.*dp_size: 4"):
        group_for(2)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert group_for(1) is None


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_a_backend_without_its_group_of_dp_size_ranks_is_refused_naming_the_key(backend):
    job = JobConfig().with_settings({"policy.training.backend": backend, "policy.training.dp_size": 2})
    with pytest.raises(ValueError, match=r"policy.training.dp_size: 2 \(x 1 model-parallel\) needs a group of 2 "
                                         "ranks, but this trainer is given 1"):
        make_trainer_backend(job, None)


def test_tensor_parallel_ranks_multiply_the_group_torchrun_must_start(monkeypatch):
    job = JobConfig().with_settings({"policy.training.backend": "megatron", "policy.training.dp_size": 2,
                                     "policy.training.megatron_cfg.tensor_model_parallel_size": 2})
    assert (job.trainer_model_parallel, job.trainer_ranks) == (2, 4)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"dp_size \(2\) x megatron_cfg tensor_model_parallel_size x "
                                         r"pipeline_model_parallel_size \(2\) is 4, but this trainer runs as 2"):
        group_for(job.policy.training.dp_size, job.trainer_model_parallel)


def _header(**kw) -> bytes:
    return json.dumps({"op": "train", "args": {}, "tensors": [["input_ids", "int64", [2, 3]]], **kw}).encode()


def test_a_good_header_decodes():
    op, args, shapes = decode_header(_header())
    assert (op, args) == ("train", {}) and [(n, str(d), s) for n, d, s in shapes] == [("input_ids", "torch.int64",
                                                                                       [2, 3])]


@pytest.mark.parametrize("raw,why", [
    (b"\xff\xfe", "malformed"), (b"[1, 2]", "malformed"), (b'{"op": "x"}', "malformed"),
    (_header(op=3), "must be a string"), (_header(tensors=[["x", "object", [1]]]), "dtype 'object'"),
    (_header(tensors=[["x", "int64", [-1]]]), "dimensions are ints >= 0"),
    (_header(tensors=[["x", "int64", [True]]]), "dimensions are ints >= 0"),
    (_header(tensors=[["x", "int64"]]), "malformed"), (b" " * (MAX_HEADER_BYTES + 1), "limit"),
])
def test_a_malformed_header_is_a_group_failure_saying_why(raw, why):
    with pytest.raises(GroupFailure, match=why):
        decode_header(raw)


class _Ranked:
    """A trainer whose checkpoints are .dcp directories (what a trainer over ranks writes)."""

    checkpoint_suffix = ".dcp"

    def __init__(self) -> None:
        self.version = 0

    def save_checkpoint(self, path: str) -> None:
        from pathlib import Path

        Path(path).mkdir()
        (Path(path) / ".metadata").write_bytes(b"m")


def test_sharded_checkpoints_are_saved_pruned_and_resumed_like_files(tmp_path):
    d, tr = CheckpointDir(tmp_path / "ck", keep=2), _Ranked()
    for v in (1, 2, 3):
        tr.version = v
        assert d.save(tr) == f"trainer-v{v:06d}.dcp"
    assert [p.name for p in d.automatic()] == ["trainer-v000002.dcp", "trainer-v000003.dcp"]  # v1 pruned: a dir
    assert resolve_checkpoint(str(d.directory)).name == "trainer-v000003.dcp"  # newest in the directory
    assert resolve_checkpoint(str(d.directory / "trainer-v000002.dcp")).name == "trainer-v000002.dcp"  # itself
    assert d.save(tr, "best") == "best.dcp" and d.named() == {"best.dcp"}


def test_a_rank_group_failure_is_answered_unavailable_so_the_controller_retries():
    """A TrainStep that meets the closing group (a peer died; torchrun restarts it) must be retryable like a call that
    finds the process gone — INTERNAL failed the whole job. The servicer wrapper maps it; other errors stay
    INTERNAL (the negative case)."""
    import grpc

    from services.common.rpc import rpc_method

    class Aborted(Exception):
        pass

    class Context:
        def abort(self, code, message):
            self.code, self.message = code, message
            raise Aborted

    class Servicer:
        @rpc_method
        def TrainStep(self, request, context):
            raise request

    for exc, code in ((GroupFailure("the trainer's rank group is closed (the service is stopping)"),
                       grpc.StatusCode.UNAVAILABLE), (RuntimeError("a bug"), grpc.StatusCode.INTERNAL)):
        ctx = Context()
        with pytest.raises(Aborted):
            Servicer().TrainStep(exc, ctx)
        assert ctx.code == code and str(exc) in ctx.message


def _channel_rank(rank: int, store_path: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from fp8rl.engines.parallel import DataParallel
    from services.trainer.ranks import DTYPES, CommandChannel

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        g = torch.Generator().manual_seed(0)
        sent = {name: (torch.randn(3, 5, generator=g) * 100).to(dtype) for name, dtype in DTYPES.items()}
        sent["routes"] = torch.randint(-1, 8, (2, 4, 1, 2), generator=g).to(torch.int16)  # a batch's routes
        channel = CommandChannel(DataParallel(rank, 2))
        if rank == 0:
            channel.send("train_step", {"k": 1}, sent)
        else:
            op, args, got = channel.recv()
            ok = (op, args) == ("train_step", {"k": 1}) and list(got) == list(sent) and all(
                got[k].dtype == sent[k].dtype and torch.equal(got[k], sent[k]) for k in sent)
            differ = [k for k in sent if not torch.equal(got[k], sent[k])]
            Path(out_path).write_text("ok" if ok else f"differ: {differ}")
    finally:
        dist.destroy_process_group()


def test_the_command_channel_carries_every_dtype_it_accepts_over_gloo(tmp_path):
    """Two real gloo ranks: every dtype the channel's header admits (int16 routes among them, which gloo's broadcast
    refuses as such) arrives bitwise."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = tmp_path / "rank1.txt"
    procs = [ctx.Process(target=_channel_rank, args=(r, str(tmp_path / "store"), str(out))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert out.read_text() == "ok"
