"""Refit transport and payload, each measured against its baseline in one run.

    python bench/refit.py [--stream-mib 256 --chunk-mib 1 --hidden 1024 --layers 8 --vocab 32000 --repeats 3]

(a) Shard streaming. A real WeightStore (``WeightStoreServicer`` over a ``RefitPublisher``, manifest
in a throwaway ``redis-server``) serves ``--stream-mib`` MiB of BF16 shards on loopback, and
``GrpcShardSource`` pulls every shard, as a rollout replica does. The baseline moves the same shard
bytes over a raw loopback TCP socket (server thread + client, same chunk size, TCP_NODELAY, the
client reads into one preallocated buffer — the most a transport could get here). Prints MB/s of
both and their ratio (target: gRPC ≥ 0.6× raw). Both servers run in a child process and both
clients here, as between a trainer and a replica: with both ends in one process, gRPC's Python
server and client would take turns on one GIL, which the raw socket (GIL released in
``sendall``/``recv_into``) does not pay, and the ratio would measure that instead of the transport.

(b) FP8 vs BF16 refit of one Llama-shaped model (``--hidden``, ``--layers``, ``--vocab``,
``--intermediate``; BF16 weights, random). ``build_shards`` with ``fp8_prefixes`` = every
transformer-layer linear (E4M3 + FP32 128×128 ``weight_scale``) vs none. Prints payload bytes and
their ratio (target ≤ 0.52×; embeddings, ``lm_head`` and norms stay BF16 by design, so the
whole-model ratio is bounded below by their share — printed too), and the end-to-end refit time
(build = ``RefitPublisher.publish``, stream = pull every shard over gRPC, assemble = verify and
rebuild every tensor) of both, with the ratio.

Times are the median of ``--repeats`` runs after a warm-up, because these machines are noisy.
Needs ``redis-server`` on PATH (or ``$FP8RL_REDIS_SERVER``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import socket
import statistics
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable

import redis
import torch

from fp8rl.fp8 import Fp8Recipe, fp8_linear_names
from fp8rl.model import CausalLM
from fp8rl.model.config import ModelConfig
from fp8rl.refit import DEFAULT_SHARD_BYTES, Manifest, RefitPublisher, RefitStore, assemble
from fp8rl.refit.shards import verify_shard
from fp8rl.refit.transport.grpc import DEFAULT_CHUNK_BYTES, GrpcShardSource, WeightStoreServicer
from fp8rl.rpc import weights_pb2_grpc
from fp8rl.rpc.server import build_server

MiB = 1024 * 1024
_REQ = struct.Struct("<q")  # raw-socket request: the shard index


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _start_redis(workdir: str) -> tuple[subprocess.Popen, redis.Redis]:
    exe = os.environ.get("FP8RL_REDIS_SERVER") or shutil.which("redis-server")
    if not exe:
        raise SystemExit("bench/refit.py needs redis-server on PATH or $FP8RL_REDIS_SERVER "
                         "(apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir, "--save", "",
                             "--appendonly", "no", "--loglevel", "warning"], stdout=subprocess.DEVNULL)
    client = redis.Redis(host="127.0.0.1", port=port)
    for _ in range(200):
        try:
            client.ping()
            return proc, client
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.terminate()
    raise SystemExit(f"redis-server ({exe}) did not answer PING on port {port}")


class _RawServer:
    """Loopback TCP baseline: a request is one int64 shard index; the reply is that shard's bytes, chunk by chunk."""

    def __init__(self, shards: list[bytes], chunk_bytes: int) -> None:
        self.shards, self.chunk_bytes = shards, chunk_bytes
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while hdr := conn.recv(_REQ.size, socket.MSG_WAITALL):
                data = memoryview(self.shards[_REQ.unpack(hdr)[0]])
                for off in range(0, len(data), self.chunk_bytes):
                    conn.sendall(data[off:off + self.chunk_bytes])


