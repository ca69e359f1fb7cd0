"""The refit data plane against the hardware, every row in one run, ratios as ``ratio NAME VALUE`` lines.

    python bench/refit.py [--hidden 1024 --layers 8 --vocab 32000 --repeats 3 --big-gib 2 --skip-8b]

(1) **End to end, 168M-param Llama shape** (``--hidden/--layers/--vocab``, random BF16 weights, every
transformer-layer linear in FP8): build (quantize + checksum + write the shards, ``RefitPublisher.publish``
with its manifest in a throwaway ``redis-server``), transfer, and assemble + apply (verify and copy into
an engine's preallocated parameters). Three ways, medians of ``--repeats`` after a warm-up:

* ``today`` — the refit path before this benchmark's changes, re-measured here: blake2b-128 checksums per
  tensor and per shard, shards joined by repeated copies, assembly into fresh tensors, then the copy
  into the parameters; its transfer is one gRPC stream of the same bytes (the stream code is unchanged
  apart from writing into one buffer, which the new rows use too).
* ``grpc`` — the current path over gRPC: XXH3-128, shards allocated once at their final size, up to
  ``refit.parallel_streams`` (4) streams, tensors assembled as views of the received buffers.
* ``shm`` — the same with the shards allocated inside ``/dev/shm`` files by the trainer and mapped by
  the replica: the transfer is the mapping, the only copy is into the parameters.

Prints ``ratio end_to_end_fp8/today`` (shm, the same-node path), ``ratio end_to_end_fp8_grpc/today``
and ``ratio build_assemble/today`` (target ≤ 0.25×; end to end ≤ 0.5 s on the issue's machine), plus
``ratio fp8_bytes/bf16_bytes`` for the payload.

(2) **Throughput rows** over one payload (the 168M shape's FP8 shards, and ``--skip-8b`` aside an
8B-shaped FP8 payload — Llama-3.1-8B's linears in E4M3 + BF16 embeddings, ≈ 9.1 GB — moved in pieces of
at most ``--big-gib`` GiB, the same piece again and again): ``memcpy`` (into a preallocated buffer:
the ceiling), ``raw_socket`` (loopback TCP, server in a child process, client ``recv_into`` one
buffer), ``grpc`` (WeightStore in a child process, ``parallel_streams`` streams), ``shm`` (copy out of
the trainer's file through the replica's kept mapping — the steady state of recycled files; and
``shm_fresh_map``, through a new mapping per piece — a version whose files are new),
``collective`` (``torch.distributed`` gloo broadcast to a replica process, in the steady state where
each version lands in the buffer of an evicted one; ``collective_fresh``, the first version, into new
pages).
Prints GB/s, the seconds an 8B refit would take, and ``ratio shm/memcpy``, ``ratio grpc/raw_socket``,
``ratio collective/raw_socket``.

(3) **Delta after one training step** of the default job (``deploy/default-job.yaml``, in process, at
``--delta-lrs``): versions 0 and 1 published with ``delta=True``; prints ``ratio
delta_bytes/full_fp8_bytes`` (the first lr is the job's own, 2e-4).

Needs ``redis-server`` on PATH (or ``$FP8RL_REDIS_SERVER``).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import mmap
import multiprocessing
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "libs"))

import needs  # noqa: E402  (bench/needs.py: what a bench lacks, in one line)

from fp8rl.config.schema import RefitConfig  # noqa: E402
from fp8rl.fp8 import Fp8Recipe, fp8_linear_names, quantize_state_dict  # noqa: E402
from fp8rl.model import CausalLM  # noqa: E402
from fp8rl.model.config import ModelConfig  # noqa: E402
from fp8rl.redis_server import RedisSecret  # noqa: E402
from fp8rl.refit import DEFAULT_SHARD_BYTES, RefitPublisher, RefitStore, assemble  # noqa: E402
from fp8rl.refit.transport.grpc import GrpcShardSource, WeightStoreServicer  # noqa: E402
from fp8rl.refit.transport.shm import ShmShardSource, ShmShardWriter  # noqa: E402
from fp8rl.rpc import weights_pb2_grpc  # noqa: E402
from fp8rl.rpc.server import build_server  # noqa: E402

MiB, GiB = 1024 * 1024, 1024 ** 3
_REQ = struct.Struct("<qq")  # raw-socket request: offset, length
STREAM_CHUNK = 1 * MiB
SHM_ROOT = "/dev/shm"
PARALLEL_STREAMS = RefitConfig().parallel_streams


def _median(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_redis(workdir: str) -> tuple[subprocess.Popen, str]:
    """A throwaway redis-server on a free loopback port with a fresh password (read from a 0600 config file in
    ``workdir``, never on its command line); returns the process and the URL that carries the password."""
    exe = needs.redis_server()  # one line naming how to get one, where there is none
    port = _free_port()
    secret = RedisSecret.create(Path(workdir) / "secrets")
    proc = subprocess.Popen(secret.command(exe, port, workdir, "--save", "", "--appendonly", "no", "--loglevel",
                                           "warning"), stdout=subprocess.DEVNULL)
    url = secret.url(port)
    client = redis.Redis.from_url(url)
    for _ in range(200):
        try:
            client.ping()
            return proc, url
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.terminate()
    raise SystemExit(f"redis-server ({exe}) did not answer PING on port {port}")


def _grpc_server(pub: RefitPublisher):
    servicer = WeightStoreServicer(pub)
    server, _, port = build_server([(weights_pb2_grpc.add_WeightStoreServicer_to_server, servicer)], port=0,
                                   host="127.0.0.1", token="", tls_cert="", tls_key="", max_workers=8)
    server.start()
    pub.endpoint = f"127.0.0.1:{port}"
    return server


def llama_state_dict(hidden: int, layers: int, vocab: int, intermediate: int | None = None, head_dim: int = 128,
                     kv_heads: int | None = None, meta: bool = False) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Random BF16 weights under HF Llama names (``meta``: shapes only), plus every layer linear's prefix."""
    intermediate = intermediate or -(-8 * hidden // 3 // 256) * 256
    cfg = ModelConfig(architecture="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=hidden // head_dim,
                      num_key_value_heads=kv_heads or hidden // head_dim, head_dim=head_dim, tie_word_embeddings=False)
    with torch.device("meta"):
        model = CausalLM(cfg)
    prefixes = fp8_linear_names(model, Fp8Recipe(linear="fp8"))
    if meta:
        return dict(model.state_dict()), prefixes
    g = torch.Generator().manual_seed(0)
    sd = {}
    for name, t in model.state_dict().items():
        sd[name] = torch.ones(t.shape, dtype=torch.bfloat16) if t.dim() == 1 else \
            (torch.randn(t.shape, generator=g) * 0.02).to(torch.bfloat16)
    return sd, prefixes


# -- "today": the refit path this benchmark's changes replaced, kept here only as the baseline --------------

def _blake(data) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def legacy_build(sd: dict[str, torch.Tensor], prefixes: list[str], shard_bytes: int):
    """What ``build_shards`` did before: an FP32 sum per tensor for NaN, quantize, blake2b per tensor, shards
    grown by appends and copied out, blake2b per shard."""
    fp8 = {f"{p}.weight" for p in prefixes}
    for name, t in sd.items():
        if name not in fp8:
            assert bool(torch.isfinite(t.sum(dtype=torch.float32)))
    q = quantize_state_dict(dict(sd), prefixes)
    ordered = {}
    for name in sd:
        ordered[name] = q[name]
        if name in fp8:
            ordered[name.removesuffix(".weight") + ".weight_scale"] = q[name.removesuffix(".weight") + ".weight_scale"]
    entries, shards, cur = [], [], bytearray()
    for name, t in ordered.items():
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        if cur and len(cur) + raw.size > shard_bytes:
            shards.append(bytes(cur))
            cur = bytearray()
        entries.append((name, t.dtype, tuple(t.shape), len(shards), len(cur), raw.size, _blake(raw)))
        cur += raw.data  # (no tensor here is larger than a shard)
    shards.append(bytes(cur))
    return entries, shards, [_blake(s) for s in shards]


def legacy_assemble(entries, shards, shard_sums) -> dict[str, torch.Tensor]:
    """What ``assemble`` did before: a fresh tensor per entry, copied and hashed, then every shard hashed again."""
    import numpy as np

    out = {}
    for name, dtype, shape, shard, offset, n, digest in entries:
        buf = torch.empty(n, dtype=torch.uint8)
        src = np.frombuffer(shards[shard], dtype=np.uint8, count=n, offset=offset)
        h = hashlib.blake2b(digest_size=16)
        h.update(src)
        buf.numpy()[:] = src
        assert h.hexdigest() == digest
        out[name] = buf.view(dtype).reshape(shape)
    for s, d in zip(shards, shard_sums, strict=True):
        assert _blake(s) == d
    return out


def _params_like(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.empty_like(t) for k, t in tensors.items()}


def _apply(params: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    """An engine's apply: one copy of each tensor into its live parameter."""
    for k, t in tensors.items():
        params[k].copy_(t)


def bench_end_to_end(args, redis_url: str) -> dict:
    sd, prefixes = llama_state_dict(args.hidden, args.layers, args.vocab)
    client = redis.Redis.from_url(redis_url)
    store = RefitStore(client, "bench-refit-e2e")
    shard_bytes = args.shard_mib * MiB
    writer = ShmShardWriter(store.job, SHM_ROOT)
    pub_grpc = RefitPublisher(store, shard_bytes=shard_bytes, keep=2)
    pub_shm = RefitPublisher(store, shard_bytes=shard_bytes, keep=2, shm=writer)
    servers = [_grpc_server(pub_grpc), _grpc_server(pub_shm)]
    grpc_src, shm_src = GrpcShardSource(), ShmShardSource()
    version = [0]
    phases: dict[str, dict[str, list[float]]] = {}
    params: dict[str, torch.Tensor] = {}
    bf16_bytes = fp8_bytes = 0

    def rec(kind: str, **times: float) -> None:
        p = phases.setdefault(kind, {})
        for k, v in times.items():
            p.setdefault(k, []).append(v)
        p.setdefault("total", []).append(sum(times.values()))

    def today(record: bool) -> None:
        t0 = time.perf_counter()
        entries, shards, sums = legacy_build(sd, prefixes, shard_bytes)
        t1 = time.perf_counter()
        m = store.get_manifest(version[0] - 1)  # the newest full version: same shard sizes, streamed one at a time
        for i in range(m.num_shards):
            grpc_src.fetch(m, i)
        t2 = time.perf_counter()
        out = legacy_assemble(entries, shards, sums)
        _apply(params, out)
        t3 = time.perf_counter()
        if record:
            rec("today", build=t1 - t0, transfer=t2 - t1, assemble_apply=t3 - t2)

    def current(kind: str, record: bool) -> None:
        pub, src = (pub_shm, shm_src) if kind == "shm" else (pub_grpc, grpc_src)
        v = version[0]
        version[0] += 1
        t0 = time.perf_counter()
        m = pub.publish(sd, v, recipe="fp8_e2e", fp8_prefixes=prefixes)
        t1 = time.perf_counter()
        with ThreadPoolExecutor(PARALLEL_STREAMS) as ex:  # as RefitSubscriber fetches (parallel_fetches)
            got = list(ex.map(lambda i: src.fetch(m, i), range(m.num_shards)))
        t2 = time.perf_counter()
        tensors = assemble(m, got)
        _apply(params, tensors)
        t3 = time.perf_counter()
        del tensors, got
        if record:
            rec(kind, build=t1 - t0, transfer=t2 - t1, assemble_apply=t3 - t2)

    try:
        m0 = pub_grpc.publish(sd, 0, recipe="bf16")
        bf16_bytes = m0.total_bytes
        version[0] = 1
        m1 = pub_grpc.publish(sd, 1, recipe="fp8_e2e", fp8_prefixes=prefixes)
        fp8_bytes = m1.total_bytes
        params.update(_params_like(assemble(m1, [grpc_src.fetch(m1, i) for i in range(m1.num_shards)])))
        version[0] = 2
        # Interleaved so drift hits every path alike. The first rounds warm up: from the third publish on a
        # publisher recycles the buffers of the version it evicts, which is what every later step of a job sees.
        warm = 3
        for r in range(args.repeats + warm):
            today(r >= warm)
            current("grpc", r >= warm)
            current("shm", r >= warm)
    finally:
        grpc_src.close()
        for s in servers:
            s.stop(grace=None)
        pub_shm.close()
        client.close()
    med = {k: {p: statistics.median(v) for p, v in ph.items()} for k, ph in phases.items()}
    return {"params": sum(t.numel() for t in sd.values()), "bf16_bytes": bf16_bytes, "fp8_bytes": fp8_bytes,
            "times": med}


# -- (2) throughput rows ------------------------------------------------------------------------------------

class _Payload:
    """``pieces`` buffers of ``piece`` bytes (the last one ``last`` bytes), each cut into shards of ``shard`` bytes;
    the same bytes are sent for every piece (what is measured is moving them, not making them)."""

    def __init__(self, total: int, piece: int, shard: int) -> None:
        self.total, self.piece, self.shard = total, min(piece, total), shard
        self.pieces = math.ceil(total / self.piece)
        self.last = total - (self.pieces - 1) * self.piece

    def sizes(self, k: int) -> list[int]:
        n = self.last if k == self.pieces - 1 else self.piece
        return [min(self.shard, n - o) for o in range(0, n, self.shard)]


def _piece_manifest(job: str, version: int, data: bytearray, sizes: list[int], endpoint: str, collective: str = ""):
    from fp8rl.refit import Manifest
    from fp8rl.refit.shards import checksum

    views, o = [], 0
    for n in sizes:
        views.append(memoryview(data)[o:o + n])
        o += n
    m = Manifest(version=version, job=job, recipe="fp8_e2e", tensors=(), shard_sizes=tuple(sizes),
                 shard_checksums=tuple(checksum(v) for v in views), endpoint=endpoint, created=time.time(),
                 total_bytes=sum(sizes), collective=collective)
    return m, views


class _Holder:
    """What ``WeightStoreServicer`` needs of a publisher: shards and manifests by version."""

    def __init__(self, store):
        self.store, self._shards = store, {}

    def shards(self, version, *, delta=False):
        if version not in self._shards:
            raise LookupError(f"version {version} not held")
        return self._shards[version]


def _sender(redis_url: str, job: str, payload: _Payload, conn) -> None:
    """Child process, as a trainer is: serves every piece over a raw socket and over gRPC."""
    torch.set_num_threads(1)
    store = RefitStore(redis.Redis.from_url(redis_url), job)
    data = bytearray(os.urandom(payload.piece))
    holder = _Holder(store)
    servicer = WeightStoreServicer(holder)
    server, _, port = build_server([(weights_pb2_grpc.add_WeightStoreServicer_to_server, servicer)], port=0,
                                   host="127.0.0.1", token="", tls_cert="", tls_key="", max_workers=8)
    server.start()
    for k in range(payload.pieces):
        m, views = _piece_manifest(job, k, data, payload.sizes(k), f"127.0.0.1:{port}")
        holder._shards[k] = views
        store.publish(m)
    sock = socket.create_server(("127.0.0.1", 0))
    conn.send(sock.getsockname()[1])

    def serve_raw() -> None:
        c, _ = sock.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with c:
            while hdr := c.recv(_REQ.size, socket.MSG_WAITALL):
                off, n = _REQ.unpack(hdr)
                view = memoryview(data)[off:off + n]
                for o in range(0, n, STREAM_CHUNK):
                    c.sendall(view[o:o + STREAM_CHUNK])

    threading.Thread(target=serve_raw, daemon=True).start()
    conn.recv()
    server.stop(grace=None)


def _receiver(redis_url: str, job: str, conn) -> None:
    """Child process, as a replica is: a collective member that reports each version it received."""
    from fp8rl.refit.transport.collective import CollectiveShardSource

    torch.set_num_threads(1)
    store = RefitStore(redis.Redis.from_url(redis_url), job)
    src = CollectiveShardSource(store, "bench-replica", fetch_timeout_s=600)
    conn.send("joined")
    while (v := conn.recv()) is not None:
        m = store.get_manifest(v)
        got = sum(len(src.fetch(m, i)) for i in range(m.num_shards))
        conn.send(got)
    src.close()


def bench_throughput(args, redis_url: str, name: str, payload: _Payload) -> dict[str, float]:
    """GB/s of each transport over ``payload`` (see the module docstring); every row moves the same bytes."""
    ctx = multiprocessing.get_context("spawn")
    job = f"bench-tp-{name}"
    client = redis.Redis.from_url(redis_url)
    store = RefitStore(client, job)
    res: dict[str, float] = {}
    src = torch.randint(0, 256, (payload.piece,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.fill_(0)  # the replica's parameters exist before a refit

    def per_piece(fn, warmup: int = 1) -> float:
        for _ in range(warmup):  # warm-up pieces
            fn(0)
        t0 = time.perf_counter()
        for k in range(payload.pieces):
            fn(k)
        return payload.total / (time.perf_counter() - t0) / 1e9

    res["memcpy"] = per_piece(lambda k: dst[:sum(payload.sizes(k))].copy_(src[:sum(payload.sizes(k))]))

    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_sender, args=(redis_url, job, payload, child), daemon=True)
    proc.start()
    try:
        raw = socket.create_connection(("127.0.0.1", parent.recv()))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = memoryview(dst.numpy())

        def raw_piece(k: int) -> None:
            n = sum(payload.sizes(k))
            raw.sendall(_REQ.pack(0, n))
            pos = 0
            while pos < n:
                got = raw.recv_into(buf[pos:n], min(STREAM_CHUNK, n - pos))
                if not got:
                    raise ConnectionError("raw server closed")
                pos += got

        res["raw_socket"] = per_piece(raw_piece)
        grpc_src = GrpcShardSource()
        manifests = [store.get_manifest(k) for k in range(payload.pieces)]

        def grpc_piece(k: int) -> None:
            m = manifests[k]
            with ThreadPoolExecutor(PARALLEL_STREAMS) as ex:
                got = list(ex.map(lambda i: grpc_src.fetch(m, i), range(m.num_shards)))
            assert [len(g) for g in got] == list(m.shard_sizes)

        res["grpc"] = per_piece(grpc_piece)
        grpc_src.close()
        raw.close()
    finally:
        parent.send("done")
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()

    # shm: the trainer's file is written when it builds (not timed here); the replica maps it and copies out.
    # In a job's steady state the trainer recycles an evicted version's files and ShmShardSource keeps its
    # mapping of each file, so every version after the first is read through page tables already there:
    # the mapping below is made once (the warm-up piece) and kept, as the source's cache keeps it.
    path = Path(SHM_ROOT) / f"fp8rl-bench-{os.getpid()}.bin"
    try:
        with open(path, "w+b") as f:
            f.truncate(payload.piece)
            with mmap.mmap(f.fileno(), payload.piece) as mw:
                mw[:] = src.numpy().data
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), payload.piece, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        views = [torch.frombuffer(mapped, dtype=torch.uint8)]

        def shm_piece(k: int) -> None:
            n = sum(payload.sizes(k))
            dst[:n].copy_(views[0][:n])

        res["shm"] = per_piece(shm_piece)
        views.clear()
        mapped.close()

        def shm_fresh_piece(k: int) -> None:  # a version whose files are new (the first, or none recycled)
            n = sum(payload.sizes(k))
            with open(path, "rb") as f:
                m = mmap.mmap(f.fileno(), payload.piece, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            v = torch.frombuffer(m, dtype=torch.uint8, count=n)
            dst[:n].copy_(v)
            del v
            m.close()

        res["shm_fresh_map"] = per_piece(shm_fresh_piece)
    finally:
        path.unlink(missing_ok=True)

    if args.skip_collective:
        return res
    from fp8rl.refit.transport.collective import KEEP_VERSIONS, SPARE_BUFFERS, CollectiveBroadcaster

    bc = CollectiveBroadcaster(store, join_timeout_s=60, op_timeout_s=600, poll_s=0.05)
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(redis_url, job, child), daemon=True)
    proc.start()
    try:
        assert parent.recv() == "joined"
        data = bytearray(src.numpy().tobytes())
        base = 1000

        def coll_piece(k: int) -> None:
            v = base + coll_piece.n
            coll_piece.n += 1
            m, views = _piece_manifest(job, v, data, payload.sizes(k), "", bc.endpoint)
            store.publish(m)
            bc.offer(m, views)
            parent.send(v)
            assert parent.recv() == m.total_bytes

        coll_piece.n = 0
        t0 = time.perf_counter()
        coll_piece(0)  # into a fresh buffer: the replica's first versions
        res["collective_fresh"] = sum(payload.sizes(0)) / (time.perf_counter() - t0) / 1e9
        # the steady state: once KEEP_VERSIONS are held, each broadcast lands in an evicted version's buffer
        res["collective"] = per_piece(coll_piece, warmup=KEEP_VERSIONS + SPARE_BUFFERS)
    finally:
        parent.send(None)
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
        bc.close()
    return res


def llama8b_fp8_bytes() -> int:
    """Bytes of Llama-3.1-8B's refit payload in this recipe: layer linears E4M3 + FP32 128×128 scales, the rest BF16."""
    sd, prefixes = llama_state_dict(4096, 32, 128256, intermediate=14336, kv_heads=8, meta=True)
    lin = {f"{p}.weight" for p in prefixes}
    total = 0
    for name, t in sd.items():
        if name in lin:
            total += t.numel() + 4 * math.ceil(t.shape[0] / 128) * math.ceil(t.shape[1] / 128)
        else:
            total += 2 * t.numel()
    return total


# -- (3) delta after one training step ----------------------------------------------------------------------

def bench_delta(lr: float, redis_url: str) -> dict:
    from fp8rl.config import load_job_config
    from fp8rl.loop import GRPOLoop, LoopConfig

    job = load_job_config(str(REPO / "deploy" / "default-job.yaml")).with_settings(
        {"policy.training.lr": lr, "job.steps": 1, "job.eval_size": 8})
    loop = GRPOLoop(LoopConfig(job))
    prefixes = fp8_linear_names(loop.trainer.model, loop.rollout_recipe)
    pow2 = loop.rollout_recipe.pow2_weight_scaling_factors
    store = RefitStore(redis.Redis.from_url(redis_url), f"bench-delta-{lr:g}".replace("+", ""))
    pub = RefitPublisher(store, keep=2, delta=True)
    full0 = pub.publish(loop.trainer.state_dict(), 0, recipe=job.recipe, fp8_prefixes=prefixes, pow2_scale=pow2)
    loop.step(0)
    full1 = pub.publish(loop.trainer.state_dict(), 1, recipe=job.recipe, fp8_prefixes=prefixes, pow2_scale=pow2)
    st = pub.last_delta
    return {"full_bytes": full1.total_bytes, "full0": full0.total_bytes, **st}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shard-mib", type=int, default=DEFAULT_SHARD_BYTES // MiB)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--big-gib", type=float, default=2.0, help="piece size of the 8B-shaped stream (<= 2 GiB)")
    ap.add_argument("--skip-8b", action="store_true", help="leave out the 8B-shaped throughput rows")
    ap.add_argument("--skip-collective", action="store_true", help="leave out the gloo broadcast rows")
    ap.add_argument("--delta-lrs", type=float, nargs="*", default=[2e-4, 3e-7])
    args = ap.parse_args(argv)
    res: dict = {}
    with tempfile.TemporaryDirectory() as workdir:
        proc, redis_url = _start_redis(workdir)
        try:
            print(f"refit on CPU loopback, torch {torch.__version__}, {os.cpu_count()} cores, "
                  f"threads={torch.get_num_threads()}, median of {args.repeats}")
            e = res["end_to_end"] = bench_end_to_end(args, redis_url)
            print(f"(1) end to end, Llama shape hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
                  f"{e['params'] / 1e6:.0f}M params; payload bf16 {e['bf16_bytes'] / MiB:.1f} MiB, fp8 "
                  f"{e['fp8_bytes'] / MiB:.1f} MiB")
            for kind, t in e["times"].items():
                print(f"  {kind:6s}: {t['total']:6.3f} s  (build {t['build']:.3f} + transfer {t['transfer']:.3f} + "
                      f"assemble/apply {t['assemble_apply']:.3f})")
            today, shm, grpc = (e["times"][k] for k in ("today", "shm", "grpc"))
            print(f"ratio fp8_bytes/bf16_bytes {e['fp8_bytes'] / e['bf16_bytes']:.4f}")
            print(f"ratio end_to_end_fp8/today {shm['total'] / today['total']:.4f}")
            print(f"ratio end_to_end_fp8_grpc/today {grpc['total'] / today['total']:.4f}")
            ba = (shm["build"] + shm["assemble_apply"]) / (today["build"] + today["assemble_apply"])
            print(f"ratio build_assemble/today {ba:.4f}")

            rows = {"168M": _Payload(e["fp8_bytes"], e["fp8_bytes"], args.shard_mib * MiB)}
            b8 = llama8b_fp8_bytes()
            if not args.skip_8b:
                rows["8B"] = _Payload(b8, int(min(args.big_gib, 2.0) * GiB), args.shard_mib * MiB)
            for name, payload in rows.items():
                t = res[f"throughput_{name}"] = bench_throughput(args, redis_url, name, payload)
                print(f"(2) throughput, {name}-shaped FP8 payload {payload.total / 1e9:.2f} GB in {payload.pieces} "
                      f"piece(s) of <= {payload.piece / GiB:.2f} GiB, {args.shard_mib} MiB shards:")
                for row, gbps in t.items():
                    print(f"  {row:11s}: {gbps:6.2f} GB/s  -> an 8B refit ({b8 / 1e9:.1f} GB) moves in "
                          f"{b8 / gbps / 1e9:6.1f} s")
                print(f"ratio shm/memcpy {name} {t['shm'] / t['memcpy']:.4f}")
                print(f"ratio grpc/raw_socket {name} {t['grpc'] / t['raw_socket']:.4f}")
                if "collective" in t:
                    print(f"ratio collective/raw_socket {name} {t['collective'] / t['raw_socket']:.4f}")

            for lr in args.delta_lrs:
                d = res[f"delta_{lr:g}"] = bench_delta(lr, redis_url)
                print(f"(3) delta after one step of the default job at lr {lr:g}: {d['delta_bytes'] / MiB:.3f} MiB of "
                      f"{d['full_bytes'] / MiB:.3f} MiB ({d['tensors_sparse']} tensors sparse, {d['tensors_whole']} "
                      f"whole, {d['tensors_unchanged']} unchanged)")
                print(f"ratio delta_bytes/full_fp8_bytes lr={lr:g} {d['ratio']:.4f}")
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    return res


if __name__ == "__main__":
    main()
