# syntax=docker/dockerfile:1
# Image of the kvstore daemon, deployed by the Helm chart in helm/kvstore.
# CI does not build this image (no container engine there); build it with BuildKit (Docker >= 23):
#   docker build -t kvstore:0.1.0 .
# It is CPU-only (accelerator=none). For accelerator=nvidia, pass the CUDA index that matches the nodes'
# driver: --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/<cuda tag>.
# accelerator=ascend needs an image built on a CANN base with torch-npu.

# Build the two wheels, the daemon's (kvstore-sidecar, with its native copy engine: C++, needs g++ and the
# Python headers) and the client's it requires (kvstore-sidecar-client), with .ci/build-wheel: the
# command CI builds the wheels it tests with, so the image cannot drift from them.
FROM python:3.11-slim AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# The source is bind-mounted, so no layer keeps it (the build itself runs in a scratch directory).
RUN --mount=type=bind,target=/src,rw \
    bash /src/.ci/build-wheel /wheels

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, from the CPU index: otherwise the daemon's torch requirement pulls a CUDA build of several GB.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install torch==2.13.0 --index-url "${TORCH_INDEX_URL}"

# Then kvstore itself: both wheels built in the stage above, installed together as CI installs the ones
# it tests (the client's wheel satisfies the daemon's kvstore-sidecar-client requirement).
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels pip install /wheels/*.whl

# The chart runs the daemon as this uid/gid (podSecurityContext.runAsUser/runAsGroup).
RUN groupadd --system --gid 10001 kvstore \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin kvstore
USER 10001:10001

ENTRYPOINT ["kvstore", "serve"]
