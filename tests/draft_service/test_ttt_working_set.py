"""Training under the salience working set: its attention, its choice of chunks, and serving's choice."""

from __future__ import annotations

import pytest
import torch

from draft_service import ttt_working_set
from draft_service.drafter import Drafter
from draft_service.ttt_unroll import ttt_attention
from draft_service.ttt_working_set import (
    choose_block_working_sets,
    gather_block_context,
    working_set_attention,
)
from draft_service.working_set import WorkingSetConfig
from tests.draft_service.test_eagle3_head import HIDDEN, VOCAB, random_head

HEADS, KV_HEADS, DIM = 4, 2, 8
SCALE = DIM**-0.5
# 4-token chunks, 7 chunks in the budget: the sink, two recent chunks and up to four chosen by score
SMALL = WorkingSetConfig(chunk_size=4, budget_tokens=36, sink_chunks=1, recent_chunks=2)


def _random_step(batch: int, length: int, steps: int, seed: int) -> list[torch.Tensor]:
    """q [B, length - steps, ...], k0, v0 [B, length, ...], diag_k, diag_v [B, length - steps, steps, ...]: an
    unrolled step ``steps`` of a window of ``length`` positions."""
    gen = torch.Generator().manual_seed(seed)
    rows = length - steps
    return [
        torch.randn(batch, rows, HEADS, DIM, generator=gen),
        *(torch.randn(batch, length, KV_HEADS, DIM, generator=gen) for _ in range(2)),
        *(torch.randn(batch, rows, steps, KV_HEADS, DIM, generator=gen) for _ in range(2)),
    ]


@pytest.mark.parametrize("steps", [0, 2])
def test_working_set_attention_matches_explicit_keys(steps: int) -> None:
    """Position t sees the keys of its block's chosen chunks, its own chunk's keys up to t, and its own unrolled
    keys; nothing else."""
    batch, length = 2, 75  # not a whole number of chunks; 18 full chunks, more than the budget's 7
    q, k0, v0, diag_k, diag_v = _random_step(batch, length, steps, seed=steps)
    q0 = torch.randn(batch, length, HEADS, DIM, generator=torch.Generator().manual_seed(9))
    sets = choose_block_working_sets(q0, k0, SMALL)
    out = working_set_attention(q, gather_block_context(k0, v0, sets), diag_k, diag_v, SCALE)
    size = SMALL.chunk_size
    assert any(len(ids) < block for per_block in sets.chunks for block, ids in enumerate(per_block))  # it selects
    for b in range(batch):
        for t in range(q.shape[1]):
            block = t // size
            seen = [c * size + i for c in sets.chunks[b][block] for i in range(size)] + list(range(block * size, t + 1))
            for h in range(HEADS):
                kv = h // (HEADS // KV_HEADS)
                keys = torch.cat([k0[b, seen, kv], diag_k[b, t, :, kv]])
                values = torch.cat([v0[b, seen, kv], diag_v[b, t, :, kv]])
                expected = torch.softmax(keys @ q[b, t, h] * SCALE, dim=0) @ values
                torch.testing.assert_close(out[b, t, h], expected, rtol=1e-5, atol=1e-5)


def test_a_budget_that_holds_the_window_attends_causally() -> None:
    """Every chunk fits: each position sees every earlier one, as the unroll without a working set."""
    batch, length, steps = 2, 43, 3
    q, k0, v0, diag_k, diag_v = _random_step(batch, length, steps, seed=5)
    roomy = WorkingSetConfig(chunk_size=4, budget_tokens=4 * 16)
    sets = choose_block_working_sets(torch.randn(batch, length, HEADS, DIM), k0, roomy)
    assert sets.chunks[1][10] == list(range(10))
    out = working_set_attention(q, gather_block_context(k0, v0, sets), diag_k, diag_v, SCALE)
    rows = q.shape[1]
    expected = ttt_attention(q, k0[:, :rows], v0[:, :rows], diag_k, diag_v, SCALE)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_block_sets_follow_the_rule() -> None:
    """Sinks and recent chunks always; the best-bounded of the rest; from the query before the block."""
    length = 64
    q0 = torch.zeros(1, length, HEADS, DIM)
    k0 = torch.zeros(1, length, KV_HEADS, DIM)
    q0[0, :, :, 0] = 1.0  # every query looks along dimension 0
    hot = [3, 6, 9, 10, 12]  # chunks holding one key with a large dimension 0
    for chunk in hot:
        k0[0, chunk * 4 + 1, :, 0] = 5.0 + chunk
    sets = choose_block_working_sets(q0, k0, SMALL)
    # block 15: 15 full chunks; sink 0, recent 13 and 14, four chosen of 1..12: the four hottest
    assert sets.chunks[0][15] == [0, 6, 9, 10, 12, 13, 14]
    assert sets.chunks[0][11] == [0, 1, 2, 3, 6, 9, 10]  # 1..8 eligible: 3 and 6 hot, then the lowest ids
    assert sets.chunks[0][0] == [] and int(sets.lengths[0, 0]) == 0
    assert sets.positions[0, 15, : 7 * 4].tolist() == [c * 4 + i for c in [0, 6, 9, 10, 12, 13, 14] for i in range(4)]


