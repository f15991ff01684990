"""The working set with compacted positions: its chunks' keys re-roped to follow one another up to the newest
chosen chunk, so the draft sees the working set as a contiguous context of its own length."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from diffspec.rope import RotaryEmbedding
from diffspec_kernels.layer_ops_ref import apply_rotary
from draft_service.chunk_arena import ChunkArena, compacted_shifts
from draft_service.drafter import Drafter, Extension, ProposalRequest
from draft_service.working_set import WorkingSetConfig
from tests.draft_service.test_drafter import POLICIES, assert_same_tree, load_head

KV_HEADS, HEAD_DIM, CHUNK = 2, 16, 8
COMPACT = WorkingSetConfig(chunk_size=16, budget_tokens=96, sink_chunks=1, recent_chunks=2, compact_positions=True)


@pytest.mark.parametrize(("chunks", "shifts"), [
    ([0, 5, 9, 10, 11], [7, 3, 0, 0, 0]),  # the sink and a middle chunk move up to the recent run 9-11
    ([3], [0]),
    ([0, 1, 2], [0, 0, 0]),  # already contiguous: nothing moves
    ([2, 7], [4, 0]),
])
def test_shifts_move_each_chunk_up_to_follow_the_next(chunks, shifts):
    assert compacted_shifts(chunks, 1) == shifts
    assert compacted_shifts(chunks, CHUNK) == [s * CHUNK for s in shifts]
    moved = [c + s for c, s in zip(chunks, shifts)]
    assert moved == list(range(chunks[-1] - len(chunks) + 1, chunks[-1] + 1))  # contiguous, ending where it was


def test_a_restaged_chunk_holds_its_keys_roped_at_the_compacted_positions():
    """rope(k, p) rotated by d equals rope(k, p + d): the arena holds what roping the raw keys at the compacted
    positions gives, the newest chunk bit for bit, and the values as they were."""
    generator = torch.Generator().manual_seed(3)
    rotary = RotaryEmbedding(load_head(torch.device("cpu"), torch.float32).config.rope, HEAD_DIM, torch.device("cpu"))
    length = 12 * CHUNK + 5  # a partial chunk past the full ones
    raw = torch.randn(length, KV_HEADS, HEAD_DIM, generator=generator)
    values = torch.randn(length, KV_HEADS, HEAD_DIM, generator=generator)
    keys = apply_rotary(raw, *rotary.cos_sin(torch.arange(length), torch.float32))
    chunks = [0, 4, 10, 11]
    shifts = torch.tensor(compacted_shifts(chunks, CHUNK)).repeat_interleave(CHUNK)
    arena = ChunkArena(6, CHUNK, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    arena.restage(chunks, torch.tensor(chunks), keys, values, *rotary.cos_sin(shifts, torch.float32))

    positions = torch.tensor([p for c in range(8, 12) for p in range(c * CHUNK, (c + 1) * CHUNK)])
    rows = torch.tensor([p for c in chunks for p in range(c * CHUNK, (c + 1) * CHUNK)])
    staged_keys, staged_values = arena.view()
    want = apply_rotary(raw[rows], *rotary.cos_sin(positions, torch.float32))
    torch.testing.assert_close(staged_keys, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(staged_keys[-CHUNK:], keys[11 * CHUNK : 12 * CHUNK])  # the newest chunk does not move
    assert torch.equal(staged_values, values[rows]) and arena.slot_chunk == chunks


@pytest.fixture(scope="module")
def drafter() -> Drafter:
    return Drafter(load_head(torch.device("cpu"), torch.float32), cuda_graphs=False)


@pytest.mark.parametrize("policy", ["full", "online"])
def test_a_compacted_working_set_drafts_as_a_context_of_only_its_own_rows(drafter, policy):
    """The head (one layer: an entry's keys depend on its own row only) sees a compacted working set as a context
    holding just its chunks and the tail, in order: the tree equals that of a whole-context session over those
    rows alone, and differs from the same working set at its own positions."""
    c = drafter.head.config
    generator = torch.Generator().manual_seed(5)
    length = 300
    prompt = torch.randint(0, c.vocab_size, (length + 1,), generator=generator).tolist()
    features = torch.randn(length, 3 * c.target_hidden_size, generator=generator)
    compacted = drafter.start(prompt[:-1], features, prompt[-1], COMPACT)
    spread = drafter.start(prompt[:-1], features, prompt[-1], replace(COMPACT, compact_positions=False))
    context = compacted.context
    assert context.selects and context.arenas[0].chunks() == spread.context.arenas[0].chunks()
    chunks, tail = context.arenas[0].slot_chunk, context.covered_chunks * COMPACT.chunk_size
    assert chunks == sorted(chunks) and chunks[-1] == context.covered_chunks - 1  # ends where the tail starts
    kept = [t for chunk in chunks for t in range(chunk * COMPACT.chunk_size, (chunk + 1) * COMPACT.chunk_size)]
    kept += list(range(tail, length))
    next_tokens = [*prompt[1:-1], prompt[-1]]  # entry t pairs features[t] with token t + 1
    rows_only = drafter.start([0, *(next_tokens[t] for t in kept[:-1])], features[kept], next_tokens[kept[-1]])

    plan, budget = POLICIES[policy]
    got, alone, uncompacted = drafter.propose_many([ProposalRequest(s, plan, budget) for s in (compacted, rows_only, spread)])
    assert_same_tree(got, alone)
    assert not torch.allclose(got.draft_probs, uncompacted.draft_probs, rtol=0, atol=1e-6) or not torch.equal(
        got.tokens, uncompacted.tokens)


def test_accepts_keep_the_compacted_working_set_equal_to_its_rows_alone(drafter):
    """Through accepts that fill chunks and move the set (each taken at the accept after its scoring), the
    compacted session still drafts as a whole-context session over its working set's rows."""
    c = drafter.head.config
    generator = torch.Generator().manual_seed(8)
    length, grown = 260, 3 * 23
    tokens = torch.randint(0, c.vocab_size, (length + grown + 1,), generator=generator).tolist()
    features = torch.randn(length + grown, 3 * c.target_hidden_size, generator=generator)
    session = drafter.start(tokens[:length], features[:length], tokens[length], COMPACT)
    plan, budget = POLICIES["full"]
    updates = session.context.working_set_updates
    for start in range(length, length + grown, 23):
        drafter.propose_many([ProposalRequest(session, plan, budget)])  # queues the scoring its accept takes
        drafter.extend_many([Extension(session, features[start : start + 23], tokens[start + 1 : start + 24])])
    context = session.context
    assert context.working_set_updates > updates  # the set moved with the text
    size = COMPACT.chunk_size
    kept = [t for chunk in context.arenas[0].slot_chunk for t in range(chunk * size, (chunk + 1) * size)]
    kept += list(range(context.covered_chunks * size, length + grown))
    rows_only = drafter.start([0, *(tokens[t + 1] for t in kept[:-1])], features[kept], tokens[kept[-1] + 1])
    got, alone = drafter.propose_many([ProposalRequest(s, plan, budget) for s in (session, rows_only)])
    assert_same_tree(got, alone)


def test_compacted_positions_need_the_head_s_rope():
    from draft_service.draft_context import DraftContext

    with pytest.raises(ValueError, match="rope"):
        DraftContext(KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"), COMPACT)

