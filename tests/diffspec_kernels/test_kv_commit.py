"""KV commit: the PyTorch reference against per-slot copies (CPU), the Triton kernel against the reference
(GPU, and small cases on CPU under the Triton interpreter)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from diffspec_kernels.kv_commit_ref import kv_commit_reference
from tests.diffspec_kernels.kernel_cases import kernel_cases


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


@dataclass(frozen=True)
class CommitCase:
    dtype: torch.dtype
    layers: int
    pages: int
    page_size: int
    kv_heads: int
    head_dim: int
    tokens: int  # new tokens in the step
    num_accepted: int  # of them committed, at random rows into random distinct slots

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"{dtype}_layers{self.layers}_pages{self.pages}x{self.page_size}"
            f"_H{self.kv_heads}_D{self.head_dim}_T{self.tokens}_accept{self.num_accepted}"
        )


TRITON_CASES = kernel_cases(
    gpu=[
        CommitCase(dtype, layers=4, pages=64, page_size=16, kv_heads=kv_heads, head_dim=head_dim, tokens=32,
                   num_accepted=num_accepted)
        for dtype in (torch.bfloat16, torch.float16)
        for kv_heads, head_dim, num_accepted in [(8, 128, 5), (3, 128, 1), (2, 64, 17), (8, 128, 0)]
    ],
    interpreted=[
        CommitCase(torch.bfloat16, layers=2, pages=4, page_size=4, kv_heads=2, head_dim=8, tokens=6, num_accepted=3),
        CommitCase(torch.float16, layers=3, pages=3, page_size=16, kv_heads=3, head_dim=16, tokens=5, num_accepted=5),
        CommitCase(torch.float32, layers=1, pages=2, page_size=4, kv_heads=1, head_dim=8, tokens=3, num_accepted=0),
    ],
)


@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_matches_reference(kernel_device: str, case: CommitCase) -> None:
    triton_commit = pytest.importorskip("diffspec_kernels.kv_commit_triton")
    torch.manual_seed(case.num_accepted)
    k_pages, v_pages, new_k, new_v = random_pool(
        case.layers, case.pages, case.page_size, case.kv_heads, case.head_dim, case.tokens,
        device=kernel_device, dtype=case.dtype,
    )  # fmt: skip
    rows = torch.randperm(case.tokens, device=kernel_device)[: case.num_accepted]
    slots = torch.randperm(case.pages * case.page_size, device=kernel_device)[: case.num_accepted]  # distinct
    expected_k, expected_v = k_pages.clone(), v_pages.clone()
    kv_commit_reference(expected_k, expected_v, new_k, new_v, rows, slots)
    triton_commit.kv_commit_triton(k_pages, v_pages, new_k, new_v, rows, slots)
    assert torch.equal(k_pages, expected_k)
    assert torch.equal(v_pages, expected_v)
