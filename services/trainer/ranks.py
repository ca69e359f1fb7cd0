"""One trainer service over N ranks: rank 0 serves gRPC and leads, the other ranks follow its commands.

``policy.training.dp_size: N`` with ``torchrun --nproc-per-node N -m services.trainer ...`` (the launcher,
compose and the Helm chart start it so). Every rank builds the same trainer: a
:class:`~fp8rl.engines.TorchTrainer` over FSDP2 (:mod:`fp8rl.engines.parallel`), or a ``MegatronTrainer`` over
Megatron-Core DDP. Rank 0 runs the whole service — gRPC, Redis, the refit publisher — with its trainer wrapped
in :class:`LeaderTrainer`; ranks 1..N-1 run :func:`follow` and nothing else (no port, no Redis).

Wire (:class:`CommandChannel`): before each trainer call rank 0 broadcasts a command over the default
process group: an int64 length, a UTF-8 JSON header ``{"op", "args", "tensors": [[name, dtype, shape]]}``
and then each tensor, so a follower rebuilds the call exactly (the batch with every tensor the leader's
call sees, the checkpoint path rank 0 resolved). No pickle: the header is strict JSON of a bounded size,
dtypes come from a fixed list, and shapes are checked.

Invariants:

* Every rank makes the same trainer calls in the same order, so their collectives pair up. The
  exceptions a call raises identically on every rank (:data:`SHARED_ERRORS`: a stop agreed by all-reduce,
  a non-finite global gradient norm, a rejected batch) leave the group in step and are the caller's
  business; anything else — a peer gone, a collective timed out, a bug on one rank — means the ranks can
  no longer agree, and the process exits (status 1) so that torchrun's elastic agent restarts the whole
  group (``--max-restarts``). The restarted trainer resumes from its newest checkpoint (``--resume auto``)
  and republishes it under the next version; the controller's resume logic continues the job from there.
* An idle leader broadcasts a ``noop`` every ``keepalive_s``, so a follower's wait never reaches the
  collective timeout between steps (rollouts can take minutes) and a dead follower is found while idle.
* A follower ignores SIGTERM and SIGINT: it stops when rank 0 broadcasts ``stop`` (rank 0's graceful
  stop), or exits with status 1 when rank 0 is gone.
* A follower given a fixed ``--port`` (a pod of its own, as in the Helm chart) serves only gRPC health there,
  SERVING while it follows, so its pod's probes see it; where the port is taken (ranks sharing a host's
  network with rank 0) it serves none and says so.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fp8rl.engines import Cancelled, StaleSampleError, TrainBatch, TrainerBackend
from fp8rl.engines.parallel import DataParallel
from fp8rl.fp8 import QKVScales

log = logging.getLogger(__name__)

__all__ = ["CommandChannel", "LeaderTrainer", "follow", "SHARED_ERRORS", "EXIT_GROUP_FAILED"]

SHARED_ERRORS = (Cancelled, FloatingPointError, StaleSampleError, ValueError)
EXIT_GROUP_FAILED = 1
MAX_HEADER_BYTES = 1 << 20
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.int64, torch.int32, torch.int16, torch.float32,
                                                     torch.float64, torch.bfloat16, torch.uint8, torch.bool)}
BATCH_FIELDS = ("input_ids", "attention_mask", "loss_mask", "advantages", "gen_logprobs", "prev_logprobs",
                "ref_logprobs", "versions", "routes")
DEFAULT_KEEPALIVE_S = 30.0


class GroupFailure(RuntimeError):
    """The ranks can no longer agree (a peer died, a collective failed, a malformed command).

    ``transient``: an RPC that meets it is answered UNAVAILABLE (:func:`services.common.rpc.rpc_method`), which the
    controller retries — the group is closing and torchrun's agent starts it again, resumed from its newest
    checkpoint, as when the call finds the process already gone. (Answered INTERNAL, a TrainStep that arrived between
    the group's failure and the process's exit failed the whole job.)"""

    transient = True


class CommandChannel:
    """Rank 0 → every rank: one command (op, JSON args, named tensors) per trainer call, over the default group."""

    def __init__(self, parallel: DataParallel) -> None:
        self.parallel = parallel

    def send(self, op: str, args: dict | None = None, tensors: dict[str, torch.Tensor] | None = None) -> None:
        tensors = {k: v.contiguous() for k, v in (tensors or {}).items()}
        for name, t in tensors.items():
            if str(t.dtype).removeprefix("torch.") not in DTYPES:
                raise GroupFailure(f"command {op}: tensor {name} has dtype {t.dtype}, which the channel does not carry")
        header = json.dumps({"op": op, "args": args or {}, "tensors": [
            [k, str(t.dtype).removeprefix("torch."), list(t.shape)] for k, t in tensors.items()]}).encode()
        if len(header) > MAX_HEADER_BYTES:
            raise GroupFailure(f"command {op}: header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
        dist.broadcast(torch.tensor([len(header)], dtype=torch.int64), src=0)
        dist.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8), src=0)
        for t in tensors.values():
            dist.broadcast(_bytes_of(t), src=0)

    def recv(self) -> tuple[str, dict, dict[str, torch.Tensor]]:
        n = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(n, src=0)
        size = int(n.item())
        if not 0 < size <= MAX_HEADER_BYTES:
            raise GroupFailure(f"command header of {size} bytes (limit {MAX_HEADER_BYTES})")
        raw = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(raw, src=0)
        op, args, shapes = decode_header(raw.numpy().tobytes())
        tensors = {}
        for name, dtype, shape in shapes:
            tensors[name] = torch.empty(shape, dtype=dtype)
            dist.broadcast(_bytes_of(tensors[name]), src=0)  # received into the tensor's own storage
        return op, args, tensors


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 view: what the channel broadcasts, whatever the dtype (gloo
    refuses some, e.g. int16 routes: "Invalid scalar type")."""
    return t.reshape(-1).view(torch.uint8)


