"""Chunk scoring: the Triton kernel against the PyTorch reference (GPU, and small cases on CPU under the
Triton interpreter), the reference's bound (CPU)."""

from __future__ import annotations

import pytest
import torch

from diffspec_kernels.chunk_scoring_ref import chunk_scores_reference
from tests.diffspec_kernels.kernel_cases import kernel_cases


def top_chunks(scores: torch.Tensor, k: int) -> set[int]:
    """The k best-scoring chunks."""
    return set(scores.topk(min(k, scores.numel())).indices.tolist())


# (num_chunks, heads, kv_heads, head_dim, dtype)
TRITON_CASES = kernel_cases(
    gpu=[
        (num_chunks, heads, kv_heads, head_dim, dtype)
        for dtype in (torch.bfloat16, torch.float32)
        for heads, kv_heads, head_dim in [(32, 8, 128), (3, 3, 128), (4, 2, 64)]
        for num_chunks in [1, 63, 64, 2048, 4100]
    ],
    interpreted=[
        (1, 4, 2, 64, torch.float32),
        (65, 3, 3, 32, torch.bfloat16),  # a second, mostly empty block of 64 chunks
        (20, 4, 1, 24, torch.float32),  # head_dim padded to 32
    ],
)


@pytest.mark.parametrize("num_chunks, heads, kv_heads, head_dim, dtype", TRITON_CASES)
def test_triton_scores_match_reference(kernel_device, num_chunks, heads, kv_heads, head_dim, dtype):
    from diffspec_kernels.chunk_scoring_triton import chunk_scores_triton

    gen = torch.Generator(device=kernel_device).manual_seed(num_chunks)
    keys = torch.randn(num_chunks, 16, kv_heads, head_dim, device=kernel_device, generator=gen).to(dtype)
    kmin, kmax = keys.amin(1), keys.amax(1)
    q = torch.randn(heads, head_dim, device=kernel_device, generator=gen).to(dtype)
    got = chunk_scores_triton(q, kmin, kmax)
    want = chunk_scores_reference(q, kmin, kmax)
    assert got.dtype == torch.float32 and got.shape == (num_chunks,)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-3)
    k = min(64, num_chunks)
    overlap = top_chunks(got, k) & top_chunks(want, k)
    assert len(overlap) >= k - 1  # at most a rounding tie at the boundary
