# syntax=docker/dockerfile:1
# Tessera's dependencies on top of Flower's official Ubuntu images (glibc: torch has no wheels for the Alpine
# images that the bare `flwr/superlink:<version>` / `flwr/supernode:<version>` tags point to).
# Build context: the repository root (see deploy/docker-compose.yml).
#   ROLE=supernode  -> flower-supernode that runs its ClientApps in a subprocess (the deploy/supernode.sh setup)
#   ROLE=superexec  -> flower-superexec that runs the ServerApp for a SuperLink started with `--isolation process`
#   TORCH_INDEX_URL -> CPU wheels by default; a CUDA wheel index for GPU hosts (deploy/docker-compose.gpu.yml)
# Both bases are flwr/base:<version>-py3.11-ubuntu24.04 plus an ENTRYPOINT; keep them on the installed flwr
# version (tests/test_deploy_static.py checks) and on the Python the project is tested with.
# `FROM base-${ROLE}` picks one of them (BuildKit, the default builder of Docker Compose v2, skips the other).
ARG ROLE=supernode
FROM flwr/supernode:1.41.0-py3.11-ubuntu24.04 AS base-supernode
FROM flwr/superexec:1.41.0-py3.11-ubuntu24.04 AS base-superexec

FROM base-${ROLE}
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# Offline assets go to a cache OUTSIDE the project copy (/opt/tessera) and outside the app's working directory
# (/app, where Flower unpacks app bundles and where runs/ is written); it stays writable because the loaders take
# a lock file in it. /app/certs, /app/state and /app/runs are mount points of named volumes: Docker initialises
# an empty named volume from the image's directory, owner included, so they must exist owned by `app`.
USER root
RUN mkdir -p /opt/tessera /opt/tessera-cache /app/certs /app/runs \
    && chown -R app:app /opt/tessera /opt/tessera-cache /app/certs /app/runs
USER app
ENV TESSERA_CACHE=/opt/tessera-cache \
    TESSERA_RUN_ROOT=/app

# torch first, from its own index: resolving the project's `torch>=...` from PyPI would pull a multi-GB CUDA build.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

# Then the project. The [simulation] extra (Ray) is for `flwr run . local` only, not for a deployment, and the
# base image's flwr is pinned so that pip cannot move it away from the image's version.
COPY --chown=app:app . /opt/tessera
WORKDIR /opt/tessera
RUN sed -i 's/"flwr\[simulation\]/"flwr/' pyproject.toml \
    && pip freeze | grep -i '^flwr==' > /tmp/flwr-pin.txt \
    && pip install --no-cache-dir -c /tmp/flwr-pin.txt . \
    && python -m common.assets
WORKDIR /app
