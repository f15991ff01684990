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


def test_a_fork_shares_the_prompt_pages_and_computes_only_its_last_position(runtime):
    open_and_prefill(runtime, "parent", "")
    free = runtime.pool.num_free_pages
    fork = SessionOpen("fork", PROMPT, GREEDY, want_features=True, fork_of="parent")
    result = runtime.step(TargetBatch(opens=[fork], prefills=[PrefillWork("fork", 1)]))
    (rows,) = [result.prefills["fork"].features.shape[0]]
    assert rows == 1 and result.prefills["fork"].done_tokens == len(PROMPT)  # its own first token's forward alone
    assert runtime.sessions["fork"].pending_token == runtime.sessions["parent"].pending_token  # greedy: the same
    assert free - runtime.pool.num_free_pages == 1  # the shared partial last page, copied before the write
    assert runtime.pool.block_table("fork")[:-1] == runtime.pool.block_table("parent")[:-1]
    other = SessionOpen("other", PROMPT[:-1], GREEDY, want_features=False, fork_of="parent")
    refused = runtime.step(TargetBatch(opens=[other]))
    assert "not a decoding session of the same prompt" in str(refused.failures["other"])
    for sid in ("parent", "fork"):
        runtime.release(sid)
    assert runtime.pool.num_free_pages == 64


def test_a_fork_names_a_session_of_its_own_stream():
    batch = TargetBatch(opens=[SessionOpen("f", [1, 2], GREEDY, True, fork_of="p"), SessionOpen("s", [1], GREEDY, True)])
    decoded, malformed = batch_from_proto(batch_to_proto(batch), "stream/")
    assert not malformed and [o.fork_of for o in decoded.opens] == ["stream/p", ""]
