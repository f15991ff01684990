"""Admission by KV pages and per-client quotas, on the bundled tiny target (CPU, Auto, greedy).

A pool too small for every request at once: the engine opens only what the pool can hold to the
end, queues the rest, and every stream finishes with its lone tokens (without admission by pages
the streams would run out of pages mid-way). The n samples of one prompt are charged its pages once,
so a pool that holds one copy of the prompt and every sample's growth opens them all together. A
client that floods the engine is refused past its quota, while another client's request is admitted,
served first from the queue, and unchanged.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from diffspec.errors import InvalidRequest, ResourceExhausted
from diffspec.sampling_params import SamplingParams
from diffspec.settings import BUNDLED_DRAFT, DiffSpecSettings
from draft_service.eagle3_head import Eagle3Head
from draft_service.options import DraftOptions
from draft_service.runtime import DraftRuntime
from gateway.admission import KVAdmission, KVGeometry, fair_order
from gateway.engine import SpeculativeEngine
from gateway.engine_core import EngineLimits
from gateway.quota import QuotaLimits
from gateway.request import GenerationRequest, GenerationStats, PromptShare
from gateway.running_request import Phase, RunningRequest
from gateway.samples import generate_samples
from target_service.backend import TargetBatch, TargetBatchResult
from target_service.runtime import TargetRuntime
from tests.gateway.conftest import CODE_PROMPTS, assert_all_released, collect, collect_async
from tests.gateway.test_engine_core import RecordingTarget, crowd

PAGE_SIZE = 16
NUM_PAGES = 12  # two requests of the size below at once: 5 worst-case pages each
NEW_TOKENS = 24  # + a ~10-token prompt + 32 tree positions = 66 tokens = 5 pages

# The n = 4 samples of one prompt: each sample's worst case is 100 + 8 + 32 = 140 tokens = 9 pages, of
# which a fork shares the 6 full pages before the last prompt position and needs 3 of its own. A pool of
# 18 pages holds the first sample and three forks (9 + 3 x 3); charged 9 each, only two samples fit.
FORK_PROMPT_TOKENS = 100  # 6 full pages and 4 tokens: each fork copies the partial 7th
FORK_NEW_TOKENS = 8
FORK_NUM_PAGES = 18


class CountingTarget(RecordingTarget):
    """The recording runtime (with its gate), and the most sessions it had open at once."""

    most_open = 0

    def step(self, batch: TargetBatch) -> TargetBatchResult:
        result = super().step(batch)
        self.most_open = max(self.most_open, len(self.inner.sessions))
        return result

    @property
    def opened(self) -> list[str]:
        """The client (cache scope) of every session opened, in order."""
        return [o.cache_scope for _, sent in self.batches for o in sent.opens]


@pytest.fixture(scope="module")
def small_target(tiny_target_dir) -> TargetRuntime:
    return TargetRuntime(DiffSpecSettings(base_model=tiny_target_dir, num_pages=NUM_PAGES, page_size=PAGE_SIZE))


@pytest.fixture()
def counting(small_target) -> CountingTarget:
    return CountingTarget(small_target)


def engine_over(target: CountingTarget, tokenizer, quota: QuotaLimits = QuotaLimits()) -> SpeculativeEngine:
    return SpeculativeEngine(target, None, tokenizer, EngineLimits(16, 256, 64, quota))


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(text)["input_ids"][:10] for text in CODE_PROMPTS]


def test_requests_past_the_pool_wait_for_pages_and_all_finish_unchanged(counting, tokenizer, prompts):
    engine = engine_over(counting, tokenizer)
    try:
        requests = [GenerationRequest(prompts[i % len(prompts)], NEW_TOKENS) for i in range(6)]
        alone = [collect(engine, r)[0] for r in requests]
        counting.most_open = 0
        assert crowd(engine, requests) == alone
        assert counting.most_open == 2  # 12 pages hold two worst cases; the other four waited their turn
        assert_all_released(engine)
    finally:
        engine.close()


def test_a_request_the_pool_could_never_hold_is_refused_at_once(counting, tokenizer, prompts):
    engine = engine_over(counting, tokenizer)
    try:
        with pytest.raises(InvalidRequest, match="KV pages"):
            collect(engine, GenerationRequest(prompts[0], NUM_PAGES * PAGE_SIZE))
        assert engine.core.num_requests == 0 and counting.opened == []
    finally:
        engine.close()


@pytest.fixture(scope="module")
def fork_target(tiny_target_dir) -> TargetRuntime:
    return TargetRuntime(DiffSpecSettings(base_model=tiny_target_dir, num_pages=FORK_NUM_PAGES, page_size=PAGE_SIZE))


@pytest.fixture(scope="module")
def fork_draft(fork_target) -> DraftRuntime:
    head = Eagle3Head.load(BUNDLED_DRAFT, fork_target.model.embed_tokens, torch.device("cpu"), torch.float32)
    return DraftRuntime(head)


@pytest.fixture(scope="module")
def fork_prompt(tokenizer) -> list[int]:
    prompt = tokenizer(CODE_PROMPTS[1] * 4)["input_ids"][:FORK_PROMPT_TOKENS]
    assert len(prompt) == FORK_PROMPT_TOKENS
    return prompt


def run_samples(engine: SpeculativeEngine, target: CountingTarget, request: GenerationRequest) -> dict[int, list[int]]:
    """Every sample's tokens; the samples all queue before the engine's first step."""

    async def run() -> dict[int, list[int]]:
        target.gate.clear()
        out: dict[int, list[int]] = {}

        async def drain() -> None:
            async for chunk in generate_samples(engine, request):
                out.setdefault(chunk.index, []).extend(chunk.token_ids)

        task = asyncio.ensure_future(drain())
        while engine.core.num_requests < request.n and not task.done():
            await asyncio.sleep(0.001)
        target.gate.set()
        await task
        return out

    return asyncio.run(run())


@pytest.mark.parametrize("draft", [None, DraftOptions("full", "16:0.0:4")], ids=["auto", "speculative"])
def test_samples_of_one_prompt_are_charged_its_pages_once(fork_target, fork_draft, fork_prompt, tokenizer, draft):
    counting = CountingTarget(fork_target)
    engine = SpeculativeEngine(counting, fork_draft, tokenizer, EngineLimits(16, 256, 64))
    sampled = SamplingParams(temperature=0.9, seed=5)
    try:
        request = GenerationRequest(fork_prompt, FORK_NEW_TOKENS, sampled, draft=draft, n=4)
        samples = run_samples(engine, counting, request)
        assert counting.most_open == 4  # the three forks opened together, beside the first sample
        forks = [o for _, batch in counting.batches for o in batch.opens if o.fork_of]
        assert len(forks) == 3
        assert_all_released(engine)  # every page back in the pool: none leaked by a fork or its copies
        assert [fork_target.pool.refcount(page) for page in range(FORK_NUM_PAGES)] == [0] * FORK_NUM_PAGES
        for index in range(4):
            alone = replace(request, sampling=sampled.for_sample(index), n=1)
            assert samples[index] == collect(engine, alone)[0], index
        assert_all_released(engine)  # the lone runs' releases go out before the engine closes
    finally:
        engine.close()


def test_samples_that_could_never_fit_are_refused_as_one_request_is(fork_target, fork_prompt, tokenizer):
    counting = CountingTarget(fork_target)
    engine = SpeculativeEngine(counting, None, tokenizer, EngineLimits(16, 256, 64))
    too_long = GenerationRequest(fork_prompt, FORK_NUM_PAGES * PAGE_SIZE, n=4)  # 100 + 288 + 32 tokens: 27 pages
    message = "prompt + max_new_tokens need up to 27 KV pages, the pool has 18: lower max_new_tokens"
    try:
        with pytest.raises(InvalidRequest) as refused:
            run_samples(engine, counting, too_long)
        assert str(refused.value) == message
        with pytest.raises(InvalidRequest) as alone:
            collect(engine, replace(too_long, n=1))
        assert str(alone.value) == message
        assert engine.core.num_requests == 0 and counting.opened == []
        assert_all_released(engine)
    finally:
        engine.close()


def test_a_flooding_client_is_refused_past_its_quota_and_another_client_goes_first(counting, tokenizer, prompts):
    engine = engine_over(counting, tokenizer, QuotaLimits(max_requests=3))
    flood = GenerationRequest(prompts[0], NEW_TOKENS, client="name:flood")
    short_flood = replace(flood, max_new_tokens=8)  # ends first, while the flood's other one still runs
    calm = GenerationRequest(prompts[1], NEW_TOKENS, client="name:calm")
    want_short, want_flood, want_calm = (collect(engine, r)[0] for r in (short_flood, flood, calm))
    counting.batches.clear()

    async def scenario() -> list:
        tasks = [asyncio.ensure_future(collect_async(engine, r)) for r in (short_flood, flood)]
        while len(counting.opened) < 2:  # the pool is full with the flood's first two
            await asyncio.sleep(0.001)
        counting.gate.clear()  # no step ends while the others arrive: both queue before a slot frees
        tasks += [asyncio.ensure_future(collect_async(engine, flood)) for _ in range(4)]
        while sum(t.done() for t in tasks) < 3:  # one more admitted, three refused at once
            await asyncio.sleep(0.001)
        tasks.append(asyncio.ensure_future(collect_async(engine, calm)))
        while engine.core.num_requests < 4:
            await asyncio.sleep(0.001)
        counting.gate.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    try:
        outcomes = asyncio.run(scenario())
        refused = [o for o in outcomes if isinstance(o, ResourceExhausted)]
        assert len(refused) == 3 and all("client_max_requests=3" in str(r) for r in refused)
        served = [o[0] for o in outcomes if not isinstance(o, BaseException)]
        assert served == [want_short, want_flood, want_flood, want_calm]
        # the pool holds two: when the flood's short one ends, the calm client's request opens before its third
        assert counting.opened == [flood.client, flood.client, calm.client, flood.client]
        assert_all_released(engine)
        assert engine.core.quotas.held(flood.client) == (0, 0)
    finally:
        engine.close()


# -- the admission rules alone ----------------------------------------------------------------


def queued(client: str, prompt_tokens: int = 10, max_new_tokens: int = 22, new_tokens: int = 0) -> SimpleNamespace:
    """What admission reads of a RunningRequest: worst case 10 + 22 + 32 = 64 tokens = 4 pages of 16."""
    request = GenerationRequest([0] * prompt_tokens, max_new_tokens, client=client)
    stats = SimpleNamespace(new_tokens=new_tokens)
    request_id = f"{client}{id(request)}"
    return SimpleNamespace(request_id=request_id, request=request, prompt_tokens=prompt_tokens, stats=stats)


GEOMETRY = KVGeometry(page_size=16, num_pages=12, max_context=4096)


@pytest.mark.parametrize(
    "waiting, open_clients, order",
    [
        ("aaab", "", "abaa"),
        ("aaab", "b", "aaba"),
        ("abcabc", "aa", "bcbcaa"),
        ("ccba", "", "cbac"),
    ],
)
def test_fair_order_serves_the_client_with_fewest_sessions_first(waiting, open_clients, order):
    requests = [queued(c) for c in waiting]
    got = fair_order(requests, Counter(open_clients))
    assert "".join(r.request.client for r in got) == order
    assert sorted(map(id, got)) == sorted(map(id, requests))


@pytest.mark.parametrize(
    "free_pages, open_new_tokens, admitted",
    [
        (12, [], 3),  # 3 x 4 pages
        (11, [], 2),
        (3, [], 1),  # nothing open: the first goes whatever the count says
        (10, [1], 1),  # the open one holds 1 page (its prompt) and may grow 3 more: 7 left
        (10, [23], 2),  # it holds 2 pages (10 + 22 committed tokens) and may grow 2 more: 8 left
        (5, [1], 0),
    ],
)
def test_admission_counts_what_open_sessions_may_still_grow_into(free_pages, open_new_tokens, admitted):
    admission = KVAdmission(GEOMETRY, free_pages)
    open_requests = [queued("o", new_tokens=n) for n in open_new_tokens]
    assert len(admission.admit([queued("w") for _ in range(4)], open_requests)) == admitted


def sample(share: PromptShare, index: int, drafting: bool = False) -> RunningRequest:
    """Sample ``index`` of an n > 1 request of a 100-token prompt (worst case 9 pages, 3 past the shared 6)."""
    draft = DraftOptions("full") if drafting else None
    request = GenerationRequest([0] * FORK_PROMPT_TOKENS, FORK_NEW_TOKENS, draft=draft, n=1, prompt_share=share)
    stats = GenerationStats(prompt_tokens=FORK_PROMPT_TOKENS)
    unread: Any = None  # admission reads no sink, target info or detokenizer
    return RunningRequest(f"s{index}", request, unread, unread, unread, None, stats=stats, drafting=drafting)


@pytest.mark.parametrize(
    "source_state, drafting, free_pages, admitted",
    [
        ("none", False, 18, 4),  # none opened: the first is charged 9, each later one 3
        ("none", False, 17, 3),
        ("prefilling", False, 11, 3),  # the source holds 7 pages and may grow 2: 9 left, 3 forks of 3
        ("decoding", False, 11, 3),
        ("decoding", True, 11, 3),  # a drafting fork starts on the prompt features the source kept
        ("decoding-without-features", True, 11, 1),  # no features to start a draft on: it computes its prompt
        ("released", False, 18, 2),  # the source is gone: each computes its prompt again, 9 pages each
    ],
)
def test_a_fork_is_charged_only_its_own_pages(source_state, drafting, free_pages, admitted):
    """Which of an n = 4 request's queued samples a pool of 18 pages of 16 tokens admits, by where the
    sample that computes the prompt stands."""
    geometry = KVGeometry(page_size=PAGE_SIZE, num_pages=FORK_NUM_PAGES, max_context=4096)
    assert geometry.shared_prompt_pages(GenerationRequest([0] * FORK_PROMPT_TOKENS, 1)) == 6
    share = PromptShare(forks_left=3)
    open_requests = []
    if source_state != "none":
        source = sample(share, 0, drafting)
        source.phase, source.target_session = Phase.PREFILLING, source_state != "released"
        share.source = source
        if source_state != "prefilling":
            source.phase, source.stats.new_tokens, share.session_id = Phase.DECODING, 1, source.request_id
            share.features = torch.zeros(FORK_PROMPT_TOKENS, 3) if source_state == "decoding" and drafting else None
        open_requests = [source] if source.target_session else []
    waiting = [sample(share, i, drafting) for i in range(1 if source_state != "none" else 0, 4)]
    assert len(KVAdmission(geometry, free_pages).admit(waiting, open_requests)) == admitted


@pytest.mark.parametrize("prompt_tokens, shared", [(1, 0), (16, 0), (17, 1), (100, 6), (112, 6), (113, 7)])
def test_a_fork_shares_the_full_pages_before_its_last_prompt_position(prompt_tokens, shared):
    assert GEOMETRY.shared_prompt_pages(GenerationRequest([0] * prompt_tokens, 1)) == shared


def test_worst_case_is_capped_by_the_context():
    assert GEOMETRY.worst_case_pages(GenerationRequest([0] * 10, 22)) == 4
    assert KVGeometry(16, 12, max_context=40).worst_case_pages(GenerationRequest([0] * 10, 22)) == 3