def test_blocks_scored_a_few_at_a_time_choose_the_same_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    _, k0, *_ = _random_step(2, 75, 0, seed=7)
    q0 = torch.randn(2, 75, HEADS, DIM, generator=torch.Generator().manual_seed(8))
    at_once = choose_block_working_sets(q0, k0, SMALL)
    monkeypatch.setattr(ttt_working_set, "SCORED_ROWS", 5)  # 36 blocks with chunks before them: 8 groups
    assert choose_block_working_sets(q0, k0, SMALL).chunks == at_once.chunks


@pytest.mark.gpu
def test_block_sets_and_attention_on_a_gpu_are_the_cpu_ones() -> None:
    """A 16K window at serving's sizes: the device scores and ranks the chunks (Triton) to the same sets, and
    attends within float32 rounding of the CPU."""
    config = WorkingSetConfig(chunk_size=64, budget_tokens=2048)
    length, steps = 16384, 2
    q, k0, v0, diag_k, diag_v = _random_step(1, length, steps, seed=3)
    q0 = torch.randn(1, length, HEADS, DIM, generator=torch.Generator().manual_seed(2))
    on_cpu = choose_block_working_sets(q0, k0, config)
    on_gpu = choose_block_working_sets(q0.cuda(), k0.cuda(), config)
    assert on_gpu.chunks == on_cpu.chunks
    assert len(on_cpu.chunks[0][-1]) == config.max_chunks  # it selects: 255 full chunks against 30 slots
    context = gather_block_context(k0.cuda(), v0.cuda(), on_gpu)
    out = working_set_attention(q.cuda(), context, diag_k.cuda(), diag_v.cuda(), SCALE)
    expected = working_set_attention(q, gather_block_context(k0, v0, on_cpu), diag_k, diag_v, SCALE)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("compact", [False, True], ids=["own-positions", "compacted"])
def test_block_sets_and_keys_are_what_serving_stages(compact: bool) -> None:
    """The set a block's queries attend to is the one the drafter stages after a prompt ending at that block, and
    so are its keys, their positions compacted or not as serving stages them: trained as served."""
    head = random_head(seed=4)
    config = WorkingSetConfig(chunk_size=4, budget_tokens=28, sink_chunks=1, recent_chunks=2, reselect_every=1,
                              compact_positions=compact)
    gen = torch.Generator().manual_seed(11)
    window = 61
    token_ids = torch.randint(0, VOCAB, (1, window), generator=gen)
    features = torch.randn(1, window, 3 * HIDDEN, generator=gen)
    with torch.no_grad():
        positions = torch.arange(window - 1)[None]
        q0, k0, v0 = head.attention_inputs(token_ids[:, 1:], head.fuse(features[:, :-1]), head.rope(positions))
        sets = choose_block_working_sets(q0, k0, config)
        context = gather_block_context(k0, v0, sets, head.rope)
        drafter = Drafter(head, cuda_graphs=False)
        ids = token_ids[0].tolist()
        moved = []
        for prompt in (36, 48, 56):  # 9, 12 and 14 full chunks: more than the arena's 5 slots
            session = drafter.start(ids[:prompt], features[0, :prompt], ids[prompt], config)
            arena, block = session.context.arenas[0], prompt // 4
            assert session.context.selects and sorted(arena.chunks()) == sets.chunks[0][block], prompt
            rows = [slot * 4 + i for chunk in sets.chunks[0][block] for slot in [arena.slot_chunk.index(chunk)]
                    for i in range(4)]  # the arena's rows in the trainer's chunk order
            staged_k, staged_v = (x[rows] for x in arena.view())
            width = int(sets.lengths[0, block])
            torch.testing.assert_close(context.chosen_k[0, block, :width], staged_k, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(context.chosen_v[0, block, :width], staged_v, rtol=0, atol=0)
            moved.append(not torch.allclose(staged_k, k0[0, sets.positions[0, block, :width]], rtol=0, atol=1e-6))
    assert any(moved) == compact  # compacted keys are not the keys at their own positions
