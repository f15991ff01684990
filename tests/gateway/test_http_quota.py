"""Per-client quotas over the HTTP API: the ``x-diffspec-client`` header names the client, a client
past its quota gets 429 while another client is served."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from diffspec.metrics import ServingMetrics
from diffspec.serving import Loading
from diffspec.settings import DiffSpecSettings
from gateway.assembly import build_engine
from gateway.engine import SpeculativeEngine
from gateway.http_api import create_app
from tests.gateway.conftest import CODE_PROMPTS


@pytest.fixture(scope="module")
def engine() -> Iterator[SpeculativeEngine]:
    loaded = build_engine(DiffSpecSettings(num_pages=128, policy="auto", client_max_requests=1), with_draft=False)
    yield loaded
    loaded.close()


def test_a_client_past_its_quota_gets_429_and_another_client_is_served(engine):
    settings = DiffSpecSettings(policy="auto", client_max_requests=1)
    loading: Loading[SpeculativeEngine] = Loading("engine")
    loading.set(engine)
    app = create_app(loading, settings, ServingMetrics())
    body = {"model": "tiny", "prompt": CODE_PROMPTS[2], "temperature": 0}

    async def scenario() -> tuple[httpx.Response, ...]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:

            def post(who: str, max_tokens: int):  # noqa: ANN202 - a coroutine of httpx
                return client.post("/v1/completions", json={**body, "max_tokens": max_tokens}, headers={"x-diffspec-client": who})

            holding = asyncio.ensure_future(post("a", 64))
            while engine.core.num_requests < 1:
                await asyncio.sleep(0.001)
            refused, served = await post("a", 4), await post("b", 4)
            return refused, served, await holding

    refused, served, held = asyncio.run(scenario())
    assert refused.status_code == 429 and "client_max_requests=1" in refused.json()["error"]["message"]
    assert served.status_code == 200 and held.status_code == 200
    assert engine.core.quotas.held("name:a") == (0, 0)
