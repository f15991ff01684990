"""Logprobs of emitted tokens (fp32, CPU, the bundled tiny pair): speculative and Auto report the same
values for the same tokens, and both equal a teacher-forced dense forward's; n samples share a prompt."""

from __future__ import annotations

import asyncio

import pytest
import torch

from diffspec.sampling import LOGPROB_FLOOR, SamplingParams, TokenLogprobs, target_logprobs
from draft_service.options import DraftOptions
from gateway.engine import SpeculativeEngine
from gateway.request import GenerationChunk, GenerationRequest
from gateway.samples import generate_samples
from target_service.runtime import TargetRuntime
from tests.gateway.conftest import CODE_PROMPTS, assert_all_released

NEW_TOKENS = 24
TOLERANCE = 1e-4


def run(engine: SpeculativeEngine, request: GenerationRequest) -> dict[int, tuple[list[int], TokenLogprobs]]:
    """Every sample to the end: index -> (token ids, their logprobs)."""

    async def go() -> list[GenerationChunk]:
        return [chunk async for chunk in generate_samples(engine, request)]

    out: dict[int, tuple[list[int], list[TokenLogprobs]]] = {}
    for chunk in asyncio.run(go()):
        ids, parts = out.setdefault(chunk.index, ([], []))
        ids += chunk.token_ids
        if chunk.token_ids and request.sampling.logprobs is not None:
            assert chunk.logprobs is not None and len(chunk.logprobs) == len(chunk.token_ids)
            parts.append(chunk.logprobs)
    return {index: (ids, TokenLogprobs.join(parts)) for index, (ids, parts) in out.items()}


def dense_logprobs(target: TargetRuntime, prompt: list[int], tokens: list[int], params: SamplingParams) -> torch.Tensor:
    """[len(tokens), vocab]: the distribution at each emitted token's position, from one causal forward."""
    ids = torch.tensor([prompt + tokens])
    hidden, _ = target.model.forward_dense(ids)
    rows = hidden[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    return target_logprobs(target.model.logits(rows), params).clamp_min(LOGPROB_FLOOR)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(logprobs=3), SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=5, logprobs=2)],
    ids=["greedy", "sampled"],
)
def test_speculative_logprobs_equal_autos_and_the_dense_forwards(fp32_engine, fp32_target, tokenizer, params):
    prompt = tokenizer(CODE_PROMPTS[0])["input_ids"]
    auto = run(fp32_engine, GenerationRequest(prompt, NEW_TOKENS, params))[0]
    full = DraftOptions("full", "24:0.0:5")
    speculative = run(fp32_engine, GenerationRequest(prompt, NEW_TOKENS, params, draft=full))[0]
    if params.greedy:
        assert speculative[0] == auto[0]  # lossless: the same tokens, so the same logprobs
        assert speculative[1].top_ids == auto[1].top_ids
        assert torch.allclose(torch.tensor(speculative[1].logprobs), torch.tensor(auto[1].logprobs), atol=TOLERANCE)
    for tokens, logprobs in (auto, speculative):
        want = dense_logprobs(fp32_target, prompt, tokens, params)
        got = torch.tensor(logprobs.logprobs)
        assert torch.allclose(got, want[torch.arange(len(tokens)), tokens], atol=TOLERANCE)
        assert torch.allclose(torch.tensor(logprobs.top_logprobs), want.topk(params.logprobs, -1).values, atol=TOLERANCE)
        assert all(lp > LOGPROB_FLOOR for lp in logprobs.logprobs)  # every emitted token is in the kept set
    assert_all_released(fp32_engine)


def test_n_samples_differ_by_seed_repeat_with_it_and_agree_when_greedy(fp32_engine, tokenizer):
    prompt = tokenizer(CODE_PROMPTS[2])["input_ids"]
    sampled = SamplingParams(temperature=1.0, seed=11, logprobs=0)
    first = run(fp32_engine, GenerationRequest(prompt, 12, sampled, n=3))
    assert sorted(first) == [0, 1, 2]
    assert len({tuple(ids) for ids, _ in first.values()}) > 1  # distinct seeds
    again = run(fp32_engine, GenerationRequest(prompt, 12, sampled, n=3))
    assert [again[i][0] for i in range(3)] == [first[i][0] for i in range(3)]  # seeds derived from the request's
    alone = run(fp32_engine, GenerationRequest(prompt, 12, sampled))[0]
    assert alone[0] == first[0][0]  # sample 0 keeps the seed
    # batched with other samples or not, the same logprobs up to float rounding
    assert torch.allclose(torch.tensor(alone[1].logprobs), torch.tensor(first[0][1].logprobs), atol=TOLERANCE)
    chain = DraftOptions("chain", "8:0.0:4")
    greedy = run(fp32_engine, GenerationRequest(prompt, 12, SamplingParams(logprobs=1), n=3, draft=chain))
    assert greedy[0][0] == greedy[1][0] == greedy[2][0]
    assert greedy[0][1].top_ids == greedy[2][1].top_ids
    assert_all_released(fp32_engine)

