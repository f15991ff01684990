"""API keys name tenants: without a key a client gets UNAUTHENTICATED (gRPC) or 401 (HTTP); with one it
is its tenant, whatever client name it declares, for its quota (Generate and Tokenize alike) and its
prefix-cache scope; a tenant's key opens no internal service."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from diffspec.auth import ApiKeys, read_api_keys
from diffspec.errors import InvalidRequest
from diffspec.metrics import ServingMetrics
from diffspec.serving import Loading
from diffspec.settings import DiffSpecSettings
from diffspec.v1 import gateway_pb2, gateway_pb2_grpc
from gateway.engine import SpeculativeEngine
from gateway.engine_core import EngineLimits
from gateway.http_api import create_app
from gateway.quota import QuotaLimits
from target_service.backend import TargetBatch, TargetBatchResult
from target_service.runtime import TargetRuntime
from tests.adversarial.harness import InProcessGateway
from tests.gateway.conftest import CODE_PROMPTS

KEYS = "# tenant token\nalice alice-key\nbob bob-key  # a comment\n"


class ScopeRecorder:
    """The target, recording the cache scope each session opens with."""

    def __init__(self, runtime: TargetRuntime) -> None:
        self.runtime = runtime
        self.scopes: list[str] = []

    def step(self, batch: TargetBatch) -> TargetBatchResult:
        self.scopes += [opening.cache_scope for opening in batch.opens]
        return self.runtime.step(batch)

    def info(self):  # noqa: ANN201 - TargetInfo
        return self.runtime.info()


@pytest.fixture(scope="module")
def settings(tmp_path_factory, tiny_target_dir) -> DiffSpecSettings:
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(KEYS)
    return DiffSpecSettings(base_model=tiny_target_dir, num_pages=256, api_keys_file=str(keys), client_max_requests=1)


@pytest.fixture(scope="module")
def served(settings, tokenizer) -> Iterator[tuple[SpeculativeEngine, ScopeRecorder, str]]:
    target = ScopeRecorder(TargetRuntime(settings))
    engine = SpeculativeEngine(target, None, tokenizer, EngineLimits(8, 4096, 2048, QuotaLimits(max_requests=1)))
    gateway = InProcessGateway(engine, settings)
    yield engine, target, gateway.address
    gateway.stop()
    engine.close()


def _metadata(key: str | None, client: str | None = None) -> tuple[tuple[str, str], ...]:
    pairs = [("authorization", f"Bearer {key}")] if key else []
    return tuple(pairs + ([("x-diffspec-client", client)] if client else []))


@pytest.mark.parametrize("key", [None, "wrong", "alice"])  # "alice" is a tenant's name, not its key
def test_a_call_without_a_known_key_is_unauthenticated(served, key):
    with grpc.insecure_channel(served[2]) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for call, request in ((stub.Tokenize, gateway_pb2.TokenizeRequest(text="x")),
                              (stub.ModelInfo, gateway_pb2.ModelInfoRequest())):  # fmt: skip
            with pytest.raises(grpc.RpcError) as refused:
                call(request, timeout=10, metadata=_metadata(key))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_tenant_is_its_key_for_quota_and_cache_scope_whatever_it_declares(served):
    engine, target, address = served
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        alice = _metadata("alice-key", client="bob")  # declaring another name changes nothing
        long = stub.Generate(
            gateway_pb2.GenerateRequest(text=CODE_PROMPTS[0], max_new_tokens=3000), timeout=60, metadata=alice
        )
        next(long)  # alice's one request slot is taken
        again = _metadata("alice-key", client="carol")
        attempts = (
            lambda: list(stub.Generate(gateway_pb2.GenerateRequest(text="def f():"), timeout=30, metadata=again)),
            lambda: stub.Tokenize(gateway_pb2.TokenizeRequest(text="def f():"), timeout=30, metadata=again),
        )
        for attempt in attempts:
            with pytest.raises(grpc.RpcError) as refused:
                attempt()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        bob = _metadata("bob-key")
        assert list(stub.Tokenize(gateway_pb2.TokenizeRequest(text="def f():"), timeout=30, metadata=bob).token_ids)
        bob_stream = stub.Generate(gateway_pb2.GenerateRequest(text=CODE_PROMPTS[0], max_new_tokens=4), metadata=bob)
        assert sum(len(r.token_ids) for r in bob_stream) == 4
        long.cancel()
    assert target.scopes == ["tenant:alice", "tenant:bob"]


def test_http_takes_the_same_keys_and_names_the_model_not_its_path(served, settings):
    engine = served[0]
    loading: Loading[SpeculativeEngine] = Loading("the gateway's engine")
    loading.set(engine)
    app = create_app(loading, settings, ServingMetrics())

    async def get(path: str, key: str | None) -> httpx.Response:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.get(path, headers=headers)

    refused = asyncio.run(get("/v1/models", None))
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert asyncio.run(get("/v1/models", "wrong")).status_code == 401
    models = asyncio.run(get("/v1/models", "bob-key")).json()
    assert [card["id"] for card in models["data"]] == ["tiny-code"]
    assert asyncio.run(get("/ready", None)).status_code == 200  # probes need no key


def test_tenant_keys_open_only_the_client_facing_roles(settings):
    for role, tenant in (("all", "alice"), ("gateway", "alice"), ("target", None), ("draft", None)):
        assert ApiKeys.for_role(settings, role).tenant_of("Bearer alice-key") == tenant
    shared = ApiKeys.for_role(settings.model_copy(update={"auth_token": "shared"}), "target")
    assert shared.tenant_of("Bearer shared") == "" and shared.tenant_of("Bearer alice-key") is None


@pytest.mark.parametrize(
    "text, problem",
    [("alice\n", "expected 'TENANT TOKEN'"), ("alice k\nbob k\n", "two tenants"), ("# none\n", "no keys")],
)
def test_a_bad_keys_file_is_refused_at_start(tmp_path: Path, text, problem):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(InvalidRequest, match=problem):
        read_api_keys(str(path))
