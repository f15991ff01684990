"""A bug's exception text never reaches a client: gRPC INTERNAL and HTTP 500 carry a request id, and the
text (with its traceback) is logged under that id."""

from __future__ import annotations

import asyncio
import logging
import re

import grpc
import httpx
import pytest

from diffspec.metrics import ServingMetrics
from diffspec.serving import Loading
from diffspec.settings import DiffSpecSettings
from diffspec.v1 import gateway_pb2, gateway_pb2_grpc
from gateway.engine import SpeculativeEngine
from gateway.http_api import create_app
from target_service.backend import TargetBatch
from target_service.runtime import TargetRuntime
from tests.adversarial.harness import InProcessGateway

SECRET = "/home/tenant-a/secret-prompt.txt"
REQUEST_ID = re.compile(r"request id ([0-9a-f]{16})")


class BuggyTarget:
    """A target whose steps fail with an unexpected exception naming something private."""

    def __init__(self, runtime: TargetRuntime) -> None:
        self.runtime = runtime

    def step(self, batch: TargetBatch):  # noqa: ANN201
        raise RuntimeError(f"cannot read {SECRET}")

    def info(self):  # noqa: ANN201 - TargetInfo
        return self.runtime.info()


@pytest.fixture(scope="module")
def buggy_engine(tiny_target_dir, tokenizer):
    engine = SpeculativeEngine(BuggyTarget(TargetRuntime(DiffSpecSettings(base_model=tiny_target_dir, num_pages=64))),
                               None, tokenizer)  # fmt: skip
    yield engine
    engine.close()


def _logged_id(caplog: pytest.LogCaptureFixture) -> str:
    """The request id of the one log record of a failure reported to a client, which holds the text."""
    (record,) = [r for r in caplog.records if REQUEST_ID.search(r.getMessage())]
    assert SECRET in str(record.exc_info[1])
    return REQUEST_ID.search(record.getMessage()).group(1)


def test_grpc_internal_errors_carry_a_request_id_and_no_text(buggy_engine, caplog):
    gateway = InProcessGateway(buggy_engine, DiffSpecSettings())
    try:
        with caplog.at_level(logging.ERROR), grpc.insecure_channel(gateway.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            with pytest.raises(grpc.RpcError) as failed:
                list(stub.Generate(gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[1, 5, 6])), timeout=30))
    finally:
        gateway.stop()
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    details = failed.value.details()
    assert SECRET not in details and "RuntimeError" not in details
    assert REQUEST_ID.search(details).group(1) == _logged_id(caplog)


def test_http_internal_errors_carry_a_request_id_in_openai_shape(buggy_engine, caplog):
    loading: Loading[SpeculativeEngine] = Loading("the gateway's engine")
    loading.set(buggy_engine)
    app = create_app(loading, DiffSpecSettings(), ServingMetrics())

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/completions", json={"model": "m", "prompt": [1, 5, 6], "max_tokens": 4})

    with caplog.at_level(logging.ERROR):
        reply = asyncio.run(post())
    assert reply.status_code == 500
    error = reply.json()["error"]
    assert error["type"] == "internal_error" and SECRET not in reply.text
    assert REQUEST_ID.search(error["message"]).group(1) == _logged_id(caplog)
