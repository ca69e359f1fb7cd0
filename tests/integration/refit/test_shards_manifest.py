"""Shard format, manifest JSON and build_shards/assemble round trips (no Redis needed, but part of refit)."""

from __future__ import annotations

import json

import pytest
import torch

from fp8rl.fp8 import E4M3, Fp8Recipe, dequantize_blockwise, fp8_linear_names, quantize_state_dict
from fp8rl.model import CausalLM, ModelConfig
from fp8rl.refit import (
    CorruptShardError,
    Keys,
    Manifest,
    TensorEntry,
    assemble,
    build_shards,
    pack_tensors,
    unpack_tensors,
)
from fp8rl.refit.scales import decode_scales, encode_scales

pytestmark = pytest.mark.integration

FP8_BYTES_RATIO_MAX = 0.52  # E4M3 is half of BF16; block scales + BF16 embeddings/norms add ~1.3% here


def tiny_model_state() -> tuple[dict[str, torch.Tensor], list[str]]:
    """BF16 state dict of a 2-layer Llama whose linears dominate, plus an FP32 and an int64 extra."""
    torch.manual_seed(0)
    cfg = ModelConfig(architecture="llama", vocab_size=32, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4)
    model = CausalLM(cfg)
    prefixes = fp8_linear_names(model, Fp8Recipe())
    sd = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    sd["model.extra_fp32"] = torch.randn(3, 5)
    sd["model.step_counter"] = torch.tensor([7, -1], dtype=torch.int64)
    return sd, prefixes


