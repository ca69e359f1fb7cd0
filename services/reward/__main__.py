"""``python -m services.reward``: build the reward server, serve until SIGTERM/SIGINT, stop gracefully.

The reward service holds no model and no Redis state, so it does not use the shared skeleton's job
store; it shares its security flags (``--service-token[-file]``, ``--client-token[-file]``, ``--insecure``,
``--tls-cert``, ``--tls-key``, with the same environment fallbacks: :mod:`services.common.security`) and
takes the job YAML optionally (``--config``: ``reward.grader`` and ``reward.timeout_s`` become the
defaults; explicit flags win). Parse flags, build
(:func:`fp8rl.rpc.server.build_server`), start, mark health SERVING, write the ready file, wait
for a signal, mark NOT_SERVING, drain in-flight calls, exit 0 (2 on bad flags or config).

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

from fp8rl import limits
from fp8rl.config import ConfigError, load_job_config
from fp8rl.data.scoring import DEFAULT_TIMEOUT_S, GradingPool
from fp8rl.rpc import reward_pb2_grpc
from fp8rl.rpc.server import build_server, set_serving

from ..common.runtime import StartupError, add_security_args, apply_security_args, env_default
from .server import RewardServicer

log = logging.getLogger("fp8rl.reward")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.reward", description="fp8rl reward service (gRPC)")
    p.add_argument("--port", type=int, default=50053, help="port to listen on; 0 picks a free one (default 50053)")
    p.add_argument("--host", default="[::]", help="address to bind (default: every interface)")
    p.add_argument("--ready-file", type=Path, help='write {"port": N, "pid": P} here once serving')
    p.add_argument("--config", default=env_default("config"),
                   help="job YAML (optional): its reward.grader and reward.timeout_s become the defaults")
    add_security_args(p)
    p.add_argument("--grader", default=None, help="grader for items that name none (default: the job's, else "
                                                   "math_verify)")
    p.add_argument("--timeout-s", type=float, default=None,
                   help=f"per-item grading time bound (default: the job's, else {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--grading-workers", type=int, default=4, help="grading threads (default 4)")
    p.add_argument("--max-items", type=int, default=int(env_default("max_items", limits.MAX_SCORE_ITEMS)),
                   help=f"most items in one Score call (default {limits.MAX_SCORE_ITEMS})")
    p.add_argument("--max-response-chars", type=int,
                   default=int(env_default("max_response_chars", limits.MAX_RESPONSE_CHARS)),
                   help=f"most characters in one item's response or answer (default {limits.MAX_RESPONSE_CHARS})")
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
        apply_security_args(args)  # Score is a service-scope RPC; refuses an open non-loopback listener
        job = load_job_config(args.config) if args.config else None
        if args.grader is None:
            args.grader = job.get("reward.grader") if job else "math_verify"
        if args.timeout_s is None:
            args.timeout_s = job.get("reward.timeout_s") if job else DEFAULT_TIMEOUT_S
        servicer = RewardServicer(args.grader, args.timeout_s, GradingPool(max_workers=args.grading_workers),
                                  max_items=args.max_items, max_response_chars=args.max_response_chars)
        server, health, port = build_server(
            [(reward_pb2_grpc.add_RewardServiceServicer_to_server, servicer)],
            port=args.port, host=args.host, scoped_tokens=args.tokens, tls_cert=args.tls_cert, tls_key=args.tls_key,
        )
    except (ValueError, RuntimeError, FileNotFoundError, ConfigError, StartupError) as e:
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
