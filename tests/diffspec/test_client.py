"""``diffspec.client`` against a live in-process gateway over the bundled tiny pair: streamed and whole,
blocking and asyncio, logprobs and n samples, typed errors, and leaving a stream early frees the request."""

from __future__ import annotations

import asyncio

import pytest

from diffspec.client import AsyncGatewayClient, GatewayClient
from diffspec.errors import InvalidRequest
from tests.gateway.conftest import CODE_PROMPTS, assert_all_released

PROMPT = CODE_PROMPTS[2]


def test_streamed_chunks_add_up_to_the_whole_and_speculation_is_lossless(live_gateway):
    with GatewayClient(live_gateway.address) as client:
        chunks = list(client.generate(PROMPT, max_new_tokens=12))
        (whole,) = client.complete(PROMPT, max_new_tokens=12, policy="chain", tree_config="8:0.0:4")
        assert client.tokenize(PROMPT)[0] == live_gateway.engine.tokenizer.bos_token_id
    assert [i for c in chunks for i in c.token_ids] == whole.token_ids and len(whole.token_ids) == 12
    assert "".join(c.text for c in chunks) == whole.text
    last = chunks[-1].stats
    assert last is not None and last.finish_reason == "length" and last.new_tokens == 12 and last.accepted_drafts == 0
    assert whole.stats.accepted_drafts > 0 and whole.stats.mean_accepted_length > 1


def test_async_samples_with_logprobs(live_gateway):
    async def go():
        async with AsyncGatewayClient(live_gateway.address) as client:
            return await client.complete(PROMPT, max_new_tokens=6, temperature=1.0, seed=3, n=3, logprobs=2)

    samples = asyncio.run(go())
    assert [s.index for s in samples] == [0, 1, 2]
    for sample in samples:
        assert [lp.token_id for lp in sample.logprobs] == sample.token_ids
        assert all(lp.logprob <= 0 and len(lp.top) == 2 for lp in sample.logprobs)
        assert sample.stats is not None and sample.stats.new_tokens == 6


def test_errors_are_typed_and_an_abandoned_stream_frees_its_request(live_gateway):
    with GatewayClient(live_gateway.address) as client:
        with pytest.raises(InvalidRequest, match="top_p"):
            client.complete(PROMPT, top_p=2.0)
        stream = client.generate(PROMPT, max_new_tokens=2000)
        next(stream)
        stream.close()  # cancels the call: the server aborts the request
    assert_all_released(live_gateway.engine)
