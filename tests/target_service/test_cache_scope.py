"""The runtime's prefix cache per scope, the free pages each step reports, and both across the wire."""

from __future__ import annotations

import pytest
import torch

from diffspec.sampling import SamplingParams
from diffspec.settings import DiffSpecSettings
from target_service.backend import PrefillWork, SessionOpen, TargetBatch, TargetBatchResult
from target_service.messages import batch_from_proto, batch_to_proto, result_from_proto, result_to_proto
from target_service.runtime import TargetRuntime

GREEDY = SamplingParams()
PROMPT = torch.randint(3, 8192, (100,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def runtime(tiny_target_dir) -> TargetRuntime:
    return TargetRuntime(DiffSpecSettings(base_model=tiny_target_dir, num_pages=64))


def open_and_prefill(runtime: TargetRuntime, sid: str, scope: str) -> TargetBatchResult:
    opening = SessionOpen(sid, PROMPT, GREEDY, want_features=False, cache_scope=scope)
    return runtime.step(TargetBatch(opens=[opening], prefills=[PrefillWork(sid, len(PROMPT))]))


@pytest.mark.parametrize("scope, cached", [("name:alice", 96), ("name:mallory", 0), ("", 0)])
def test_a_prompt_reuses_pages_of_its_own_scope_only(runtime, scope, cached):
    first = open_and_prefill(runtime, "alice", "name:alice")
    assert first.num_free_pages == 64 - 7
    second = runtime.step(TargetBatch(opens=[SessionOpen("b", PROMPT, GREEDY, False, scope)]))
    assert runtime.sessions["b"].prefilled == cached
    assert second.num_free_pages == runtime.pool.num_free_pages == 64 - 7 - (1 if cached else 7)
    runtime.release("alice")
    runtime.release("b")


def test_scope_and_free_pages_cross_the_wire():
    batch = TargetBatch(opens=[SessionOpen("s", [1, 2], GREEDY, False, cache_scope="name:alice")])
    decoded, malformed = batch_from_proto(batch_to_proto(batch), "stream/")
    assert not malformed and decoded.opens[0].cache_scope == "name:alice"
    for free in (0, 17, None):
        reply, _ = result_to_proto(TargetBatchResult(num_free_pages=free), "stream/")
        assert result_from_proto(reply, None, "target").num_free_pages == free
