"""``python -m services.reward``: build the reward server, serve until SIGTERM/SIGINT, stop gracefully.

Kept minimal on purpose so it can move onto the shared service skeleton later: parse flags,
build (:func:`fp8rl.rpc.server.build_server`), start, mark health SERVING, write the ready
file, wait for a signal, mark NOT_SERVING, drain in-flight calls, exit 0.

The ready file (``--ready-file``) is JSON ``{"port": N, "pid": P}``, written atomically once the
server answers (so ``--port 0`` callers learn the bound port) and removed on a clean exit.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from fp8rl.data.scoring import DEFAULT_TIMEOUT_S, GradingPool
from fp8rl.rpc import reward_pb2_grpc
from fp8rl.rpc.server import build_server, set_serving

from .server import RewardServicer

log = logging.getLogger("fp8rl.reward")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.reward", description="fp8rl reward service (gRPC)")
    p.add_argument("--port", type=int, default=50053, help="port to listen on; 0 picks a free one (default 50053)")
    p.add_argument("--host", default="[::]", help="address to bind (default: every interface)")
    p.add_argument("--ready-file", type=Path, help='write {"port": N, "pid": P} here once serving')
    p.add_argument("--token", default=None, help="bearer token callers must send (default $FP8RL_AUTH_TOKEN)")
    p.add_argument("--grader", default="math_verify", help="grader for items that name none (default math_verify)")
    p.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S, help="per-item grading time bound")
    p.add_argument("--grading-workers", type=int, default=4, help="grading threads (default 4)")
    p.add_argument("--grace-s", type=float, default=5.0, help="seconds in-flight calls get on shutdown")
    return p.parse_args(argv)


def _write_ready(path: Path, port: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"port": port, "pid": os.getpid()}))
    tmp.replace(path)  # atomic: a watcher never reads half a file


def main(argv: list[str] | None = None) -> int:
    """Runs the service; returns the process exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = _parse_args(argv)
    try:
        servicer = RewardServicer(args.grader, args.timeout_s, GradingPool(max_workers=args.grading_workers))
        server, health, port = build_server(
            [(reward_pb2_grpc.add_RewardServiceServicer_to_server, servicer)],
            port=args.port, host=args.host, token=args.token,
        )
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"reward: {e}", file=sys.stderr)
        return 2

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.set())

    server.start()
    set_serving(health, True)
    if args.ready_file is not None:
        _write_ready(args.ready_file, port)
    log.info("reward service serving on port %d (default grader %s, %g s per item)", port, args.grader, args.timeout_s)

    stop.wait()
    log.info("stopping: draining in-flight calls for up to %g s", args.grace_s)
    health.enter_graceful_shutdown()  # NOT_SERVING first, so load balancers stop routing here
    server.stop(grace=args.grace_s).wait()
    if args.ready_file is not None:
        args.ready_file.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