def decode_header(raw: bytes) -> tuple[str, dict, list[tuple[str, torch.dtype, list[int]]]]:
    """``(op, args, [(name, dtype, shape)])`` of a command header, or :class:`GroupFailure` saying what is wrong."""
    if len(raw) > MAX_HEADER_BYTES:
        raise GroupFailure(f"command header of {len(raw)} bytes (limit {MAX_HEADER_BYTES})")
    try:
        header = json.loads(raw.decode())
        op, args, specs = header["op"], header["args"], header["tensors"]
        if not isinstance(op, str) or not isinstance(args, dict) or not isinstance(specs, list):
            raise TypeError("op, args and tensors must be a string, an object and a list")
        shapes = []
        for name, dtype, shape in specs:
            if dtype not in DTYPES:
                raise ValueError(f"tensor {name!r} has dtype {dtype!r}, not one of {', '.join(DTYPES)}")
            if not isinstance(shape, list) or any(isinstance(x, bool) or not isinstance(x, int) or x < 0
                                                  for x in shape):
                raise ValueError(f"tensor {name!r} has shape {shape!r}; dimensions are ints >= 0")
            shapes.append((str(name), DTYPES[dtype], shape))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # UnicodeDecodeError is a ValueError
        raise GroupFailure(f"malformed command header: {exc}") from None
    return op, args, shapes


def _batch_tensors(batch: TrainBatch) -> dict[str, torch.Tensor]:
    return {f: getattr(batch, f) for f in BATCH_FIELDS if getattr(batch, f) is not None}


def _batch_of(tensors: dict[str, torch.Tensor]) -> TrainBatch:
    try:
        return TrainBatch(**{f: tensors.get(f) for f in BATCH_FIELDS})
    except TypeError as exc:
        raise GroupFailure(f"command batch lacks a field: {exc}") from None


def _exit_group(exc: BaseException) -> None:
    log.critical("the trainer's rank group failed (%s: %s); exiting so torchrun restarts every rank",
                 type(exc).__name__, exc)
    logging.shutdown()
    os._exit(EXIT_GROUP_FAILED)


