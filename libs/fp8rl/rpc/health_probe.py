"""``python -m fp8rl.rpc.health_probe``: one standard ``grpc.health.v1`` check, as an exit status.

The container health check of every fp8rl image (Dockerfile ``HEALTHCHECK``, compose ``healthcheck``)
and a handy manual probe; Kubernetes uses its native ``grpc:`` probe instead, which asks the same
question. It prints one line and exits:

* 0 — the server answered SERVING;
* 1 — it answered anything else (NOT_SERVING while the model loads or while it shuts down, UNKNOWN);
* 2 — no answer: not listening, deadline passed, TLS mismatch, or an unknown ``--service`` name.

The target defaults to ``127.0.0.1:$FP8RL_PORT`` so an image's exec-form ``HEALTHCHECK`` needs no shell.
Health ``Check`` is exempt from the bearer token (see :mod:`fp8rl.rpc.scopes`), so none is sent by default —
but a server with tokens answers a caller without one with its *overall* status and never reads the request,
so ``--service`` is only told apart (an unknown name is NOT_FOUND) with ``--token-file`` (either scope's token).
With TLS on the server pass ``--tls-ca`` (or set ``$FP8RL_TLS_CA``) and a target whose name the certificate holds.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .channel import make_channel, read_token_file

__all__ = ["EXIT_SERVING", "EXIT_NOT_SERVING", "EXIT_UNREACHABLE", "check", "main"]

EXIT_SERVING, EXIT_NOT_SERVING, EXIT_UNREACHABLE = 0, 1, 2


def check(target: str, service: str = "", timeout_s: float = 3.0, tls_ca: str | None = None,
          token: str = "") -> tuple[int, str]:
    """Asks ``target``'s health service about ``service`` ("" = the whole server), with ``token`` when given
    (without one a server that has tokens answers its overall status whatever ``service`` names).

    Returns:
        ``(exit status, one line for people)``; the status is one of the ``EXIT_*`` constants.
    """
    channel = make_channel(target, token=token, tls_ca=tls_ca)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.RpcError as err:
        what = f"service {service!r}" if service else "the server"
        return EXIT_UNREACHABLE, f"{target}: no health answer for {what}: {err.code().name}: {err.details()}"
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    code = EXIT_SERVING if reply.status == health_pb2.HealthCheckResponse.SERVING else EXIT_NOT_SERVING
    return code, f"{target}: {status}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp8rl.rpc.health_probe", description=__doc__.splitlines()[0])
    p.add_argument("target", nargs="?", default=None,
                   help="host:port (default 127.0.0.1:$FP8RL_PORT, or --port)")
    p.add_argument("--port", type=int, default=None, help="port on 127.0.0.1 when no target is given")
    p.add_argument("--service", default="", help="fully qualified service name; default: the whole server")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    p.add_argument("--token-file", default=None,
                   help="file holding either scope's token: the server then reads --service (default: no token)")
    p.add_argument("--tls-ca", default=None, help="PEM CA of the server's certificate (default $FP8RL_TLS_CA)")
    args = p.parse_args(argv)
    target = args.target
    if target is None:
        port = args.port if args.port is not None else os.environ.get("FP8RL_PORT")
        if port is None:
            p.error("give a target host:port, --port, or set $FP8RL_PORT")
        target = f"127.0.0.1:{port}"
    token = read_token_file(args.token_file) if args.token_file else ""
    code, line = check(target, args.service, args.timeout, args.tls_ca, token)
    print(line, file=sys.stdout if code == EXIT_SERVING else sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
