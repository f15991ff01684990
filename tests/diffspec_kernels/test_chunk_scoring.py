"""Chunk scoring of a batch of sessions over pooled pages: the Triton kernel against the PyTorch reference
(GPU, and small cases on CPU under the Triton interpreter), the reference against each session scored
alone and against the keys it bounds (CPU)."""

from __future__ import annotations

import pytest
import torch

from diffspec_kernels.chunk_scoring_ref import chunk_scores_reference
from tests.diffspec_kernels.kernel_cases import kernel_cases


def pooled_inputs(
    chunk_counts: tuple[int, ...], page_chunks: int, heads: int, kv_heads: int, head_dim: int, dtype, device
) -> tuple[torch.Tensor, ...]:
    """Queries [batch, heads, hd], the pool's min and max keys of 16-key chunks, each session's pages drawn
    at random from the pool (a spare page besides), padded page tables [batch, widest] and chunk counts."""
    gen = torch.Generator(device=device).manual_seed(sum(chunk_counts) + page_chunks)
    pages_each = [-(-n // page_chunks) for n in chunk_counts]
    num_pages = sum(pages_each) + 1
    keys = torch.randn(num_pages, page_chunks, 16, kv_heads, head_dim, device=device, generator=gen).to(dtype)
    order = torch.randperm(num_pages, device=device, generator=gen)
    table = torch.zeros(len(chunk_counts), max(pages_each, default=0), dtype=torch.int64, device=device)
    taken = 0
    for b, n in enumerate(pages_each):
        table[b, :n] = order[taken : taken + n]
        taken += n
    q = torch.randn(len(chunk_counts), heads, head_dim, device=device, generator=gen).to(dtype)
    num_chunks = torch.tensor(chunk_counts, dtype=torch.int64, device=device)
    return q, keys.amin(2), keys.amax(2), table, num_chunks


def top_chunks(scores: torch.Tensor, k: int) -> set[int]:
    """The k best-scoring chunks."""
    return set(scores.topk(min(k, scores.numel())).indices.tolist())


# (chunk counts per session, page_chunks, heads, kv_heads, head_dim, dtype)
TRITON_CASES = kernel_cases(
    gpu=[
        (counts, 64, heads, kv_heads, head_dim, dtype)
        for dtype in (torch.bfloat16, torch.float32)
        for heads, kv_heads, head_dim in [(32, 8, 128), (3, 3, 128), (4, 2, 64)]
        for counts in [(1,), (63, 64, 0, 65), (2048,), (4100, 0, 17, 1024), (0, 0)]
    ],
    interpreted=[
        ((1,), 4, 4, 2, 64, torch.float32),
        ((9, 0, 4, 3), 4, 3, 3, 32, torch.bfloat16),  # ragged: a session with no chunks, a partial page
        ((0, 0), 4, 4, 2, 16, torch.float32),  # no session holds a chunk: nothing to launch
        ((20, 5), 6, 4, 1, 24, torch.float32),  # pages of 6 chunks padded to 8, head_dim padded to 32
    ],
)


@pytest.mark.parametrize("counts, page_chunks, heads, kv_heads, head_dim, dtype", TRITON_CASES)
def test_triton_scores_match_reference(kernel_device, counts, page_chunks, heads, kv_heads, head_dim, dtype):
    from diffspec_kernels.chunk_scoring_triton import chunk_scores_triton

    inputs = pooled_inputs(counts, page_chunks, heads, kv_heads, head_dim, dtype, kernel_device)
    got = chunk_scores_triton(*inputs)
    want = chunk_scores_reference(*inputs)
    assert got.dtype == torch.float32 and got.shape == want.shape == (len(counts), inputs[3].shape[1] * page_chunks)
    assert torch.equal(got.isinf(), want.isinf()) and bool((got[got.isinf()] < 0).all())
    held = ~want.isinf()
    assert torch.allclose(got[held], want[held], rtol=1e-4, atol=1e-3)
    for b, n in enumerate(counts):
        k = min(64, n)
        overlap = top_chunks(got[b, :n], k) & top_chunks(want[b, :n], k)
        assert len(overlap) >= k - 1  # at most a rounding tie at the boundary


@pytest.mark.parametrize("counts", [(5,), (9, 0, 4, 3), (0,), (12, 12)])
def test_the_batch_scores_each_session_as_alone(counts):
    """Session b's row is its own batch of one (another page table around it changes nothing); past its chunks,
    -inf."""
    q, kmin, kmax, table, num_chunks = pooled_inputs(counts, 4, 4, 2, 16, torch.float32, "cpu")
    batch = chunk_scores_reference(q, kmin, kmax, table, num_chunks)
    for b, n in enumerate(counts):
        pages = -(-n // 4)
        alone = chunk_scores_reference(q[b : b + 1], kmin, kmax, table[b : b + 1, :pages], num_chunks[b : b + 1])
        torch.testing.assert_close(batch[b, : 4 * pages], alone[0])
        assert bool((batch[b, n:] == float("-inf")).all())


def test_a_chunk_s_score_bounds_every_query_key_product():
    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(3, 4, 8, 2, 16, generator=gen)  # [pages, page_chunks, keys a chunk, kv_heads, hd]
    q = torch.randn(1, 4, 16, generator=gen)  # 4 query heads over 2 kv heads
    table, num_chunks = torch.tensor([[2, 0]]), torch.tensor([7])
    scores = chunk_scores_reference(q, keys.amin(2), keys.amax(2), table, num_chunks)[0, :7]
    chunk_keys = keys[table[0]].flatten(0, 1)[:7]  # [chunks, keys, kv_heads, hd]
    exact = torch.einsum("hd,cthd->cth", q[0], chunk_keys.repeat_interleave(2, dim=2)).amax(dim=(1, 2))
    assert bool((scores >= exact - 1e-5).all())


@pytest.mark.parametrize(
    "bad",
    [
        {"q": torch.zeros(2, 4, 16)},  # two queries, one page table row
        {"page_table": torch.zeros(1, 2, dtype=torch.int32)},
        {"num_chunks": torch.zeros(2, dtype=torch.int64)},
        {"q": torch.zeros(1, 3, 16)},  # 3 heads over 2 kv heads
    ],
)
def test_the_scorer_refuses_mismatched_inputs(bad):
    pages = torch.zeros(2, 4, 2, 16)  # 2 pages of 4 chunks, 2 kv heads
    inputs = {
        "q": torch.zeros(1, 4, 16), "key_min": pages, "key_max": pages,
        "page_table": torch.zeros(1, 2, dtype=torch.int64), "num_chunks": torch.zeros(1, dtype=torch.int64),
    }  # fmt: skip
    with pytest.raises(ValueError):
        chunk_scores_reference(**(inputs | bad))


def test_reference_scores_in_float32_under_a_callers_autocast():
    """The trainer scores working sets under bf16 autocast; the ranking takes float32 scores, the ones outside it."""
    inputs = pooled_inputs((40, 7), 16, 8, 2, 64, torch.bfloat16, torch.device("cpu"))
    plain = chunk_scores_reference(*inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = chunk_scores_reference(*inputs)
    assert autocast.dtype == torch.float32
    torch.testing.assert_close(autocast, plain, rtol=0, atol=0)
