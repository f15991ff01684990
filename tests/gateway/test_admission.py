"""Admission by KV pages and per-client quotas, on the bundled tiny target (CPU, Auto, greedy).

A pool too small for every request at once: the engine opens only what the pool can hold to the
end, queues the rest, and every stream finishes with its lone tokens (without admission by pages
the streams would run out of pages mid-way). A client that floods the engine is refused past its
quota, while another client's request is admitted, served first from the queue, and unchanged.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import pytest

from diffspec.errors import InvalidRequest, ResourceExhausted
from diffspec.settings import DiffSpecSettings
from gateway.admission import KVAdmission, KVGeometry, fair_order
from gateway.engine import SpeculativeEngine
from gateway.engine_core import EngineLimits
from gateway.quota import QuotaLimits
from gateway.request import GenerationRequest
from target_service.backend import TargetBatch, TargetBatchResult
from target_service.runtime import TargetRuntime
from tests.gateway.conftest import CODE_PROMPTS, assert_all_released, collect, collect_async
from tests.gateway.test_engine_core import RecordingTarget, crowd

PAGE_SIZE = 16
NUM_PAGES = 12  # two requests of the size below at once: 5 worst-case pages each
NEW_TOKENS = 24  # + a ~10-token prompt + 32 tree positions = 66 tokens = 5 pages


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
    return SimpleNamespace(request=request, prompt_tokens=prompt_tokens, stats=SimpleNamespace(new_tokens=new_tokens))


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


def test_worst_case_is_capped_by_the_context():
    assert GEOMETRY.worst_case_pages(GenerationRequest([0] * 10, 22)) == 4
    assert KVGeometry(16, 12, max_context=40).worst_case_pages(GenerationRequest([0] * 10, 22)) == 3
