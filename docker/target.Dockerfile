# The target service (Llama target, paged KV, tree verification) on one NVIDIA GPU.
# Build from the repo root: docker build -f docker/target.Dockerfile -t diffspec-target .
FROM nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-pip \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/diffspec
COPY pyproject.toml README.md ./
COPY diffspec ./diffspec
COPY target_service ./target_service
COPY draft_service ./draft_service
COPY gateway ./gateway
COPY diffspec_kernels ./diffspec_kernels
COPY cli ./cli
# torch's Linux wheel brings CUDA and Triton; flash-attn (the gpu extra) needs a devel image to build
RUN pip3 install 'torch==2.13.0' && pip3 install .

EXPOSE 50051
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-m", "diffspec.health_probe", "127.0.0.1:50051"]
CMD ["diffspec", "serve", "target", "--listen", "0.0.0.0:50051"]
