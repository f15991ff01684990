"""Chunk encodings, working-set selection and the chunk arena."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diffspec.errors import InvalidRequest
from diffspec.settings import DiffSpecSettings
from draft_service.chunk_arena import ChunkArena
from draft_service.chunk_encoding import ChunkEncodingPool, ChunkIndex
from draft_service.draft_context import DraftContext, refresh_all, reselect_all
from draft_service.inprocess import working_set_config
from draft_service.train_config import TrainConfig
from draft_service.working_set import WorkingSetConfig, WorkingSetSelector
from tests.draft_service.reference_selection import candidates_on_cpu, select_alone

KV_HEADS, HEAD_DIM, CHUNK = 2, 16, 8


def update(arena: ChunkArena, selected: list[int], keys: torch.Tensor, values: torch.Tensor) -> int:
    """Make ``arena`` hold ``selected``, full chunks of keys and values [length, kv_heads, hd], as
    ``reselect_all`` does: the arena's plan, its copies in one multi-tensor copy. Returns the views copied."""
    plan = arena.plan(selected, keys.shape[0] // arena.chunk_size)
    targets, sources = arena.copy_views(plan, keys, values)
    if targets:
        torch._foreach_copy_(targets, sources)
    return len(targets)


def test_chunk_score_bounds_every_query_key_product():
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(10 * CHUNK, KV_HEADS, HEAD_DIM, generator=gen)
    index = ChunkIndex(ChunkEncodingPool(CHUNK, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu")))
    q = torch.randn(4, HEAD_DIM, generator=gen)  # 4 query heads over 2 kv heads
    index.pool.encode_and_score([index], [keys[:35]], [35], q[None])  # 4 full chunks, then the rest arrives
    assert index.num_chunks == 4
    scores = index.pool.encode_and_score([index], [keys], [keys.shape[0]], q[None]).scores[0]  # -inf past its chunks
    per_chunk = keys.view(10, CHUNK, KV_HEADS, HEAD_DIM)
    exact = torch.einsum("hd,cthd->cth", q, per_chunk.repeat_interleave(2, dim=2)).amax(dim=(1, 2))
    assert index.num_chunks == 10 and bool((scores[:10] >= exact - 1e-5).all())
    assert bool((scores[10:] == float("-inf")).all())


def test_scores_find_the_chunk_holding_the_matching_key():
    keys = torch.randn(32 * CHUNK, KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1)) * 0.1
    q = torch.zeros(4, HEAD_DIM)
    q[:, 3] = 1.0
    keys[17 * CHUNK + 5, 0, 3] = 50.0  # one key in chunk 17 matches the query strongly
    index = ChunkIndex(ChunkEncodingPool(CHUNK, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu")))
    assert int(index.pool.encode_and_score([index], [keys], [keys.shape[0]], q[None]).scores[0].argmax()) == 17


def test_selection_keeps_sinks_recent_and_best_within_budget():
    config = WorkingSetConfig(chunk_size=CHUNK, budget_tokens=8 * CHUNK, sink_chunks=1, recent_chunks=2)
    scores = np.arange(20, dtype=np.float32)[::-1]  # chunk 1 best, then 2, 3, ...
    selected = select_alone(WorkingSetSelector(config), scores)
    # 8 chunks of budget leave room for 6 next to the tail (a partial chunk and an accept): sink, 2 recent,
    # the 3 best
    assert selected == [0, 1, 2, 3, 18, 19] and len(selected) == config.max_chunks


def test_selection_is_stable_under_noise_and_follows_a_shift():
    config = WorkingSetConfig(chunk_size=CHUNK, budget_tokens=12 * CHUNK, reselect_every=100, min_overlap=0.75)
    selector = WorkingSetSelector(config)
    base = np.zeros(40, dtype=np.float32)
    base[10:15] = 5.0
    first = select_alone(selector, base)
    noisy = base.copy()
    noisy[20] = 4.0  # one new contender: overlap stays high, no churn
    assert select_alone(selector, noisy) == first
    shifted = np.zeros(40, dtype=np.float32)
    shifted[25:30] = 5.0  # the text moved on
    assert set(range(25, 30)) <= set(select_alone(selector, shifted))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 15), max_size=6), min_size=1, max_size=12))
