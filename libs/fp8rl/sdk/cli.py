"""The ``fp8rl`` command line: submit, watch, inspect and cancel GRPO jobs; bring the stack up/down.

Usage::

    fp8rl [--target HOST:PORT] [--token TOKEN | --token-file FILE] [--tls-ca PEM] [--timeout S] COMMAND ...

    fp8rl submit JOB.yaml [--job-id ID] [--watch]   validate locally, submit, print the job id
    fp8rl watch JOB_ID [--from-step N] [--plain]    live progress: reward, accuracy, token_mult_prob_error
    fp8rl status [JOB_ID] [--state S] [--limit N]   a table of jobs (or of one job)
    fp8rl cancel JOB_ID [--reason TEXT]             stop a job after its current step
    fp8rl up|down [ARGS ...]                        start/stop the local stack (delegates to deploy.launcher)
    fp8rl export CHECKPOINT --out DIR [--format hf|hf-fp8] [--model M]
                                                    a checkpoint as an HF directory (delegates to fp8rl.export)
    fp8rl eval MODEL --data FILE [--k K] [--config JOB.yaml]
                                                    pass@k of a preset, HF directory or checkpoint (fp8rl.eval)

The target comes from ``--target``, else ``$FP8RL_TARGET``, else ``localhost:50050``; the client
token (the JobService scope) from ``--token``, else ``--token-file``, else ``$FP8RL_AUTH_TOKEN``, else the
file ``$FP8RL_TOKEN_FILE`` — ``python -m deploy.launcher up`` writes it to ``RUN/secrets/client.token``.

Exit codes: 0 success; 2 bad input (invalid job file, unknown job, id taken, bad arguments);
3 controller unavailable (unreachable or not answering in time); 1 anything else, including a
watched job that ended ``failed`` or ``cancelled`` and a rejected token; 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Sequence

from fp8rl.config import ConfigError

from .client import DEFAULT_TARGET, ENV_TARGET, Fp8rlClient, load_job_text
from .types import AlreadyExists, Fp8rlError, InvalidArgument, JobInfo, NotFound, StepReport, Unavailable

__all__ = ["main"]

EXIT_OK, EXIT_OTHER, EXIT_BAD_INPUT, EXIT_UNAVAILABLE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
LAUNCHER_MODULE = "deploy.launcher"


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _fail(message: object, code: int) -> int:
    print(f"fp8rl: error: {_one_line(message)}", file=sys.stderr)
    return code


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fp8rl", description="Submit and watch fp8rl GRPO jobs.")
    p.add_argument("--target", default=None,
                   help=f"controller host:port (default ${ENV_TARGET}, else {DEFAULT_TARGET})")
    p.add_argument("--token", default=None, help="client bearer token (default $FP8RL_AUTH_TOKEN)")
    p.add_argument("--token-file", default=None,
                   help="file holding the client token (default $FP8RL_TOKEN_FILE; the launcher writes "
                        "RUN/secrets/client.token)")
    p.add_argument("--tls-ca", default=None, help="PEM CA file to verify the controller (default $FP8RL_TLS_CA)")
    p.add_argument("--timeout", type=float, default=None, help="deadline of each call in seconds")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("submit", help="validate and submit a job file")
    s.add_argument("job_file", metavar="JOB.yaml")
    s.add_argument("--job-id", default=None, help="choose the id (makes retrying the submit safe)")
    s.add_argument("--watch", action="store_true", help="watch the job after submitting it")
    s.add_argument("--plain", action="store_true", help="with --watch: one line per step, no progress bar")

    w = sub.add_parser("watch", help="follow a job's steps until it ends")
    w.add_argument("job_id", metavar="JOB_ID")
    w.add_argument("--from-step", type=int, default=0, help="first step to show (default 0)")
    w.add_argument("--plain", action="store_true", help="one line per step, no progress bar")

    st = sub.add_parser("status", help="show jobs")
    st.add_argument("job_id", nargs="?", metavar="JOB_ID")
    st.add_argument("--state", default="", help="only jobs in this state")
    st.add_argument("--limit", type=int, default=0, help="at most this many jobs")

    c = sub.add_parser("cancel", help="stop a job after its current step")
    c.add_argument("job_id", metavar="JOB_ID")
    c.add_argument("--reason", default="cancelled from the fp8rl CLI")

    for name, what in (("up", "start the local stack"), ("down", "stop the local stack")):
        sub.add_parser(name, help=f"{what} (delegates to {LAUNCHER_MODULE}; further arguments are passed on)")
    # its own parser (python -m fp8rl.export) reads every argument after the word, --help included
    sub.add_parser("export", add_help=False, help="export a trainer checkpoint as a Hugging Face directory "
                   "(fp8rl export --help)")
    sub.add_parser("eval", add_help=False, help="score a preset, HF directory or checkpoint on a data file: greedy "
                   "accuracy, pass@k, mean@k (fp8rl eval --help)")
    return p


# -- output ------------------------------------------------------------------------------------


def _fmt_time(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix)) if unix > 0 else "-"


def _print_table(jobs: Sequence[JobInfo]) -> None:
    rows = [("JOB_ID", "STATE", "STEP", "CREATED", "UPDATED", "ERROR")]
    rows += [(j.job_id, j.state, f"{j.step}/{j.total_steps}", _fmt_time(j.created_unix), _fmt_time(j.updated_unix),
              _one_line(j.error)) for j in jobs]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())


def _step_fields(r: StepReport) -> dict[str, str]:
    fields = {"reward": f"{r.reward_mean:.3f}", "acc": f"{r.accuracy:.3f}"}
    if r.token_mult_prob_error is not None:
        fields["mult_err"] = f"{r.token_mult_prob_error:.6f}"
    if r.max_abs_logprob_diff is not None:  # 0.0e+00: bitwise the rollout's
        fields["max_dlogp"] = f"{r.max_abs_logprob_diff:.1e}"
    return fields


def _watch(client: Fp8rlClient, job_id: str, from_step: int, plain: bool) -> int:
    info = client.get_job(job_id)  # fails fast (NotFound / Unavailable) before any stream opens
    use_bar = not plain and sys.stderr.isatty()
    bar = None
    if use_bar:
        from tqdm import tqdm

        bar = tqdm(total=info.total_steps or None, initial=min(from_step, info.total_steps or from_step),
                   desc=job_id, unit="step", dynamic_ncols=True)
    try:
        for report in client.watch(job_id, from_step):
            if bar is not None:
                bar.update(max(0, report.step + 1 - bar.n))
                bar.set_postfix(_step_fields(report), refresh=True)
            else:
                fields = " ".join(f"{k}={v}" for k, v in _step_fields(report).items())
                print(f"step {report.step + 1}/{info.total_steps} {fields} state={report.state}", flush=True)
    finally:
        if bar is not None:
            bar.close()
    final = client.get_job(job_id)
    why = f": {_one_line(final.error)}" if final.error else ""
    print(f"job {job_id} {final.state} after {final.step} steps{why}")
    return EXIT_OK if final.state == "succeeded" else EXIT_OTHER


def _launcher(command: str, args: list[str]) -> int:
    if os.path.isfile(os.path.join("deploy", "launcher.py")) and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # the launcher ships in the repo, not in the installed package
    try:
        launcher = importlib.import_module(LAUNCHER_MODULE)
    except ModuleNotFoundError as e:
        if not (e.name == LAUNCHER_MODULE or LAUNCHER_MODULE.startswith(f"{e.name}.")):
            raise  # the launcher exists but something it imports is missing: show that, not "not installed"
        return _fail(f"'fp8rl {command}' needs the local launcher ({LAUNCHER_MODULE}), which is not importable here; "
                     "run it from the fp8rl repository root, or start the services yourself with "
                     "`python -m services.<role>`", EXIT_OTHER)
    entry = getattr(launcher, "main", None)
    if not callable(entry):
        return _fail(f"{LAUNCHER_MODULE} has no main(argv) function to run '{command}'", EXIT_OTHER)
    result = entry([command, *args])
    return int(result or 0)


# -- entry point -------------------------------------------------------------------------------


def _run(args: argparse.Namespace) -> int:
    if args.command in ("up", "down"):
        return _launcher(args.command, args.args)
    if args.command == "export":  # local: no controller, no token
        from fp8rl.export.__main__ import main as export_main

        return export_main(args.args, prog="fp8rl export")
    if args.command == "eval":  # local too
        from fp8rl.eval.__main__ import main as eval_main

        return eval_main(args.args, prog="fp8rl eval")
    if args.command == "submit":
        load_job_text(args.job_file)  # validate before even opening a channel
    with Fp8rlClient(args.target, token=args.token, token_file=args.token_file, tls_ca=args.tls_ca,
                     timeout_s=args.timeout) as client:
        if args.command == "submit":
            job_id = client.submit_job(args.job_file, job_id=args.job_id)
            print(job_id, flush=True)
            return _watch(client, job_id, 0, args.plain) if args.watch else EXIT_OK
        if args.command == "watch":
            return _watch(client, args.job_id, args.from_step, args.plain)
        if args.command == "status":
            _print_table([client.get_job(args.job_id)] if args.job_id else client.list_jobs(args.state, args.limit))
            return EXIT_OK
        if args.command == "cancel":
            info = client.cancel_job(args.job_id, args.reason)
            print(f"job {info.job_id} {info.state}")
            return EXIT_OK
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse only accepts the ones above


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit code (see the module docstring)."""
    parser = _build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and args.command not in ("up", "down", "export", "eval"):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:  # argparse: --help (0) or a usage error (2, message already printed)
        return int(e.code or 0)
    args.args = extra
    try:
        return _run(args)
    except ConfigError as e:
        return _fail(e, EXIT_BAD_INPUT)
    except (InvalidArgument, NotFound, AlreadyExists) as e:
        return _fail(e, EXIT_BAD_INPUT)
    except Unavailable as e:
        return _fail(e, EXIT_UNAVAILABLE)
    except Fp8rlError as e:
        return _fail(e, EXIT_OTHER)
    except (FileNotFoundError, ValueError) as e:  # e.g. a missing --tls-ca file, a bad --timeout
        return _fail(e, EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
