# The gateway: the client API, admission control and the request loop; CPU only, no torch.
# Build from the repo root: docker build -f docker/gateway.Dockerfile -t diffspec-gateway .
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
WORKDIR /opt/diffspec
COPY pyproject.toml README.md ./
COPY diffspec ./diffspec
COPY target_service ./target_service
COPY draft_service ./draft_service
COPY gateway ./gateway
COPY diffspec_kernels ./diffspec_kernels
COPY cli ./cli
# Split, the gateway relays features as bytes and trees as lists: it installs pyproject's `gateway`
# extra (no torch), then the package without its model dependencies.
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['gateway']))" \
        > /tmp/gateway-requirements.txt \
    && pip install -r /tmp/gateway-requirements.txt \
    && pip install --no-deps .

EXPOSE 50051
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-m", "diffspec.health_probe", "127.0.0.1:50051"]
CMD ["diffspec", "serve", "gateway", "--listen", "0.0.0.0:50051"]