def test_arena_holds_exactly_the_selected_chunks(selections):
    source_k = torch.randn(16 * CHUNK, KV_HEADS, HEAD_DIM)
    source_v = torch.randn(16 * CHUNK, KV_HEADS, HEAD_DIM)
    arena = ChunkArena(6, CHUNK, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    for selection in selections:
        selected = sorted(set(selection))
        before, held = arena.copies, list(arena.slot_chunk)
        views = update(arena, selected, source_k, source_v)
        entering = len(set(selected) - set(held))
        assert entering <= arena.copies - before <= entering + len(set(held) - set(selected))
        assert views == 2 * (arena.copies - before)  # a key and a value view per chunk copied
        keys, values = arena.view()
        for slot, chunk in enumerate(arena.slot_chunk):
            span = slice(chunk * CHUNK, (chunk + 1) * CHUNK)
            assert torch.equal(keys[slot * CHUNK : (slot + 1) * CHUNK], source_k[span])
            assert torch.equal(values[slot * CHUNK : (slot + 1) * CHUNK], source_v[span])
        assert sorted(arena.slot_chunk) == selected
        for slot, chunk in enumerate(held[: len(selected)]):  # a chunk that stays below the end keeps its slot
            assert chunk not in selected or arena.slot_chunk[slot] == chunk


@pytest.mark.parametrize(
    ("before", "after", "slot_chunk", "copies"),
    [
        ([1, 3, 5, 7], [1, 3, 5, 7], [1, 3, 5, 7], 0),  # no change
        ([1, 3, 5, 7], [0, 2, 4, 6], [0, 2, 4, 6], 4),  # all new: they take the leavers' slots
        ([1, 3, 5, 7], [3, 4, 7, 9], [4, 3, 9, 7], 2),  # partial overlap: the stayers keep their slots
        ([1, 3, 5, 7], [5, 7], [5, 7], 2),  # shrink: the stayers past the end move down
        ([1, 3, 5, 7], [1, 7, 8], [1, 7, 8], 2),  # shrink with one new: a straggler moves, one enters
        ([1, 3, 5, 7], [1, 3], [1, 3], 0),  # shrink from the end: nothing copied
        ([1, 3], [0, 1, 2, 3, 4, 5], [1, 3, 0, 2, 4, 5], 4),  # grow
        ([1, 3, 5, 7], [], [], 0),  # empty
        ([], [2, 6], [2, 6], 2),  # from empty
    ],
)
def test_arena_update_copies_only_entering_chunks_and_stragglers(before, after, slot_chunk, copies):
    """The arena holds ``after`` in the planned slots, its view is those chunks' keys and values in slot order,
    and the update copied only the chunks that enter and those that move down."""
    gen = torch.Generator().manual_seed(4)
    source_k = torch.randn(10 * CHUNK + 3, KV_HEADS, HEAD_DIM, generator=gen)  # a partial chunk at the end
    source_v = torch.randn(10 * CHUNK + 3, KV_HEADS, HEAD_DIM, generator=gen)
    arena = ChunkArena(6, CHUNK, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    update(arena, before, source_k, source_v)
    start_copies = arena.copies
    views = update(arena, after, source_k, source_v)
    assert arena.slot_chunk == slot_chunk and arena.chunks() == set(after)
    assert (arena.copies - start_copies, views) == (copies, 2 * copies)
    spans = [slice(c * CHUNK, (c + 1) * CHUNK) for c in arena.slot_chunk]
    keys, values = arena.view()
    assert torch.equal(keys, torch.cat([source_k[s] for s in spans]) if spans else source_k[:0])
    assert torch.equal(values, torch.cat([source_v[s] for s in spans]) if spans else source_v[:0])


@pytest.mark.parametrize("selected", [[0, 0], [10], [-1], list(range(7))])
def test_arena_refuses_a_selection_it_cannot_hold(selected):
    source = torch.zeros(10 * CHUNK + 3, KV_HEADS, HEAD_DIM)  # full chunks 0 .. 9
    arena = ChunkArena(6, CHUNK, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError):
        update(arena, selected, source, source)


def test_memory_is_bounded_at_128k_context():
    config = WorkingSetConfig(chunk_size=64, budget_tokens=2048)
    context = DraftContext(KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"), config)
    arena_bytes = context.arenas[0].num_bytes
    gen = torch.Generator().manual_seed(3)
    for _ in range(32):  # 32 x 4096 = 128K tokens, the working set refreshed as they arrive
        ((keys, values),) = context.claim(4096)
        keys.copy_(torch.randn(4096, KV_HEADS, HEAD_DIM, generator=gen))
        values.copy_(torch.randn(4096, KV_HEADS, HEAD_DIM, generator=gen))
        refresh_all([context], torch.randn(1, 4, HEAD_DIM, generator=gen), wait=True)
    keys, _ = context.view(0)
    assert context.length == 131072 and context.arenas[0].num_bytes == arena_bytes
    assert keys.shape[0] == context.attended_tokens <= config.budget_tokens
    assert arena_bytes == 2 * config.max_chunks * 64 * KV_HEADS * HEAD_DIM * 4


def test_working_set_updates_count_the_changes_of_the_set_only():
    """A reselection that keeps the set costs no arena update and is not counted; one that changes it is."""
    config = WorkingSetConfig(chunk_size=4, budget_tokens=24, sink_chunks=1, recent_chunks=1, reselect_every=1)
    context = DraftContext(1, 2, torch.float32, torch.device("cpu"), config)
    for keys, values in context.claim(40):  # 10 full chunks, 4 slots
        keys.copy_(torch.arange(80.0).view(40, 1, 2))
        values.zero_()

    def reselect_favouring(chunks: set[int]) -> None:
        """A reselection from scores of the 10 chunks that favour ``chunks``."""
        scores = np.array([[5.0 if c in chunks else 0.0 for c in range(10)]], dtype=np.float32)
        reselect_all([context], candidates_on_cpu([config], scores, np.array([10])), np.array([10]))

    reselect_favouring({3, 4})
    assert context.working_set_updates == 1 and context.arenas[0].chunks() == {0, 3, 4, 9}
    reselect_favouring({3, 4})  # the same best chunks: nothing moves
    assert context.working_set_updates == 1
    reselect_favouring({5, 6})
    assert context.working_set_updates == 2 and context.arenas[0].chunks() == {0, 5, 6, 9}


def test_the_working_set_settings_reach_the_selector():
    from diffspec.settings import DiffSpecSettings
    from draft_service.inprocess import working_set_config

    config = working_set_config(DiffSpecSettings(salience_min_overlap=0.5, salience_reselect_every=4, chunk_size=32))
    assert (config.min_overlap, config.reselect_every, config.chunk_size) == (0.5, 4, 32)
    with pytest.raises(ValueError):
        DiffSpecSettings(salience_min_overlap=1.5)


@pytest.mark.parametrize(
    ("budget_tokens", "recent_tokens", "recent_chunks"),
    [
        (2048, 0, 24),  # three quarters of the budget
        (8192, 0, 96),
        (512, 0, 5),  # 6 chunks beside the tail, one of them the sink
        (256, 0, 1),
        (2048, 256, 4),  # an explicit window as given
        (2048, 100, 1),  # whole chunks, at least one
    ],
)
def test_the_recent_window_defaults_to_three_quarters_of_the_working_set(budget_tokens, recent_tokens, recent_chunks):
    settings = DiffSpecSettings(working_set_tokens=budget_tokens, salience_recent_tokens=recent_tokens)
    assert working_set_config(settings).recent_chunks == recent_chunks


def test_a_working_set_too_small_for_its_sink_and_recent_chunks_is_refused_at_start(tmp_path):
    """128 tokens of 64-token chunks leave one chunk beside the tail, against a sink and at least one recent
    chunk: the settings are refused when the draft runtime reads them, not in a request; the trainer's config
    likewise. An explicit recent window the set cannot hold is refused, not shrunk."""
    with pytest.raises(InvalidRequest, match="working_set_tokens 128 .* needs at least 256 tokens"):
        working_set_config(DiffSpecSettings(working_set_tokens=128))
    with pytest.raises(InvalidRequest, match="needs at least 448 tokens"):
        working_set_config(DiffSpecSettings(working_set_tokens=256, salience_recent_tokens=256))
    assert working_set_config(DiffSpecSettings(working_set_tokens=256, salience_recent_tokens=64)).max_chunks == 2
    with pytest.raises(ValueError, match="needs at least 256 tokens"):
        TrainConfig(corpus=[tmp_path], out_dir=tmp_path, working_set_tokens=128, chunk_size=64)
    with pytest.raises(ValueError, match="needs at least"):
        WorkingSetConfig(chunk_size=CHUNK, budget_tokens=4 * CHUNK, sink_chunks=1, recent_chunks=2).fitting()
