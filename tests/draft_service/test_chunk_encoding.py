"""The pool of chunk encodings: pages handed out in chunk order, kept across the pool's growth, and back in the
pool when a session ends."""

from __future__ import annotations

import gc

import torch

from draft_service.backend import DraftAccept, DraftBatch, DraftStart
from draft_service.chunk_encoding import ChunkEncodingPool, ChunkIndex
from draft_service.options import DraftOptions
from draft_service.runtime import DraftRuntime
from draft_service.working_set import WorkingSetConfig
from diffspec_kernels.chunk_scoring_ref import chunk_scores_reference
from tests.draft_service.test_drafter import load_head

KV_HEADS, HEAD_DIM, CHUNK = 2, 16, 4
CPU = torch.device("cpu")


def alone_scores(keys: torch.Tensor, q: torch.Tensor, chunk_size: int = CHUNK) -> torch.Tensor:
    """[full chunks] scores of keys [length, kv_heads, hd] for q [heads, hd], encoded apart from any pool."""
    full = keys.shape[0] // chunk_size
    chunks = keys[: full * chunk_size].unflatten(0, (full, chunk_size))
    table, count = torch.zeros(1, 1, dtype=torch.int64), torch.tensor([full])
    return chunk_scores_reference(q[None], chunks.amin(1)[None], chunks.amax(1)[None], table, count)[0]


def test_sessions_take_pages_in_turn_and_the_pool_grows_without_moving_them():
    """Two indexes grow in turn over pages of 2 chunks, each taking free pages as it needs them; the pool
    doubles when they run out, and every score stays that of the keys encoded alone."""
    pool = ChunkEncodingPool(CHUNK, KV_HEADS, HEAD_DIM, torch.float32, CPU, page_chunks=2)
    indexes = [ChunkIndex(pool) for _ in range(2)]
    generator = torch.Generator().manual_seed(0)
    keys = [torch.randn(13 * CHUNK, KV_HEADS, HEAD_DIM, generator=generator) for _ in indexes]
    q = torch.randn(2, 4, HEAD_DIM, generator=generator)
    for lengths in [(3, 9), (9, 10), (21, 10), (30, 31), (52, 31)]:  # tokens each session holds
        scores = pool.encode_and_score(indexes, keys, list(lengths), q).scores
        for i, (index, length) in enumerate(zip(indexes, lengths)):
            assert index.num_chunks == length // CHUNK and len(index.pages) == -(-index.num_chunks // 2)
            torch.testing.assert_close(scores[i, : index.num_chunks], alone_scores(keys[i][:length], q[i]))
            assert bool((scores[i, index.num_chunks :] == float("-inf")).all())
    assert (indexes[0].pages, indexes[1].pages) == ([1, 2, 3, 4, 8, 9, 10], [0, 5, 6, 7])
    assert (pool.num_pages, pool.live_pages) == (16, 11)  # grown 1, 2, 4, 8, 16 pages


def test_a_dropped_index_gives_its_pages_back_for_the_next():
    pool = ChunkEncodingPool(CHUNK, KV_HEADS, HEAD_DIM, torch.float32, CPU, page_chunks=2)
    keys = torch.randn(9 * CHUNK, KV_HEADS, HEAD_DIM)
    first = ChunkIndex(pool)
    q = torch.randn(4, HEAD_DIM)
    pool.encode_and_score([first], [keys], [keys.shape[0]], q[None])  # 9 chunks: 5 pages
    assert (pool.num_pages, pool.live_pages) == (5, 5)
    del first
    assert pool.live_pages == 0
    second = ChunkIndex(pool)
    scores = pool.encode_and_score([second], [keys], [4 * CHUNK], q[None]).scores[0, : second.num_chunks]
    assert (pool.num_pages, pool.live_pages) == (5, 2)  # no growth: the freed pages serve it
    torch.testing.assert_close(scores, alone_scores(keys[: 4 * CHUNK], q))


def test_released_sessions_leave_no_pages_behind():
    """Waves of salience sessions start, accept and are released: the drafter's pool ends each wave with every
    page free. A session whose accept failed is dropped too; the failure keeps the step's frame (its
    traceback), so its pages come back when the collector breaks that cycle, as its KV does."""
    salience = WorkingSetConfig(chunk_size=16, budget_tokens=96, sink_chunks=1, recent_chunks=2)
    runtime = DraftRuntime(load_head(CPU, torch.float32), salience, cuda_graphs=False)
    c = runtime.head.config
    generator = torch.Generator().manual_seed(3)
    features = lambda rows: torch.randn(rows, 3 * c.target_hidden_size, generator=generator)  # noqa: E731
    options = DraftOptions("full", "16:0.0:4", salience=True)

    def start(sid: str, length: int) -> DraftStart:
        prompt = torch.randint(0, c.vocab_size, (length,), generator=generator).tolist()
        return DraftStart(sid, prompt, features(length), 1, options)

    for wave in range(3):
        ids = [f"{wave}-{i}" for i in range(6)]
        runtime.step(DraftBatch(starts=[start(sid, 120 + 40 * i) for i, sid in enumerate(ids)], proposes=ids))
        pool = runtime.drafter.chunk_pools[16]  # the first salience session made it
        runtime.step(DraftBatch(accepts=[DraftAccept(sid, [2, 3, 4], features(3)) for sid in ids], proposes=ids))
        assert pool.live_pages == sum(-(-(123 + 40 * i) // 16 // pool.page_chunks) for i in range(6))
        runtime.step(DraftBatch(releases=ids))
        assert pool.live_pages == 0
    runtime.step(DraftBatch(starts=[start("failing", 300)]))
    failed = runtime.step(DraftBatch(accepts=[DraftAccept("failing", [c.vocab_size], features(1))]))
    assert "failing" in failed.failures and not runtime.sessions
    del failed
    gc.collect()
    assert pool.live_pages == 0