class LeaderTrainer(TrainerBackend):
    """Rank 0's trainer: each call is broadcast to the followers, then made here (module docstring).

    Args:
        trainer: this rank's trainer (built over the group like every rank's).
        channel: the command channel.
        on_failure: called with the exception when the group breaks (default: log and exit status 1).
        keepalive_s: idle seconds between ``noop`` broadcasts.
    """

    def __init__(self, trainer: TrainerBackend, channel: CommandChannel, *,
                 on_failure: Callable[[BaseException], None] = _exit_group,
                 keepalive_s: float = DEFAULT_KEEPALIVE_S) -> None:
        self.trainer, self.channel, self.on_failure = trainer, channel, on_failure
        self.keepalive_s = keepalive_s
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._closed = threading.Event()
        self._keepalive = threading.Thread(target=self._keep_alive, name="trainer-ranks-keepalive", daemon=True)
        self._keepalive.start()

    @property
    def version(self) -> int:
        return self.trainer.version

    @property
    def checkpoint_suffix(self) -> str:  # type: ignore[override]
        return self.trainer.checkpoint_suffix

    def _call(self, op: str, fn: Callable[[], Any], args: dict | None = None,
              tensors: dict[str, torch.Tensor] | None = None) -> Any:
        with self._lock:
            if self._closed.is_set():
                raise GroupFailure("the trainer's rank group is closed (the service is stopping)")
            try:
                self.channel.send(op, args, tensors)
                return fn()
            except SHARED_ERRORS:
                raise  # every rank raised it: still in step
            except BaseException as exc:  # noqa: BLE001 - a collective broke or one rank diverged
                self.on_failure(exc)
                raise GroupFailure(f"{op}: {exc}") from exc
            finally:
                self._last = time.monotonic()

    def compute_logprobs(self, batch, *, should_stop=None):
        return self._call("logprobs", lambda: self.trainer.compute_logprobs(batch, should_stop=should_stop),
                          tensors=_batch_tensors(batch))

    def train_step(self, batch, *, should_stop=None):
        return self._call("train", lambda: self.trainer.train_step(batch, should_stop=should_stop),
                          tensors=_batch_tensors(batch))

    def routing_metrics(self) -> dict[str, float]:
        """The ``moe/*`` metrics of the last logprob pass: already summed over every rank by that pass (no command)."""
        metrics = getattr(self.trainer, "routing_metrics", None)
        return metrics() if metrics is not None else {}

    def state_dict(self, *, adapters_only: bool = False):
        return self._call("state_dict", lambda: self.trainer.state_dict(adapters_only=adapters_only),
                          {"adapters_only": adapters_only})

    def load_state_dict(self, tensors):
        return self._call("load_state_dict", lambda: self.trainer.load_state_dict(tensors), tensors=dict(tensors))

    def save_checkpoint(self, path):
        return self._call("save", lambda: self.trainer.save_checkpoint(path), {"path": str(path)})

    def load_checkpoint(self, path):
        return self._call("load", lambda: self.trainer.load_checkpoint(path), {"path": str(path)})

    def relabel_version(self, version):
        return self._call("relabel", lambda: self.trainer.relabel_version(version), {"version": version})

    @property
    def needs_qkv_scales(self) -> bool:
        return bool(getattr(self.trainer, "needs_qkv_scales", False))

    def load_qkv_scales(self, scales):
        return self._call("scales", lambda: self.trainer.load_qkv_scales(scales), {"version": scales.version},
                          tensors={"qkv": scales.to_tensor()})

    def close(self, timeout_s: float = 10.0) -> None:
        """Tell the followers to stop (they exit 0); later calls fail."""
        if not self._lock.acquire(timeout=timeout_s):
            log.warning("the trainer is busy; its followers stop when torchrun stops them")
            self._closed.set()
            return
        try:
            if not self._closed.is_set():
                self._closed.set()
                self.channel.send("stop")
        except Exception as exc:  # noqa: BLE001 - a follower already gone: nothing left to tell
            log.warning("could not tell the trainer's followers to stop: %s", exc)
        finally:
            self._lock.release()

    def _keep_alive(self) -> None:
        while not self._closed.wait(min(self.keepalive_s, 1.0)):
            if time.monotonic() - self._last < self.keepalive_s or not self._lock.acquire(blocking=False):
                continue
            try:
                if not self._closed.is_set():
                    self.channel.send("noop")
            except BaseException as exc:  # noqa: BLE001
                self.on_failure(exc)
                return
            finally:
                self._last = time.monotonic()
                self._lock.release()