class _RawClient:
    def __init__(self, port: int, chunk_bytes: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.chunk_bytes = chunk_bytes

    def fetch(self, index: int, size: int) -> bytearray:
        self.sock.sendall(_REQ.pack(index))
        buf = bytearray(size)
        view, pos = memoryview(buf), 0
        while pos < size:
            n = self.sock.recv_into(view[pos:], min(self.chunk_bytes, size - pos))
            if n == 0:
                raise ConnectionError(f"raw server closed after {pos}/{size} bytes of shard {index}")
            pos += n
        return buf


def llama_state_dict(args: argparse.Namespace) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Random BF16 weights under HF Llama names, plus the prefixes of every transformer-layer linear."""
    cfg = ModelConfig(architecture="llama", vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.hidden // args.head_dim, num_key_value_heads=args.kv_heads,
                      head_dim=args.head_dim, tie_word_embeddings=False)
    with torch.device("meta"):  # names and shapes only; the real tensors are made below
        model = CausalLM(cfg)
    prefixes = fp8_linear_names(model, Fp8Recipe(linear="fp8"))
    g = torch.Generator().manual_seed(0)
    sd = {}
    for name, t in model.state_dict().items():
        if t.dim() == 1:  # RMSNorm gains
            sd[name] = torch.ones(t.shape, dtype=torch.bfloat16)
        else:
            sd[name] = (torch.randn(t.shape, generator=g) * 0.02).to(torch.bfloat16)
    return sd, prefixes


def _stream_server(redis_port: int, args: argparse.Namespace, version: int, out) -> None:
    """Child process, as a trainer is: publish the payload, serve it over gRPC and over the raw socket."""
    client = redis.Redis(host="127.0.0.1", port=redis_port)
    pub = RefitPublisher(RefitStore(client, "bench-refit"), shard_bytes=args.shard_mib * MiB, keep=2)
    servicer = WeightStoreServicer(pub, chunk_bytes=args.chunk_mib * MiB)
    server, _, port = build_server([(weights_pb2_grpc.add_WeightStoreServicer_to_server, servicer)], port=0,
                                   host="127.0.0.1", token="", tls_cert="", tls_key="", max_workers=4)
    server.start()
    pub.endpoint = f"127.0.0.1:{port}"
    n = max(1, args.stream_mib // 16)
    g = torch.Generator().manual_seed(1)
    payload = {f"blob.{i}.weight": torch.randn(4096, 2048, generator=g).to(torch.bfloat16) for i in range(n)}
    pub.publish(payload, version, recipe="bf16")
    del payload
    raw = _RawServer(pub.shards(version), args.chunk_mib * MiB)
    out.send(raw.port)
    out.recv()  # the parent is done
    server.stop(grace=None)


def bench_stream(redis_port: int, store: RefitStore, src: GrpcShardSource, args: argparse.Namespace,
                 version: int) -> dict:
    """(a): the shards live in another process, as they do between a trainer and a replica."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_stream_server, args=(redis_port, args, version, child), daemon=True)
    proc.start()
    try:
        raw = _RawClient(parent.recv(), args.chunk_mib * MiB)
        m = store.get_manifest(version)

        def pull_grpc():
            got = [src.fetch(m, i) for i in range(m.num_shards)]
            assert [len(s) for s in got] == list(m.shard_sizes)

        def pull_raw():
            got = [raw.fetch(i, size) for i, size in enumerate(m.shard_sizes)]
            assert [len(s) for s in got] == list(m.shard_sizes)

        for i, size in enumerate(m.shard_sizes):  # the same bytes both ways, checked against the manifest
            verify_shard(i, raw.fetch(i, size), size, m.shard_checksums[i])
            verify_shard(i, src.fetch(m, i), size, m.shard_checksums[i])
        t_grpc = _median_time(pull_grpc, args.repeats)
        t_raw = _median_time(pull_raw, args.repeats)
        raw.sock.close()
    finally:
        parent.send("done")
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    res = {"bytes": m.total_bytes, "shards": m.num_shards, "grpc_MBps": m.total_bytes / t_grpc / 1e6,
           "raw_MBps": m.total_bytes / t_raw / 1e6}
    res["grpc_vs_raw"] = res["grpc_MBps"] / res["raw_MBps"]
    return res


def _linear_bytes(m: Manifest, prefixes: set[str]) -> int:
    """Bytes of the FP8-eligible linears (their ``.weight`` and, when present, ``.weight_scale``)."""
    return sum(e.nbytes for e in m.tensors if e.name.rsplit(".", 1)[0] in prefixes)


def bench_fp8_vs_bf16(pub: RefitPublisher, src: GrpcShardSource, args: argparse.Namespace, first_version: int) -> dict:
    sd, prefixes = llama_state_dict(args)
    version = [first_version]
    phases: dict[str, dict[str, list[float]]] = {k: {"build": [], "stream": [], "assemble": [], "total": []}
                                                 for k in ("bf16", "fp8")}
    manifests: dict[str, Manifest] = {}

    def refit(kind: str, record: bool) -> None:
        v = version[0]
        version[0] += 1
        t0 = time.perf_counter()
        m = pub.publish(sd, v, recipe="fp8_e2e" if kind == "fp8" else "bf16",
                        fp8_prefixes=prefixes if kind == "fp8" else ())
        t1 = time.perf_counter()
        shards = [src.fetch(m, i) for i in range(m.num_shards)]
        t2 = time.perf_counter()
        out = assemble(m, shards)
        t3 = time.perf_counter()
        assert len(out) == len(m.tensors)
        manifests[kind] = m
        if record:
            for k, t in (("build", t1 - t0), ("stream", t2 - t1), ("assemble", t3 - t2), ("total", t3 - t0)):
                phases[kind][k].append(t)

    for r in range(args.repeats + 1):  # interleaved so drift hits both alike; round 0 is the warm-up
        for kind in ("bf16", "fp8"):
            refit(kind, record=r > 0)
    med = {kind: {k: statistics.median(v) for k, v in p.items()} for kind, p in phases.items()}
    bf, f8 = manifests["bf16"], manifests["fp8"]
    pset = set(prefixes)
    return {
        "params": sum(t.numel() for t in sd.values()), "num_fp8_linears": len(prefixes),
        "bf16_bytes": bf.total_bytes, "fp8_bytes": f8.total_bytes, "bytes_ratio": f8.total_bytes / bf.total_bytes,
        "linear_bytes_ratio": _linear_bytes(f8, pset) / _linear_bytes(bf, pset),
        "bf16_only_share": 1 - _linear_bytes(bf, pset) / bf.total_bytes,
        "shards": (bf.num_shards, f8.num_shards), "times": med,
        "time_ratio": med["fp8"]["total"] / med["bf16"]["total"],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stream-mib", type=int, default=256, help="(a) payload, in 16 MiB BF16 tensors")
    ap.add_argument("--chunk-mib", type=int, default=DEFAULT_CHUNK_BYTES // MiB, help="StreamShards chunk (1-4 MiB)")
    ap.add_argument("--shard-mib", type=int, default=DEFAULT_SHARD_BYTES // MiB)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=None, help="default: Llama's 8/3·hidden rounded up to 256")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: as many as query heads (no GQA)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip", choices=["stream", "fp8"], default=None, help="leave out part (a) or (b)")
    args = ap.parse_args(argv)
    args.intermediate = args.intermediate or -(-8 * args.hidden // 3 // 256) * 256
    args.kv_heads = args.kv_heads or args.hidden // args.head_dim
    res: dict = {}
    with tempfile.TemporaryDirectory() as workdir:
        proc, client = _start_redis(workdir)
        server = None
        src = GrpcShardSource()
        try:
            store = RefitStore(client, "bench-refit")
            pub = RefitPublisher(store, shard_bytes=args.shard_mib * MiB, keep=2)
            servicer = WeightStoreServicer(pub, chunk_bytes=args.chunk_mib * MiB)
            server, _, port = build_server([(weights_pb2_grpc.add_WeightStoreServicer_to_server, servicer)], port=0,
                                           host="127.0.0.1", token="", tls_cert="", tls_key="", max_workers=4)
            server.start()
            pub.endpoint = f"127.0.0.1:{port}"
            print(f"refit on CPU loopback, torch {torch.__version__}, threads={torch.get_num_threads()}, "
                  f"chunk {args.chunk_mib} MiB, shards <= {args.shard_mib} MiB, median of {args.repeats}")
            if args.skip != "stream":
                s = res["stream"] = bench_stream(client.connection_pool.connection_kwargs["port"], store, src,
                                                 args, version=0)
                print(f"(a) streaming {s['bytes'] / MiB:.0f} MiB in {s['shards']} shards, {args.chunk_mib} MiB chunks")
                print(f"  raw TCP socket       : {s['raw_MBps']:8.0f} MB/s")
                print(f"  gRPC WeightStore     : {s['grpc_MBps']:8.0f} MB/s  = {s['grpc_vs_raw']:.2f}x raw "
                      "(target >= 0.6x)")
            if args.skip != "fp8":
                f = res["fp8"] = bench_fp8_vs_bf16(pub, src, args, first_version=1)  # after (a)'s version 0
                print(f"(b) refit of a Llama-shaped model: hidden {args.hidden}, intermediate {args.intermediate}, "
                      f"{args.layers} layers, vocab {args.vocab}, {args.kv_heads} kv heads "
                      f"({f['params'] / 1e6:.0f}M params, BF16), {f['num_fp8_linears']} linears in FP8")
                print(f"  payload bf16 {f['bf16_bytes'] / MiB:7.1f} MiB ({f['shards'][0]} shards), fp8 "
                      f"{f['fp8_bytes'] / MiB:7.1f} MiB ({f['shards'][1]} shards) = {f['bytes_ratio']:.3f}x "
                      f"(target <= 0.52x)")
                print(f"  layer linears alone: {f['linear_bytes_ratio']:.3f}x; embeddings + lm_head + norms stay "
                      f"BF16 and are {100 * f['bf16_only_share']:.1f}% of the BF16 payload")
                for kind in ("bf16", "fp8"):
                    t = f["times"][kind]
                    print(f"  {kind + ' end to end':21s}: {t['total']:6.2f} s  (build {t['build']:.2f} + stream "
                          f"{t['stream']:.2f} + assemble {t['assemble']:.2f})")
                print(f"  fp8 / bf16 time      : {f['time_ratio']:.2f}x")
        finally:
            src.close()
            if server is not None:
                server.stop(grace=None)
            client.close()
            proc.terminate()
            proc.wait(timeout=10)
    return res


if __name__ == "__main__":
    main()
