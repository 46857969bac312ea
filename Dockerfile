# Tracehound's one image. Every component is the same `tracehound` command, chosen by its
# arguments (the ENTRYPOINT is `tracehound`):
#
#   operator                   the Kubernetes operator (charts/tracehound runs it)
#   agent                      the node agent: the sidecar of every rank pod, the node-health DaemonSet
#   bundle --into DIR          copies the recorder for training images (the rank pods' init container)
#   dashboard --port 8501      the dashboard
#   run / diagnose / status / incidents / ...   the command line, as on a workstation
#
# Built and pushed as the chart's default image (values.yaml: image.repository, and the tag is the
# chart's appVersion, the version in pyproject.toml):
#
#   docker build -t ghcr.io/tracehound/tracehound:0.1.0 .
#
# No secret is baked in: the store URL and alert receivers reach the containers from Kubernetes
# Secrets (or the environment) when they run.
FROM python:3.11-slim

ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="tracehound" \
      org.opencontainers.image.description="Finds the rank and node behind a hung, slow or crashed distributed training job, isolates it and restarts from checkpoint" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="docker.io/library/python:3.11-slim"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The CPU build of torch first, pinned to the version the Makefile installs for the demo and the
# tests (the package itself does not require torch: training images bring their own); an unpinned
# torch would pull a CUDA build of several GB.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

WORKDIR /src
COPY pyproject.toml README.md ./
COPY tracing tracing
COPY agent agent
COPY analysis analysis
COPY controller controller
COPY ui ui
RUN pip install ".[all]" \
    && cd / && rm -rf /src

# A numeric non-root user (the chart's runAsUser and fsGroup); its home is the working directory.
RUN groupadd --system --gid 10001 tracehound \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/tracehound --create-home \
        --shell /usr/sbin/nologin tracehound
WORKDIR /var/lib/tracehound
USER 10001:10001

ENTRYPOINT ["tracehound"]
CMD ["--help"]
