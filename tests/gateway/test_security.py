"""TLS, mutual TLS and the bearer token on every server, and the gateway's own admission of tokenization.

The split deployment here runs mutual TLS between the gateway and its services (each presents a
certificate of the test's CA) and one shared token on all three; the certificates are made here.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diffspec.errors import InvalidRequest, ResourceExhausted
from diffspec.metrics import ServingMetrics
from diffspec.serving import Loading
from diffspec.settings import DiffSpecSettings
from diffspec.v1 import gateway_pb2, gateway_pb2_grpc, target_pb2, target_pb2_grpc
from gateway.client import stream_generate
from gateway.server import MAX_CHARS_PER_TOKEN, GatewayServicer
from gateway.tokenizer_pool import TokenizerPool
from tests.gateway.conftest import CODE_PROMPTS
from tests.gateway.servers import SplitDeployment

TOKEN = "s3cret-token"
MAX_NEW = 16


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, key, issuer: str, issuer_key, is_ca: bool) -> x509.Certificate:  # noqa: ANN001
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if not is_ca:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.PEM)


def make_pki(directory: Path, name: str) -> dict[str, Path]:
    """A CA and one certificate it signed for localhost and 127.0.0.1: {"ca", "cert", "key"} PEM files."""
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _certificate(f"{name} CA", ca_key, f"{name} CA", ca_key, is_ca=True)
    leaf = _certificate("localhost", key, f"{name} CA", ca_key, is_ca=False)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    files = {"ca": _pem(ca), "cert": _pem(leaf), "key": key_pem}
    paths = {kind: directory / f"{name}-{kind}.pem" for kind in files}
    for kind, data in files.items():
        paths[kind].write_bytes(data)
    return paths


def credentials(pki: dict[str, Path], client_certificate: bool = True) -> grpc.ChannelCredentials:
    pair = {"private_key": pki["key"].read_bytes(), "certificate_chain": pki["cert"].read_bytes()}
    return grpc.ssl_channel_credentials(pki["ca"].read_bytes(), **(pair if client_certificate else {}))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    return make_pki(tmp_path_factory.mktemp("pki"), "deployment")


@pytest.fixture(scope="module")
def secure_deployment(pki, draft_head_dir, tmp_path_factory) -> Iterator[SplitDeployment]:
    """Mutual TLS between the gateway and its services, TLS to the gateway, one token everywhere."""
    tls = ["--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"])]
    deployment = SplitDeployment(
        tmp_path_factory.mktemp("secure-logs"),
        draft_head_dir,
        *tls,
        "--tls-ca",
        str(pki["ca"]),
        "--auth-token",
        TOKEN,
        service_flags=(*tls, "--tls-client-ca", str(pki["ca"]), "--auth-token", TOKEN),
        credentials=credentials(pki),
    )
    yield deployment
    deployment.stop()


def _generate(channel: grpc.Channel, token: str | None, text: str = CODE_PROMPTS[0]) -> list[int]:
    metadata = (("authorization", f"Bearer {token}"),) if token is not None else ()
    request = gateway_pb2.GenerateRequest(text=text, max_new_tokens=MAX_NEW, policy="full")
    stream = gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=60, metadata=metadata)
    return [token_id for response in stream for token_id in response.token_ids]


def test_mutual_tls_deployment_with_a_token_streams_the_auto_output(secure_deployment, pki, auto_reference):
    with grpc.secure_channel(secure_deployment.gateway.address, credentials(pki, client_certificate=False)) as channel:
        assert _generate(channel, TOKEN) == auto_reference(CODE_PROMPTS[0], MAX_NEW)


def test_the_cli_client_sends_tls_and_the_token(secure_deployment, pki, auto_reference):
    settings = DiffSpecSettings(tls_ca=str(pki["ca"]), auth_token=TOKEN)
    request = gateway_pb2.GenerateRequest(text=CODE_PROMPTS[1], max_new_tokens=MAX_NEW, policy="chain")

    async def run() -> list[int]:
        return [t async for chunk in stream_generate(secure_deployment.gateway.address, request, settings)
                for t in chunk.token_ids]

    assert asyncio.run(run()) == auto_reference(CODE_PROMPTS[1], MAX_NEW)


@pytest.mark.parametrize("token", [None, "wrong-token", ""])
def test_a_missing_or_wrong_token_is_unauthenticated(secure_deployment, pki, token):
    with secure_deployment.gateway.channel() as channel:
        with pytest.raises(grpc.RpcError) as refused:
            _generate(channel, token)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as refused:
            gateway_pb2_grpc.GatewayStub(channel).Tokenize(gateway_pb2.TokenizeRequest(text="x"), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # the services check the token too: a client past mutual TLS still needs it
    with secure_deployment.target.channel() as channel:
        with pytest.raises(grpc.RpcError) as refused:
            target_pb2_grpc.TargetStub(channel).Info(target_pb2.TargetInfoRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_checks_need_no_token(secure_deployment):
    for server in secure_deployment.servers:
        with server.channel() as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_plaintext_and_untrusted_clients_cannot_connect(secure_deployment, tmp_path):
    stranger = credentials(make_pki(tmp_path, "stranger"))
    for channel in (
        grpc.insecure_channel(secure_deployment.gateway.address),
        grpc.secure_channel(secure_deployment.gateway.address, stranger),  # a CA the gateway's cert is not from
    ):
        with channel, pytest.raises(grpc.RpcError) as refused:
            _generate(channel, TOKEN)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_services_refuse_a_client_without_a_certificate(secure_deployment, pki):
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    address = secure_deployment.target.address
    with grpc.secure_channel(address, credentials(pki, client_certificate=False)) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            target_pb2_grpc.TargetStub(channel).Info(target_pb2.TargetInfoRequest(), timeout=10, metadata=metadata)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    with secure_deployment.target.channel() as channel:
        assert target_pb2_grpc.TargetStub(channel).Info(target_pb2.TargetInfoRequest(), timeout=10, metadata=metadata)


class _TinyContextEngine:
    """The parts of an engine that tokenizing reads: a 4-token context and a tokenizer that counts its calls."""

    def __init__(self) -> None:
        self.tokenized: list[str] = []
        self.tokenizer = self

    async def target_info(self) -> SimpleNamespace:
        return SimpleNamespace(max_context=4)

    bos_token = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        self.tokenized.append(text)
        return {"input_ids": [len(text)]}


def test_tokenize_refuses_a_text_too_long_for_the_context_unread():
    engine = _TinyContextEngine()
    servicer = GatewayServicer(Loading("engine"), DiffSpecSettings(), ServingMetrics())
    fits, too_long = "a" * (MAX_CHARS_PER_TOKEN * 4), "a" * (MAX_CHARS_PER_TOKEN * 4 + 1)
    assert asyncio.run(servicer._tokenize(engine, fits)) == [len(fits)]
    with pytest.raises(InvalidRequest):
        asyncio.run(servicer._tokenize(engine, too_long))
    assert engine.tokenized == [fits]
    servicer.tokenizer_pool.close()


@pytest.mark.slow
def test_tokenizer_pool_admits_at_most_its_limit_and_frees_a_slot_only_when_the_work_ends():
    pool = TokenizerPool(num_threads=1, max_in_flight=2)
    release = threading.Event()

    async def scenario() -> None:
        first = asyncio.ensure_future(pool.run(release.wait))
        second = asyncio.ensure_future(pool.run(lambda: "queued"))  # admitted, waits for the one thread
        await asyncio.sleep(0.05)
        with pytest.raises(ResourceExhausted):
            await pool.run(lambda: "third")
        first.cancel()  # the caller leaves, but its work still holds the thread: the slot stays taken
        await asyncio.sleep(0.05)
        with pytest.raises(ResourceExhausted):
            await pool.run(lambda: "third")
        release.set()
        assert await second == "queued"
        assert await pool.run(lambda: "after") == "after"

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        pool.close()
