"""The KV pool running out under a stream that is already decoding.

One engine alone never runs out mid-way (``gateway/admission.py`` opens a request only when the pool
can hold all of it). A target shared by several gateways can: here another gateway's session takes
every free page of a small pool while a stream decodes. The stream then ends with RESOURCE_EXHAUSTED
at its next page, the tokens already streamed stay a prefix of Auto's output, and once the other
session ends every page and session is back and the same request runs to its end.
"""

from __future__ import annotations

import asyncio
from typing import Iterator

import grpc
import pytest

from diffspec.errors import KVPoolExhausted
from diffspec.sampling_params import SamplingParams
from diffspec.settings import BUNDLED_DRAFT, BUNDLED_TARGET, DiffSpecSettings
from diffspec.v1 import gateway_pb2, gateway_pb2_grpc
from draft_service.options import DraftOptions
from gateway.assembly import build_engine
from gateway.engine import SpeculativeEngine
from gateway.request import GenerationRequest
from target_service.backend import SessionOpen, TargetBatch
from target_service.runtime import TargetRuntime
from tests.gateway.conftest import CODE_PROMPTS, assert_all_released, collect
from tests.gateway.live_gateway import LiveGateway

NUM_PAGES = 16  # of 16 tokens: a prompt of 27 tokens and 64 new ones fit, with room to spare
NEW_TOKENS = 64
OTHER_GATEWAY = "other-gateway"
POLICIES = [None, DraftOptions("full", "24:0.0:5"), DraftOptions("online", "64:0.0:8", salience=True)]


def policy_id(options: DraftOptions | None) -> str:
    return "auto" if options is None else f"{options.policy}{'-salience' if options.salience else ''}"


@pytest.fixture(scope="module")
def engine() -> Iterator[SpeculativeEngine]:
    settings = DiffSpecSettings(base_model=BUNDLED_TARGET, draft_model=BUNDLED_DRAFT, num_pages=NUM_PAGES)
    engine = build_engine(settings)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompt_ids(engine) -> list[int]:
    return engine.tokenizer(CODE_PROMPTS[1])["input_ids"]


@pytest.fixture(scope="module")
def auto_ids(engine, prompt_ids) -> list[int]:
    ids, _, stats = collect(engine, GenerationRequest(prompt_ids, NEW_TOKENS))
    assert stats.finish_reason == "length"
    return ids


def take_every_free_page(target: TargetRuntime) -> int:
    """Open another gateway's session whose prompt fills every free page (the engine may take a page
    between the count and the open: then count again). Opening allocates the prompt's pages, no compute."""
    while True:
        free = target.pool.num_free_pages
        assert free > 0
        opening = SessionOpen(OTHER_GATEWAY, [5] * (free * target.pool.page_size), SamplingParams(), False, "other")
        if not target.step(TargetBatch(opens=[opening])).failures:
            assert target.pool.num_free_pages == 0
            return free


def end_other_gateway(engine: SpeculativeEngine) -> None:
    engine.target.release(OTHER_GATEWAY)  # a no-op when it holds nothing
    assert_all_released(engine)


@pytest.mark.parametrize("options", POLICIES, ids=policy_id)
def test_in_process_the_stream_ends_resource_exhausted_after_a_right_prefix(engine, prompt_ids, auto_ids, options):
    request = GenerationRequest(prompt_ids, NEW_TOKENS, draft=options)
    received: list[int] = []

    async def stream() -> None:
        taken = False
        async for chunk in engine.generate(request):
            received.extend(chunk.token_ids)
            if len(received) >= 2 and not taken:  # decoding: a verification has emitted tokens
                take_every_free_page(engine.target)
                taken = True

    try:
        with pytest.raises(KVPoolExhausted, match="free pages, 0 left"):
            asyncio.run(stream())
    finally:
        end_other_gateway(engine)
    assert 2 <= len(received) < NEW_TOKENS and received == auto_ids[: len(received)]
    ids, _, stats = collect(engine, request)  # the pool is whole again: the same request runs to its end
    assert ids == auto_ids and stats.finish_reason == "length"
    assert_all_released(engine)


def test_over_grpc_the_status_is_resource_exhausted_and_the_streamed_tokens_stay(engine, auto_ids):
    gateway = LiveGateway(engine, DiffSpecSettings(policy="full"))
    received: list[int] = []
    try:
        with grpc.insecure_channel(gateway.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            call = stub.Generate(gateway_pb2.GenerateRequest(text=CODE_PROMPTS[1], max_new_tokens=NEW_TOKENS), timeout=60)
            try:
                with pytest.raises(grpc.RpcError) as failure:
                    for response in call:
                        taken = len(received) >= 2
                        received += response.token_ids
                        if len(received) >= 2 and not taken:
                            take_every_free_page(engine.target)
            finally:
                end_other_gateway(engine)
            assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "free pages, 0 left" in failure.value.details()
            assert len(received) >= 2 and received == auto_ids[: len(received)]
            again = [t for response in stub.Generate(
                gateway_pb2.GenerateRequest(text=CODE_PROMPTS[1], max_new_tokens=NEW_TOKENS), timeout=60
            ) for t in response.token_ids]  # fmt: skip
            assert again == auto_ids
    finally:
        gateway.stop()
    assert_all_released(engine)
