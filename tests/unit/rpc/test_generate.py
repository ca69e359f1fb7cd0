"""The committed stubs import cleanly and match a fresh generation from proto/; tampering is caught."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fp8rl.rpc import generate

PROTO_NAMES = ("common", "rollout", "trainer", "weights", "reward", "env", "calibrator", "controller")
SERVICES = {
    "rollout": "RolloutService",
    "trainer": "TrainerService",
    "weights": "WeightStore",
    "reward": "RewardService",
    "env": "EnvService",
    "calibrator": "CalibratorService",
    "controller": "JobService",
}


@pytest.mark.parametrize("name", PROTO_NAMES)
def test_stubs_import_from_fp8rl_rpc(name):
    pb2 = importlib.import_module(f"fp8rl.rpc.{name}_pb2")
    importlib.import_module(f"fp8rl.rpc.{name}_pb2_grpc")
    # Canonical proto names survive the flat layout (reflection and cross-file imports rely on them).
    assert pb2.DESCRIPTOR.name == f"fp8rl/v1/{name}.proto"
    assert pb2.DESCRIPTOR.package == "fp8rl.v1"
    if name in SERVICES:
        assert list(pb2.DESCRIPTOR.services_by_name) == [SERVICES[name]]


def test_cross_file_types_resolve():
    from fp8rl.rpc import calibrator_pb2, common_pb2, trainer_pb2

    resp = trainer_pb2.TrainStepResponse(new_version=4, phase_times=common_pb2.PhaseTimes(train=1.5))
    assert trainer_pb2.TrainStepResponse.FromString(resp.SerializeToString()).phase_times.train == 1.5
    req = calibrator_pb2.CalibrateRequest(version=4, sequences=[common_pb2.TokenSequence(token_ids=[1, 2])])
    assert list(calibrator_pb2.CalibrateRequest.FromString(req.SerializeToString()).sequences[0].token_ids) == [1, 2]


def test_calibrate_response_carries_the_one_scale_wire_format():
    from fp8rl.fp8 import QKVScales
    from fp8rl.refit import decode_scales, encode_scales
    from fp8rl.rpc import calibrator_pb2, common_pb2

    assert not hasattr(common_pb2, "QKVScaleSet")  # no second encoding of a scale set
    s = QKVScales(4, [0.5], [1.0], [2.0])
    resp = calibrator_pb2.CalibrateResponse(version=4, scales=encode_scales(s), seconds=0.25)
    back = calibrator_pb2.CalibrateResponse.FromString(resp.SerializeToString())
    assert back.scales == encode_scales(s) and decode_scales(back.scales, back.version) == s


def test_committed_stubs_are_fresh_cli():
    proc = subprocess.run(
        [sys.executable, "-m", "fp8rl.rpc.generate", "--check"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


@pytest.fixture
def stub_copy(tmp_path) -> Path:
    """A throwaway copy of the committed stubs (the real ones are never touched)."""
    out = tmp_path / "rpc"
    out.mkdir()
    for p in generate.RPC_DIR.iterdir():
        if p.name.endswith((".py", ".pyi")):
            shutil.copy2(p, out / p.name)
    assert generate.stale_files(out_dir=out) == []
    return out


def test_check_flags_an_edited_stub(stub_copy):
    target = stub_copy / "reward_pb2.py"
    target.write_text(target.read_text() + "\n# hand edit\n")
    assert generate.stale_files(out_dir=stub_copy) == ["reward_pb2.py"]

    proc = subprocess.run(
        [sys.executable, "-m", "fp8rl.rpc.generate", "--check", "--out", str(stub_copy)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "reward_pb2.py" in proc.stderr and "make proto" in proc.stderr


def test_check_flags_missing_and_leftover_stubs(stub_copy):
    (stub_copy / "rollout_pb2_grpc.py").unlink()
    (stub_copy / "removed_pb2.py").write_text("# from a proto that no longer exists\n")
    assert generate.stale_files(out_dir=stub_copy) == ["removed_pb2.py", "rollout_pb2_grpc.py"]

    generate.write(generate.render(), stub_copy)
    assert generate.stale_files(out_dir=stub_copy) == []
    assert not (stub_copy / "removed_pb2.py").exists()


def test_check_flags_an_edited_proto(tmp_path, stub_copy):
    protos = tmp_path / "proto"
    shutil.copytree(generate.PROTO_ROOT, protos)
    reward = protos / "fp8rl" / "v1" / "reward.proto"
    text = reward.read_text()
    reward.write_text(text.replace("  string grader = 3;", "  string grader = 3;\n  // New.\n  float weight = 4;"))
    assert generate.stale_files(protos, stub_copy) == ["reward_pb2.py", "reward_pb2.pyi"]


def test_generation_is_deterministic():
    assert generate.render() == generate.render()