def test_fp8_round_trip_matches_quantizer_and_halves_bytes():
    sd, prefixes = tiny_model_state()
    m8, shards8 = build_shards(sd, 3, job="j1", recipe="fp8_e2e", endpoint="trainer-0:50051", fp8_prefixes=prefixes)
    m16, _ = build_shards(sd, 3, job="j1", recipe="bf16", endpoint="trainer-0:50051")
    assert m8.total_bytes <= FP8_BYTES_RATIO_MAX * m16.total_bytes, (m8.total_bytes, m16.total_bytes)

    out = assemble(m8, shards8)
    expected = quantize_state_dict(sd, prefixes)
    assert set(out) == set(expected)
    for name, t in expected.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape, name
        if t.dtype == E4M3:  # bit-identical E4M3 bytes: trainer and rollout see the same weights
            assert torch.equal(out[name].view(torch.uint8), t.view(torch.uint8)), name
        else:
            assert torch.equal(out[name], t), name
    # Passed through in their own dtype; FP8 pairs carry their 128x128 block size.
    assert out["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert out["model.extra_fp32"].dtype == torch.float32 and out["model.step_counter"].tolist() == [7, -1]
    q_name = "model.layers.0.self_attn.q_proj"
    assert m8.entry(f"{q_name}.weight").block_size == (128, 128)
    assert m8.entry(f"{q_name}.weight_scale").block_size == (128, 128)
    assert m8.entry("model.norm.weight").block_size is None
    deq = dequantize_blockwise(out[f"{q_name}.weight"], out[f"{q_name}.weight_scale"])
    ref = sd[f"{q_name}.weight"].float()
    assert (deq - ref).abs().max() <= ref.abs().max() * 2**-4  # half an E4M3 ulp of the block amax


def test_small_shards_split_large_tensors_and_round_trip():
    sd, prefixes = tiny_model_state()
    limit = 20_000  # smaller than a 256x128 E4M3 weight (32768 bytes): it must span shards
    m, shards = build_shards(sd, 1, job="j1", recipe="fp8_e2e", endpoint="", fp8_prefixes=prefixes, shard_bytes=limit)
    assert len(shards) > 3 and all(len(s) <= limit for s in shards)
    assert m.shard_sizes == tuple(len(s) for s in shards)
    out = assemble(m, shards)
    expected = quantize_state_dict(sd, prefixes)
    for name, t in expected.items():
        assert torch.equal(out[name].view(torch.uint8) if t.dtype == E4M3 else out[name],
                           t.view(torch.uint8) if t.dtype == E4M3 else t), name


def test_scalar_empty_and_all_dtypes_round_trip():
    tensors = {
        "a": torch.tensor(1.5, dtype=torch.float32),
        "b": torch.zeros(0, 4, dtype=torch.bfloat16),
        "c": torch.randn(3, 4, dtype=torch.float16),
        "d": torch.randn(5).to(E4M3),
        "e": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "f": torch.randn(4, 6).t(),  # non-contiguous input
    }
    entries, shards = pack_tensors(tensors, shard_bytes=16)
    out = unpack_tensors(entries, shards)
    for k, t in tensors.items():
        assert out[k].shape == t.shape and out[k].dtype == t.dtype
        assert torch.equal(out[k].view(torch.uint8) if t.dtype == E4M3 else out[k],
                           t.view(torch.uint8) if t.dtype == E4M3 else t), k


def test_unsupported_dtype_and_nan_are_refused_before_anything_is_built():
    with pytest.raises(ValueError, match="'x'.*int16"):
        pack_tensors({"x": torch.zeros(2, dtype=torch.int16)})
    sd, prefixes = tiny_model_state()
    sd["model.layers.1.mlp.up_proj.weight"][3, 4] = float("nan")
    with pytest.raises(ValueError, match=r"version 5.*'model\.layers\.1\.mlp\.up_proj\.weight'.*NaN"):
        build_shards(sd, 5, job="j1", recipe="fp8_e2e", endpoint="", fp8_prefixes=prefixes)
    sd["model.layers.1.mlp.up_proj.weight"][3, 4] = 0.0
    sd["model.norm.weight"][0] = float("inf")  # a pass-through BF16 tensor is checked too
    with pytest.raises(ValueError, match="'model.norm.weight'"):
        build_shards(sd, 5, job="j1", recipe="bf16", endpoint="")


def test_corruption_is_named_by_tensor_and_shard():
    tensors = {"w0": torch.randn(8, 8), "w1": torch.randn(8, 8), "w2": torch.randn(8, 8)}  # 256 B each
    entries, shards = pack_tensors(tensors, shard_bytes=512)
    assert [e.shard for e in entries] == [0, 0, 1]
    bad = bytearray(shards[1])
    bad[17] ^= 0x01
    with pytest.raises(CorruptShardError, match="'w2' in shard 1 failed its checksum") as ei:
        unpack_tensors(entries, [shards[0], bytes(bad)])
    assert (ei.value.tensor, ei.value.shard) == ("w2", 1)
    with pytest.raises(CorruptShardError, match="shard 1 is 255 bytes") as ei:
        unpack_tensors(entries, [shards[0], shards[1][:-1]], [len(s) for s in shards])
    assert ei.value.shard == 1
    e = entries[1].to_dict()
    with pytest.raises(CorruptShardError, match="'w1'.*unknown dtype 'float64'") as ei:
        TensorEntry.from_dict({**e, "dtype": "float64"})
    assert (ei.value.tensor, ei.value.shard) == ("w1", 0)
    with pytest.raises(CorruptShardError, match="'w1'.*declares 255 bytes"):
        TensorEntry.from_dict({**e, "nbytes": 255})
    wrong_shape = TensorEntry(**{**e, "shape": (4, 8), "nbytes": 128, "block_size": None})
    with pytest.raises(CorruptShardError, match="'w1'"):
        unpack_tensors([entries[0], wrong_shape, entries[2]], shards)


def test_manifest_json_is_strict():
    sd, prefixes = tiny_model_state()
    m, _ = build_shards(sd, 2, job="j1", recipe="fp8_e2e", endpoint="10.0.0.7:50051", fp8_prefixes=prefixes)
    assert Manifest.from_json_bytes(m.to_json_bytes()) == m
    d = json.loads(m.to_json_bytes())
    for bad in (
        {**d, "surprise": 1},
        {k: v for k, v in d.items() if k != "recipe"},
        {**d, "version": "2"},
        {**d, "version": True},
        {**d, "shard_sizes": [str(s) for s in d["shard_sizes"]]},
        {**d, "total_bytes": d["total_bytes"] + 1},
        {**d, "endpoint": "no-port"},
        {**d, "format": 1},
        {**d, "shm": {"dir": "relative/path", "host": "h"}},
        {**d, "shm": {"dir": "/dev/shm/x", "host": "h", "extra": "1"}},
        {**d, "collective": "no-port"},
        {**d, "base": d["version"]},
        {**d, "tensors": [{**d["tensors"][0], "extra": 0}] + d["tensors"][1:]},
        {**d, "tensors": [{**d["tensors"][0], "shape": "256x256"}] + d["tensors"][1:]},
        {**d, "job": "bad job"},
    ):
        with pytest.raises(ValueError):
            Manifest.from_json_bytes(json.dumps(bad).encode())
    for garbage in (b"", b"[1, 2]", b"\xff\xfe", b"{"):
        with pytest.raises(ValueError):
            Manifest.from_json_bytes(garbage)


def test_keys_are_namespaced_and_validated():
    k = Keys("job-1")
    assert k.latest() == "fp8rl:job-1:weights:latest"
    assert k.manifest(4) == "fp8rl:job-1:weights:4:manifest"
    assert k.acks(4) == "fp8rl:job-1:weights:4:acks"
    assert k.scales(4) == "fp8rl:job-1:scales:4"
    assert k.events() == "fp8rl:job-1:events"
    assert k.replica("r0") == "fp8rl:job-1:replicas:r0"
    assert (k.job_state(), k.job_step(), k.job_config()) == (
        "fp8rl:job-1:job:state", "fp8rl:job-1:job:step", "fp8rl:job-1:job:config")
    assert Keys.jobs_index() == "fp8rl:jobs"
    for bad in ("", "a:b", "a*", "a b", "-x", "x" * 65, None):
        with pytest.raises(ValueError, match="invalid job id"):
            Keys(bad)  # type: ignore[arg-type]
    for bad_v in (-1, True, 1.0, "3"):
        with pytest.raises(ValueError, match="version"):
            k.manifest(bad_v)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="invalid replica id"):
        k.replica("r:0")


