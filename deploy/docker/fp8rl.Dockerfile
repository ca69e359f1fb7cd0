# syntax=docker/dockerfile:1
# fp8rl's service images: one file, one build per variant shared by every role, one target per image.
# Build from the repository root (the context is the repo; .dockerignore keeps it small):
#   docker build -f deploy/docker/fp8rl.Dockerfile --target trainer -t fp8rl/trainer:cpu .
#   docker build -f deploy/docker/fp8rl.Dockerfile --target rollout-gpu -t fp8rl/rollout:gpu .
#   docker build -f deploy/docker/fp8rl.Dockerfile --target trainer-gpu --build-arg GPU_ENGINE=megatron \
#       -t fp8rl/trainer:gpu .
# CPU targets (the embedded torch engines): controller, trainer, rollout, reward, calibrator. GPU targets: rollout-gpu
# (vLLM FP8, GPU_ENGINE=vllm, the default) and trainer-gpu (Megatron-Core + Transformer Engine, GPU_ENGINE=megatron);
# a GPU target built with the other engine refuses at build time, naming the argument.
# Every image: non-root (uid 10001), PYTHONUNBUFFERED, health = gRPC grpc.health.v1 through fp8rl.rpc.health_probe.
# BASE_IMAGE: any Debian/Ubuntu image with python3 (3.11), venv and pip, plus groupadd/useradd. Without a
# registry, `python -m deploy.containers base` makes one from Debian packages (localhost/fp8rl-base:bookworm).
ARG BASE_IMAGE=python:3.11.13-slim-bookworm
# where the CPU build of torch comes from, unless the `wheels` stage below is given a local wheel directory
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG CUDA_BUILD_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04
ARG CUDA_RUNTIME_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.8.22

FROM ${UV_IMAGE} AS uv

# the local wheels of torch, when the build is given some (--build-context wheels=DIR); empty otherwise
FROM scratch AS wheels

# ---------------------------------------------------------------- GPU: one venv, the engine chosen by GPU_ENGINE
# CUDA base; Python is a standalone CPython build (uv) so the image's glibc does not matter.
FROM ${CUDA_BUILD_IMAGE} AS gpu-build
ARG PYTHON_VERSION=3.11.13
ARG GPU_ENGINE=vllm
ARG VLLM_VERSION=0.32.0
ARG TORCH_CUDA_VERSION=2.13.0
ARG MEGATRON_CORE_VERSION=0.16.1
ARG TE_VERSION=2.20.2
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_PYTHON_INSTALL_DIR=/opt/python UV_NO_CACHE=1 UV_LINK_MODE=copy VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN uv venv --python "${PYTHON_VERSION}" /opt/venv
WORKDIR /src
# the engine first: it pins the CUDA torch build it was compiled against
RUN case "${GPU_ENGINE}" in \
      vllm) uv pip install "vllm==${VLLM_VERSION}" ;; \
      megatron) uv pip install --index-url https://download.pytorch.org/whl/cu128 "torch==${TORCH_CUDA_VERSION}" \
        && uv pip install "megatron-core==${MEGATRON_CORE_VERSION}" \
        && uv pip install --no-build-isolation "transformer-engine[pytorch]==${TE_VERSION}" ;; \
      *) echo "GPU_ENGINE=${GPU_ENGINE}: vllm (rollout-gpu) or megatron (trainer-gpu)" >&2; exit 1 ;; \
    esac
COPY pyproject.toml ./
COPY deploy/docker/requirements.py deploy/docker/requirements.py
RUN python deploy/docker/requirements.py --exclude torch > /tmp/requirements.txt \
 && uv pip install --requirement /tmp/requirements.txt
# README after the dependency layers: a docs edit rebuilds only what follows
COPY README.md ./
COPY libs ./libs
COPY services ./services
RUN uv pip install --no-deps .

FROM ${CUDA_RUNTIME_IMAGE} AS gpu-runtime
RUN groupadd --system --gid 10001 fp8rl \
 && useradd --system --uid 10001 --gid fp8rl --home-dir /home/fp8rl --create-home --shell /usr/sbin/nologin fp8rl \
 && mkdir -p /var/cache/fp8rl /var/lib/fp8rl \
 && chown fp8rl:fp8rl /var/cache/fp8rl /var/lib/fp8rl
