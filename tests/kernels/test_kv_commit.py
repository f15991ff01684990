"""KV commit: the PyTorch reference against per-slot copies (CPU), the Triton kernel against the reference (GPU)."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_commit_ref import kv_commit_reference

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")


def random_pool(layers: int, pages: int, page_size: int, kv_heads: int, head_dim: int, tokens: int, **where):
    """(k_pages_all, v_pages_all, new_k, new_v), random and never zero."""
    pool = (layers, pages, page_size, kv_heads, head_dim)
    new = (layers, tokens, kv_heads, head_dim)
    return tuple(torch.randn(shape, **where) for shape in (pool, pool, new, new))


# (layers, pages, page_size, kv_heads, head_dim, new tokens, rows, slots)
REFERENCE_CASES = [
    (1, 2, 4, 1, 8, 1, [0], [5]),
    (3, 4, 4, 2, 8, 6, [0, 2, 5], [7, 0, 15]),  # accepted path 0 -> 2 -> 5 of a tree
    (2, 3, 16, 3, 16, 4, [3, 1], [16, 17]),
    (2, 2, 4, 2, 8, 3, [], []),  # nothing accepted
]


@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_reference_writes_exactly_the_given_slots(case) -> None:
    layers, pages, page_size, kv_heads, head_dim, tokens, rows, slots = case
    torch.manual_seed(len(rows))
    k_pages, v_pages, new_k, new_v = random_pool(layers, pages, page_size, kv_heads, head_dim, tokens)
    k_before, v_before = k_pages.clone(), v_pages.clone()
    rows_t, slots_t = torch.tensor(rows, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64)
    kv_commit_reference(k_pages, v_pages, new_k, new_v, rows_t, slots_t)
    for pages_after, before, new in ((k_pages, k_before, new_k), (v_pages, v_before, new_v)):
        expected = before.clone()
        for row, slot in zip(rows, slots):
            for layer in range(layers):
                expected[layer, slot // page_size, slot % page_size] = new[layer, row]
        assert torch.equal(pages_after, expected)


def test_reference_rejects_int32_indices_and_mismatched_shapes() -> None:
    k_pages, v_pages, new_k, new_v = random_pool(2, 2, 4, 2, 8, 3)
    index = torch.tensor([0], dtype=torch.int64)
    with pytest.raises(ValueError):
        kv_commit_reference(k_pages, v_pages, new_k, new_v, index.int(), index)
    with pytest.raises(ValueError):
        kv_commit_reference(k_pages, v_pages, new_k[:1], new_v[:1], index, index)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads, head_dim, num_accepted", [(8, 128, 5), (3, 128, 1), (2, 64, 17), (8, 128, 0)])
def test_triton_matches_reference(dtype: torch.dtype, kv_heads: int, head_dim: int, num_accepted: int) -> None:
    triton_commit = pytest.importorskip("kernels.kv_commit_triton")
    layers, pages, page_size, tokens = 4, 64, 16, 32
    k_pages, v_pages, new_k, new_v = random_pool(
        layers, pages, page_size, kv_heads, head_dim, tokens, device="cuda", dtype=dtype
    )
    rows = torch.randperm(tokens, device="cuda")[:num_accepted]
    slots = torch.randperm(pages * page_size, device="cuda")[:num_accepted]  # distinct, across random pages
    expected_k, expected_v = k_pages.clone(), v_pages.clone()
    kv_commit_reference(expected_k, expected_v, new_k, new_v, rows, slots)
    triton_commit.kv_commit_triton(k_pages, v_pages, new_k, new_v, rows, slots)
    assert torch.equal(k_pages, expected_k)
    assert torch.equal(v_pages, expected_v)
