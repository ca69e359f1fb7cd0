# Redis for the compose stack where no registry can be reached (the podman smoke run): Debian's
# redis-server on the local base image. With a registry, compose.yaml's redis:7.4.2-alpine is the same
# thing, smaller. Built by `python -m deploy.containers build` as localhost/fp8rl/redis:cpu.
ARG BASE_IMAGE=localhost/fp8rl-base:bookworm
FROM ${BASE_IMAGE} AS cpu
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends redis-server redis-tools \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/* \
 && mkdir -p /data && chown redis:redis /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server", "--protected-mode", "yes", "--bind", "127.0.0.1"]