def follow(trainer: TrainerBackend, channel: CommandChannel) -> int:
    """Run rank 0's commands on this rank until ``stop`` (returns 0); raises :class:`GroupFailure` (or the
    collective's error) when the group breaks."""
    while True:
        op, args, tensors = channel.recv()
        if op == "noop":
            continue
        if op == "stop":
            log.info("rank %d: stop from rank 0", channel.parallel.rank)
            return 0
        try:
            if op == "logprobs":
                trainer.compute_logprobs(_batch_of(tensors))
            elif op == "train":
                trainer.train_step(_batch_of(tensors))
            elif op == "state_dict":
                # the gathers rank 0 needs; this rank drops its copy
                trainer.state_dict(adapters_only=bool((args or {}).get("adapters_only", False)))
            elif op == "load_state_dict":
                trainer.load_state_dict(tensors)
            elif op == "save":
                trainer.save_checkpoint(str(args["path"]))
            elif op == "load":
                trainer.load_checkpoint(str(args["path"]))
            elif op == "relabel":
                trainer.relabel_version(int(args["version"]))
            elif op == "scales":
                trainer.load_qkv_scales(QKVScales.from_tensor(int(args["version"]), tensors["qkv"]))
            else:
                raise GroupFailure(f"unknown command {op!r} from rank 0")
        except SHARED_ERRORS as exc:  # raised on rank 0 too: still in step
            log.info("rank %d: %s raised %s: %s (as on every rank)", channel.parallel.rank, op, type(exc).__name__,
                     exc)


def follower_main(spec, argv: Sequence[str] | None = None) -> int:
    """Entry point of ranks 1..N-1 (``services.trainer`` under torchrun picks it by ``RANK``)."""
    from fp8rl.config import load_job_config
    from services.common.runtime import ENV_TORCH_THREADS, parse_args

    args = parse_args(spec, argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s trainer[{args.replica_id}/rank{rank}] %(name)s: %(message)s")
    torch.set_num_threads(int(os.environ.get(ENV_TORCH_THREADS, "1")))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 says when to stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        job = load_job_config(args.config)
        from .build import build_trainer

        trainer, parallel = build_trainer(job)
    except Exception as exc:  # noqa: BLE001 - rank 0 fails the same way and says why; exit so torchrun stops
        log.error("rank %d cannot start: %s", rank, exc)
        return 2
    log.info("rank %d of %d following rank 0", parallel.rank, parallel.world)
    health_server = _serve_health(args) if args.port else None
    try:
        return follow(trainer, CommandChannel(parallel))
    except BaseException as exc:  # noqa: BLE001
        _exit_group(exc)
        return EXIT_GROUP_FAILED
    finally:
        if health_server is not None:
            health_server.stop(0)


def _serve_health(args):
    """gRPC health (and nothing else) on ``--port``, SERVING; None where the port cannot be had."""
    from fp8rl.rpc.server import build_server, set_serving

    try:
        server, health, port = build_server([], port=args.port, host=args.host, max_workers=2,
                                            tls_cert=args.tls_cert, tls_key=args.tls_key)
    except (RuntimeError, ValueError, OSError) as exc:
        log.warning("serving no health on port %s (%s): rank 0 or another rank holds it on this host", args.port, exc)
        return None
    server.start()
    set_serving(health, True)
    log.info("gRPC health on port %d", port)
    return server
