"""Build fp8rl's CPU images with podman on a machine that reaches no registry.

    python -m deploy.containers conf      # print the containers.conf path (write it if missing)
    python -m deploy.containers base      # the base image from Debian packages (cached)
    python -m deploy.containers build     # base + every role's CPU image; prints their sizes
    python -m deploy.containers check     # can podman run containers here? (one line; exit 3 when not)

Why each piece:

* **containers.conf** (``deploy/podman/containers.conf``, used unless ``$CONTAINERS_CONF`` names another):
  runc as the runtime (crun refuses a host with mixed cgroup setups), cgroupfs, and ulimits the host
  allows (nofile 20000, nproc 4096).
* **The base image** ``localhost/fp8rl-base:bookworm``: ``mmdebstrap --variant=apt`` of Debian bookworm
  with python3 (3.11), venv, pip, ca-certificates and passwd, from this machine's apt sources, piped
  into ``podman import``. The host's locally added CA certificates (``/usr/local/share/ca-certificates``,
  what ``update-ca-certificates`` installs) are baked in, so pip inside a build trusts what the host
  trusts. It is built once and reused while the image exists (``--rebuild`` forces it).
* **Torch**: the Dockerfiles install the CPU build (``torch==X+cpu``) from ``TORCH_INDEX_URL``. When
  this machine holds that wheel locally (pip's ``find-links``, e.g. ``/opt/wheels``), the build gets the
  directory as its ``wheels`` context and PyPI as the index, so nothing but PyPI is needed.
* **Host networking only** (``--network host``): builds reach the package index the way the host does,
  and containers talk over 127.0.0.1.

Images are tagged ``localhost/fp8rl/<role>:cpu``.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "deploy" / "podman" / "containers.conf"
BASE_IMAGE = "localhost/fp8rl-base:bookworm"
ROLES = ("trainer", "rollout", "reward", "calibrator", "controller")
BASE_PACKAGES = ("python3", "python3-venv", "python3-pip", "ca-certificates", "passwd")
LOCAL_CA_DIR = Path("/usr/local/share/ca-certificates")
EXIT_OK, EXIT_FAILED, EXIT_NO_PODMAN = 0, 1, 3

__all__ = ["BASE_IMAGE", "ROLES", "PodmanUnavailable", "build_base", "build_images", "env", "image_tag", "podman"]


class PodmanUnavailable(RuntimeError):
    """podman (or what the base image needs) is missing or cannot run containers here."""


def env() -> dict[str, str]:
    """The environment podman runs in: ``CONTAINERS_CONF`` set (ours unless the caller chose one)."""
    e = dict(os.environ)
    e.setdefault("CONTAINERS_CONF", str(CONF))
    return e


def podman(*args: str, check: bool = True, capture: bool = True, timeout: float | None = None,
           **kw) -> subprocess.CompletedProcess:
    """``podman ARGS`` under :func:`env`; a failure raises with podman's own message."""
    exe = shutil.which("podman")
    if exe is None:
        raise PodmanUnavailable("podman is not installed (apt-get install podman runc)")
    p = subprocess.run([exe, *args], env=env(), capture_output=capture, text=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        msg = (p.stderr or p.stdout or "").strip().splitlines()[-5:] if capture else []
        raise RuntimeError(f"podman {' '.join(args[:3])} ... exited with {p.returncode}: " + " | ".join(msg))
    return p


def check() -> str:
    """One line on what this machine's podman is; raises :class:`PodmanUnavailable` when it cannot run containers."""
    try:
        info = json.loads(podman("info", "--format", "json", timeout=60).stdout)
    except (RuntimeError, json.JSONDecodeError, subprocess.TimeoutExpired) as exc:
        raise PodmanUnavailable(f"podman cannot run here: {exc}") from None
    runtime = info.get("host", {}).get("ociRuntime", {}).get("name", "?")
    return f"podman {info.get('version', {}).get('Version', '?')}, runtime {runtime}, conf {env()['CONTAINERS_CONF']}"


def image_exists(tag: str) -> bool:
    return podman("image", "exists", tag, check=False).returncode == 0


def image_tag(role: str) -> str:
    return f"localhost/fp8rl/{role}:cpu"


def _apt_sources() -> list[str]:
    """This machine's apt source files (deb822 ``*.sources`` and one-line ``*.list``) that mmdebstrap reads."""
    files = sorted(glob.glob("/etc/apt/sources.list.d/*.sources")) + sorted(glob.glob("/etc/apt/sources.list.d/*.list"))
    if os.path.exists("/etc/apt/sources.list") and os.path.getsize("/etc/apt/sources.list"):
        files.insert(0, "/etc/apt/sources.list")
    return files


def build_base(*, rebuild: bool = False, log=print) -> str:
    """The base image (cached): Debian bookworm + python3 from packages, with the host's local CA certificates."""
    if not rebuild and image_exists(BASE_IMAGE):
        log(f"base image {BASE_IMAGE}: cached")
        return BASE_IMAGE
    if shutil.which("mmdebstrap") is None:
        raise PodmanUnavailable("mmdebstrap is not installed (apt-get install mmdebstrap)")
    sources = _apt_sources()
    if not sources:
        raise PodmanUnavailable("no apt sources under /etc/apt: mmdebstrap has no mirror to install from")
    certs = sorted(str(p) for p in LOCAL_CA_DIR.glob("**/*.crt")) if LOCAL_CA_DIR.is_dir() else []
    hooks = ['mkdir -p "$1/usr/local/share/ca-certificates"']
    if certs:
        hooks.append("copy-in " + " ".join(certs) + " /usr/local/share/ca-certificates/")
    hooks += ['chroot "$1" update-ca-certificates', 'rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*']
    cmd = ["mmdebstrap", "--variant=apt", "--include=" + ",".join(BASE_PACKAGES)]
    cmd += [f"--customize-hook={h}" for h in hooks]
    cmd += ["bookworm", "-", *sources]
    log(f"base image {BASE_IMAGE}: mmdebstrap bookworm ({', '.join(BASE_PACKAGES)}) + {len(certs)} local CA "
        f"certificate(s); about a minute")
    t0 = time.monotonic()
    mm = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    imp = subprocess.run([shutil.which("podman") or "podman", "import", "--change", 'CMD ["python3"]', "-", BASE_IMAGE],
                         stdin=mm.stdout, env=env(), capture_output=True, text=True)
    mm.stdout.close()
    mm_err = mm.stderr.read().decode(errors="replace")
    if mm.wait() != 0 or imp.returncode != 0:
        tail = "\n".join((mm_err + imp.stderr).strip().splitlines()[-10:])
        raise RuntimeError(f"building {BASE_IMAGE} failed (mmdebstrap {mm.returncode}, podman import "
                           f"{imp.returncode}):\n{tail}")
    log(f"base image {BASE_IMAGE}: built in {time.monotonic() - t0:.0f} s")
    return BASE_IMAGE


def local_torch_wheels() -> Path | None:
    """A directory holding the CPU torch wheel the images pin (pip's find-links here), or None."""
    version = _torch_version()
    dirs = []
    for line in subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                               text=True).stdout.splitlines():
        if "find-links" in line:
            dirs += [d.strip("'\" ") for d in line.split("=", 1)[1].split()]
    for d in dirs:
        if glob.glob(os.path.join(d, f"torch-{version}+cpu-*.whl")):
            return Path(d)
    return None


