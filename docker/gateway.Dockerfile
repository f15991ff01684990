# The gateway: the client API, admission control and the request loop; CPU only.
# Build from the repo root: docker build -f docker/gateway.Dockerfile -t diffspec-gateway .
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
WORKDIR /opt/diffspec
COPY pyproject.toml README.md ./
COPY diffspec ./diffspec
COPY target_service ./target_service
COPY draft_service ./draft_service
COPY gateway ./gateway
COPY kernels ./kernels
COPY cli ./cli
# the gateway imports torch for its types only: the CPU wheel keeps the image small
RUN pip install 'torch==2.13.0' --index-url https://download.pytorch.org/whl/cpu && pip install .

EXPOSE 50051
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-m", "diffspec.health_probe", "127.0.0.1:50051"]
CMD ["diffspec", "serve", "gateway", "--listen", "0.0.0.0:50051"]