def test_scales_payload_is_tied_to_its_version():
    from fp8rl.fp8 import QKVScales

    s = QKVScales(4, [0.1, 0.2], [0.3, 0.4], [0.5, 0.6])
    data = encode_scales(s)
    assert decode_scales(data, 4) == s
    with pytest.raises(ValueError, match="calibrated on version 4"):
        decode_scales(data, 5)
    with pytest.raises(ValueError, match="malformed"):
        decode_scales(data[:-1], 4)


def test_scales_wire_layout_and_every_refusal():
    import struct

    from fp8rl import refit
    from fp8rl.fp8 import QKVScales
    from fp8rl.refit import shards

    assert refit.encode_scales is shards.encode_scales is encode_scales  # one format, old imports still work
    assert refit.decode_scales is shards.decode_scales is decode_scales
    s = QKVScales(7, [0.5, 0.25], [0.125, 1.0], [2.0, 0.75])
    data = encode_scales(s)
    # magic, int64 version, uint32 layers, then (layers, 3) float32 rows (q, k, v), all little-endian
    assert data == struct.pack("<8sqI6f", b"fp8rlqkv", 7, 2, 0.5, 0.125, 2.0, 0.25, 1.0, 0.75)
    assert decode_scales(bytearray(data), 7) == s == decode_scales(memoryview(data), 7, num_layers=2)
    refusals = {
        "must be bytes": ("not bytes", {}),
        "truncated": (data[:10], {}),
        "not a scale set": (b"pickle\x80\x04" + data[8:], {}),
        "malformed": (data + b"\0", {}),
        "cover 2 layers, the model has 3": (data, {"num_layers": 3}),
        "q_scale of layer 1 must be finite": (data[:20 + 12] + struct.pack("<f", float("nan")) + data[20 + 16:], {}),
        "k_scale of layer 0 must be finite": (data[:24] + struct.pack("<f", -1.0) + data[28:], {}),
    }
    for match, (bad, kw) in refusals.items():
        with pytest.raises(ValueError, match=match):
            decode_scales(bad, 7, **kw)