def _torch_version() -> str:
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pin = next(d for d in deps if d.replace(" ", "").startswith("torch=="))
    return pin.split("==", 1)[1].strip()


SERVICES_DOCKERFILE = "deploy/docker/fp8rl.Dockerfile"  # every role's image, one target each
# what an image leaves out of the shared CPU venv (the Dockerfile's REQUIREMENTS_EXCLUDE)
REQUIREMENTS_EXCLUDE = {"reward": "matplotlib tensorboard"}


def dockerfile(image: str) -> str:
    """The Dockerfile of ``image`` (a role, or ``redis``), relative to the repository."""
    return "deploy/docker/redis.Dockerfile" if image == "redis" else SERVICES_DOCKERFILE


def image_build_args(image: str) -> list[str]:
    """The ``podman build`` arguments that pick ``image``'s CPU target (and what it leaves out) in its Dockerfile."""
    if image == "redis":
        return []
    args = ["--target", image]
    if image in REQUIREMENTS_EXCLUDE:
        args += ["--build-arg", f"REQUIREMENTS_EXCLUDE={REQUIREMENTS_EXCLUDE[image]}"]
    return args


INPUTS_LABEL = "org.fp8rl.inputs"
# what the role images COPY (the .dockerignore admits no more); redis's image copies nothing
CONTEXT_PATHS = ("pyproject.toml", "README.md", "deploy/docker/requirements.py", "libs", "services")
_SKIP_PARTS = ("__pycache__", ".egg-info")


