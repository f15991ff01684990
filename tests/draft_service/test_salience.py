"""Chunk encodings, working-set selection and the chunk arena."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draft_service.chunk_arena import ChunkArena
from draft_service.chunk_encoding import ChunkIndex
from draft_service.draft_context import DraftContext
from draft_service.working_set import WorkingSetConfig, WorkingSetSelector
from diffspec_kernels.chunk_scoring_ref import chunk_scores_reference

KV_HEADS, HEAD_DIM, CHUNK = 2, 16, 8


def test_chunk_score_bounds_every_query_key_product():
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(10 * CHUNK, KV_HEADS, HEAD_DIM, generator=gen)
    index = ChunkIndex(CHUNK, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    index.update(keys[:35])  # 4 full chunks, then the rest arrives
    assert index.num_chunks == 4
    index.update(keys)
    q = torch.randn(4, HEAD_DIM, generator=gen)  # 4 query heads over 2 kv heads
    scores = index.scores(q)
    per_chunk = keys.view(10, CHUNK, KV_HEADS, HEAD_DIM)
    exact = torch.einsum("hd,cthd->cth", q, per_chunk.repeat_interleave(2, dim=2)).amax(dim=(1, 2))
    assert scores.shape == (10,) and bool((scores >= exact - 1e-5).all())


def test_scores_find_the_chunk_holding_the_matching_key():
    keys = torch.randn(32 * CHUNK, KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1)) * 0.1
    q = torch.zeros(4, HEAD_DIM)
    q[:, 3] = 1.0
    keys[17 * CHUNK + 5, 0, 3] = 50.0  # one key in chunk 17 matches the query strongly
    index = ChunkIndex(CHUNK, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    index.update(keys)
    assert int(index.scores(q).argmax()) == 17


def test_selection_keeps_sinks_recent_and_best_within_budget():
    config = WorkingSetConfig(chunk_size=CHUNK, budget_tokens=8 * CHUNK, sink_chunks=1, recent_chunks=2)
    scores = torch.arange(20, dtype=torch.float32).flip(0)  # chunk 1 best, then 2, 3, ...
    selected = WorkingSetSelector(config).select(scores)
    # 8 chunks of budget leave room for 6 next to the tail (a partial chunk and an accept): sink, 2 recent,
    # the 3 best
    assert selected == [0, 1, 2, 3, 18, 19] and len(selected) == config.max_chunks


def test_selection_is_stable_under_noise_and_follows_a_shift():
    config = WorkingSetConfig(chunk_size=CHUNK, budget_tokens=12 * CHUNK, reselect_every=100, min_overlap=0.75)
    selector = WorkingSetSelector(config)
    base = torch.zeros(40)
    base[10:15] = 5.0
    first = selector.select(base)
    noisy = base.clone()
    noisy[20] = 4.0  # one new contender: overlap stays high, no churn
    assert selector.select(noisy) == first
    shifted = torch.zeros(40)
    shifted[25:30] = 5.0  # the text moved on
    assert set(range(25, 30)) <= set(selector.select(shifted))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 15), max_size=6), min_size=1, max_size=12))
def test_arena_holds_exactly_the_selected_chunks(selections):
    source_k = torch.randn(16 * CHUNK, KV_HEADS, HEAD_DIM)
    source_v = torch.randn(16 * CHUNK, KV_HEADS, HEAD_DIM)
    arena = ChunkArena(6, CHUNK, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    for selection in selections:
        selected = sorted(set(selection))
        before, held = arena.copies, arena.chunks()
        arena.update(selected, source_k, source_v)
        entering = len(set(selected) - held)
        assert entering <= arena.copies - before <= entering + len(held - set(selected))
        keys, values = arena.view()
        for slot, chunk in enumerate(arena.slot_chunk):
            span = slice(chunk * CHUNK, (chunk + 1) * CHUNK)
            assert torch.equal(keys[slot * CHUNK : (slot + 1) * CHUNK], source_k[span])
            assert torch.equal(values[slot * CHUNK : (slot + 1) * CHUNK], source_v[span])
        assert sorted(arena.slot_chunk) == selected


def test_memory_is_bounded_at_128k_context():
    config = WorkingSetConfig(chunk_size=64, budget_tokens=2048)
    context = DraftContext(KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"), config)
    arena_bytes = context.arenas[0].num_bytes
    gen = torch.Generator().manual_seed(3)
    for _ in range(32):  # 32 x 4096 = 128K tokens, the working set refreshed as they arrive
        ((keys, values),) = context.claim(4096)
        keys.copy_(torch.randn(4096, KV_HEADS, HEAD_DIM, generator=gen))
        values.copy_(torch.randn(4096, KV_HEADS, HEAD_DIM, generator=gen))
        context.refresh(torch.randn(4, HEAD_DIM, generator=gen))
    keys, _ = context.view(0)
    assert context.length == 131072 and context.arenas[0].num_bytes == arena_bytes
    assert keys.shape[0] == context.attended_tokens <= config.budget_tokens
    assert arena_bytes == 2 * config.max_chunks * 64 * KV_HEADS * HEAD_DIM * 4