COPY --from=gpu-build /opt/python /opt/python
COPY --from=gpu-build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    FP8RL_CACHE=/var/cache/fp8rl HF_HOME=/var/cache/fp8rl/hf
WORKDIR /home/fp8rl
USER 10001:10001
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 CMD ["python", "-m", "fp8rl.rpc.health_probe"]

FROM gpu-runtime AS rollout-gpu
RUN python -c "import vllm" || { echo "rollout-gpu needs --build-arg GPU_ENGINE=vllm" >&2; exit 1; }
ENV FP8RL_PORT=50052
EXPOSE 50052
ENTRYPOINT ["python", "-m", "services.rollout"]

FROM gpu-runtime AS trainer-gpu
RUN python -c "import megatron.core" || { echo "trainer-gpu needs --build-arg GPU_ENGINE=megatron" >&2; exit 1; }
ENV FP8RL_PORT=50051 FP8RL_CHECKPOINT_DIR=/var/lib/fp8rl/checkpoints
EXPOSE 50051
ENTRYPOINT ["python", "-m", "services.trainer"]

# ---------------------------------------------------------------- CPU: the embedded torch engines, one venv
FROM ${BASE_IMAGE} AS cpu-build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL
ARG PIP_INDEX_URL
# project names an image leaves out, space-separated (the reward image: "matplotlib tensorboard"); requirements.py
# reads it from the environment, where a RUN sees its stage's ARGs
ARG REQUIREMENTS_EXCLUDE=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv
WORKDIR /src
# the CPU build of torch, by exact version, before the rest resolves against it
RUN --mount=type=bind,from=wheels,target=/wheels \
    pip install --no-cache-dir --find-links /wheels --index-url "${TORCH_INDEX_URL}" --extra-index-url "${PIP_INDEX_URL}" \
        "torch==${TORCH_VERSION}+cpu"
COPY pyproject.toml ./
COPY deploy/docker/requirements.py deploy/docker/requirements.py
RUN python deploy/docker/requirements.py --exclude-from-env REQUIREMENTS_EXCLUDE > /tmp/requirements.txt \
 && pip install --no-cache-dir --requirement /tmp/requirements.txt
# README after the dependency layers: a docs edit rebuilds only what follows
COPY README.md ./
COPY libs ./libs
COPY services ./services
RUN pip install --no-cache-dir --no-deps .

FROM ${BASE_IMAGE} AS cpu-runtime
# bubblewrap: the python environment's code sandbox (fp8rl.envs.sandbox; the env workers run in the reward service).
# In the container it runs as uid 10001 in a user namespace, without /proc where the runtime masks the host's.
# Unpinned: the base image's Debian release chooses the version (a pin would break on another BASE_IMAGE).
# hadolint ignore=DL3008
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends bubblewrap && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 fp8rl \
 && useradd --system --uid 10001 --gid fp8rl --home-dir /home/fp8rl --create-home --shell /usr/sbin/nologin fp8rl \
 && mkdir -p /var/cache/fp8rl /var/lib/fp8rl \
 && chown fp8rl:fp8rl /var/cache/fp8rl /var/lib/fp8rl
COPY --from=cpu-build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 FP8RL_CACHE=/var/cache/fp8rl
WORKDIR /home/fp8rl
USER 10001:10001
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 CMD ["python", "-m", "fp8rl.rpc.health_probe"]

FROM cpu-runtime AS calibrator
ENV FP8RL_PORT=50054
EXPOSE 50054
ENTRYPOINT ["python", "-m", "services.calibrator"]

FROM cpu-runtime AS reward
ENV FP8RL_PORT=50053
EXPOSE 50053
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 CMD ["python", "-m", "fp8rl.rpc.health_probe"]
ENTRYPOINT ["python", "-m", "services.reward"]
CMD ["--port", "50053"]

FROM cpu-runtime AS controller
ENV FP8RL_PORT=50050
EXPOSE 50050
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 CMD ["python", "-m", "fp8rl.rpc.health_probe"]
ENTRYPOINT ["python", "-m", "services.controller"]

FROM cpu-runtime AS rollout
ENV FP8RL_PORT=50052
EXPOSE 50052
ENTRYPOINT ["python", "-m", "services.rollout"]

FROM cpu-runtime AS trainer
ENV FP8RL_PORT=50051 FP8RL_CHECKPOINT_DIR=/var/lib/fp8rl/checkpoints
EXPOSE 50051
ENTRYPOINT ["python", "-m", "services.trainer"]
