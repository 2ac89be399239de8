# syntax=docker/dockerfile:1
#
# mtpserve image. CPU by default; the CUDA variant is the same file with another torch wheel:
#   docker build -t mtpserve:0.1.0 .
#   docker build -t mtpserve:0.1.0-cu128 --build-arg TORCH_VARIANT=cu128 .
# Build where PyPI (or a mirror: --build-arg PIP_INDEX_URL=..., TORCH_INDEX_URL=...) is
# reachable; the image itself never needs the network (see docs/deploy.md).

ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# ---- build stage: a virtual environment with pinned dependencies and the package -------------
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
ARG PIP_INDEX_URL=https://pypi.org/simple
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_INDEX_URL=${PIP_INDEX_URL}
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src

# torch first (its version comes from the constraints), so the later `pip install` finds it
# satisfied and never pulls PyPI's default (CUDA) wheel into the CPU image: with both indexes,
# pip prefers 2.13.0+cpu (or +cu128) over plain 2.13.0, since a local version label sorts higher.
COPY deploy/constraints.txt /tmp/constraints.txt
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --extra-index-url "${TORCH_INDEX_URL}" -c /tmp/constraints.txt torch

# Then every other dependency at the version in deploy/constraints.txt, and the package itself
# (not editable: the run stage copies only the virtual environment).
COPY . /src
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -c /tmp/constraints.txt /src

# ---- run stage ---------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS run
ARG TORCH_VARIANT=cpu

# Triton (CUDA variant only) compiles a small C launcher the first time a kernel runs.
RUN if [ "${TORCH_VARIANT}" != "cpu" ]; then \
        apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && \
        rm -rf /var/lib/apt/lists/*; \
    fi

# A fixed, unprivileged uid so file permissions on mounted volumes are predictable.
RUN groupadd --system --gid 10001 mtpserve && \
    useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin mtpserve && \
    install -d -o 10001 -g 10001 /var/cache/mtpserve

COPY --from=build /opt/venv /opt/venv
# The shipped demo model; mount another folder and point MTPSERVE_MODEL at it to serve that one.
COPY models/demo /opt/mtpserve/models/demo

# Read-only root filesystem: no .pyc writes, every cache under the one writable volume, and
# nothing may try the network (invariant 5: models and tokenizers load from local folders only).
# No NVIDIA_VISIBLE_DEVICES=all here: which GPUs a container sees is the reservation's decision
# (compose.gpu.yml), and that variable would widen it under the legacy nvidia runtime.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MTPSERVE_MODEL=/opt/mtpserve/models/demo \
    XDG_CACHE_HOME=/var/cache/mtpserve \
    HF_HOME=/var/cache/mtpserve/huggingface \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HUB_DISABLE_TELEMETRY=1 \
    TRITON_CACHE_DIR=/var/cache/mtpserve/triton \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/mtpserve/inductor \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

WORKDIR /opt/mtpserve
USER 10001:10001
VOLUME ["/var/cache/mtpserve"]

# 8000: the OpenAI-compatible API. 9464: /metrics, for Prometheus only (never publish it).
EXPOSE 8000 9464

# Ready, not merely alive: /ready answers 200 once the model is loaded and while not draining.
# Python's urllib, because the slim image has no curl; a non-2xx status raises and exits 1.
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/ready', timeout=4)"]

# SIGTERM makes the server stop admitting work, finish (or abort and zero) what is in flight,
# and exit; docker-compose.yml gives it stop_grace_period: 60s before SIGKILL.
STOPSIGNAL SIGTERM
ENTRYPOINT ["mtpserve"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000", "--metrics-port", "9464"]