def context_digest() -> str:
    """SHA-256 over the build-context files the role images copy (paths and contents)."""
    h = hashlib.sha256()
    for rel in CONTEXT_PATHS:
        top = REPO / rel
        for p in sorted(p for p in top.rglob("*") if p.is_file()) if top.is_dir() else [top]:
            name = p.relative_to(REPO).as_posix()
            if any(s in name for s in _SKIP_PARTS) or name.endswith(".pyc"):
                continue
            h.update(name.encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def inputs_digest(image: str, build_args: list[str], base_id: str, context: str) -> str:
    """SHA-256 over what decides an image: its Dockerfile, the files it copies (``context``, from
    :func:`context_digest`; redis's image copies none), the build arguments and the base image's id. An
    image labelled with it needs no rebuild (podman re-hashes a 1.3 GB venv on every ``COPY --from`` even
    when all its layers are cached: about 30 s per image)."""
    h = hashlib.sha256()
    for part in (dockerfile(image), hashlib.sha256((REPO / dockerfile(image)).read_bytes()).hexdigest(), base_id,
                 "" if image == "redis" else context, *build_args):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def image_inputs(tag: str) -> str | None:
    """The inputs digest an existing image was built from (None: no such image, or built without one)."""
    p = podman("image", "inspect", tag, "--format", "{{index .Labels \"" + INPUTS_LABEL + "\"}}", check=False)
    return p.stdout.strip() or None if p.returncode == 0 else None


def build_images(roles=ROLES, *, base: str = BASE_IMAGE, log=print, rebuild: bool = False) -> dict[str, int]:
    """Build each of ``roles``' CPU image (``redis`` too, if named) on ``base``; returns their sizes in bytes.

    An image whose inputs (:func:`inputs_digest`) did not change since it was built is kept as it is,
    unless ``rebuild``."""
    wheels = local_torch_wheels()
    # docker format: OCI images have no HEALTHCHECK, and the images' health checks are the gRPC probe
    args = ["--format", "docker", "--network", "host", "--build-arg", f"BASE_IMAGE={base}",
            "--build-arg", f"TORCH_VERSION={_torch_version()}"]
    if wheels is not None:  # the CPU wheel is on this disk: no download.pytorch.org needed
        args += ["--build-context", f"wheels={wheels}", "--build-arg", "TORCH_INDEX_URL=https://pypi.org/simple"]
    sizes = {}
    base_id = podman("image", "inspect", base, "--format", "{{.Id}}").stdout.strip()
    context = context_digest()
    for role in roles:
        t0 = time.monotonic()
        role_args = args + image_build_args(role)
        digest = inputs_digest(role, role_args, base_id, context)
        if not rebuild and image_inputs(image_tag(role)) == digest:
            sizes[role] = image_size(image_tag(role))
            log(f"image {image_tag(role)}: {sizes[role] / 1e6:.0f} MB, up to date (inputs {digest[:12]})")
            continue
        log(f"image {image_tag(role)}: building" + (f" (torch from {wheels})" if wheels and role != "redis" else ""))
        p = podman("build", *role_args, "--label", f"{INPUTS_LABEL}={digest}", "-f", dockerfile(role), "-t",
                   image_tag(role), ".", check=False, cwd=REPO)
        if p.returncode != 0:
            tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-20:])
            raise RuntimeError(f"building {image_tag(role)} failed:\n{tail}")
        sizes[role] = image_size(image_tag(role))
        log(f"image {image_tag(role)}: {sizes[role] / 1e6:.0f} MB, built in {time.monotonic() - t0:.0f} s")
    return sizes


def image_size(tag: str) -> int:
    return int(podman("image", "inspect", tag, "--format", "{{.Size}}").stdout.strip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deploy.containers", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("conf", help="print the containers.conf in use")
    sub.add_parser("check", help="can podman run containers here?")
    b = sub.add_parser("base", help="build the base image (cached)")
    b.add_argument("--rebuild", action="store_true")
    i = sub.add_parser("build", help="base + the role images")
    i.add_argument("--rebuild-base", action="store_true")
    i.add_argument("--rebuild", action="store_true", help="build the images even where their inputs did not change")
    i.add_argument("roles", nargs="*", metavar="IMAGE",
                   help=f"images to build, of {', '.join((*ROLES, 'redis'))} (default: all)")
    args = ap.parse_args(argv)
    unknown = sorted(set(getattr(args, "roles", None) or ()) - {*ROLES, "redis"})
    if unknown:
        ap.error(f"unknown image(s) {', '.join(unknown)}: choose from {', '.join((*ROLES, 'redis'))}")
    try:
        if args.command == "conf":
            print(env()["CONTAINERS_CONF"])
        elif args.command == "check":
            print(check())
        elif args.command == "base":
            check()
            build_base(rebuild=args.rebuild)
        else:
            check()
            build_base(rebuild=args.rebuild_base)
            sizes = build_images(args.roles or (*ROLES, "redis"), rebuild=args.rebuild)
            print(json.dumps({image_tag(r): s for r, s in sizes.items()}))
        return EXIT_OK
    except PodmanUnavailable as exc:
        print(f"containers: {exc}", file=sys.stderr)
        return EXIT_NO_PODMAN
    except RuntimeError as exc:
        print(f"containers: error: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
