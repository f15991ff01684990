"""Chunk scoring: the Triton kernel against the PyTorch reference (GPU), the reference's bound (CPU)."""

from __future__ import annotations

import pytest
import torch

from kernels.chunk_scoring_ref import chunk_scores_reference, top_chunks_reference


def test_reference_top_chunks_are_in_position_order():
    scores = torch.tensor([0.1, 5.0, -2.0, 3.0, 4.0])
    assert top_chunks_reference(scores, 3).tolist() == [1, 3, 4]
    assert top_chunks_reference(scores, 0).tolist() == []


@pytest.mark.gpu
@pytest.mark.parametrize("num_chunks", [1, 63, 64, 2048, 4100])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 128), (3, 3, 128), (4, 2, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_scores_match_reference(num_chunks, heads, kv_heads, head_dim, dtype):
    from kernels.chunk_scoring_triton import chunk_scores_triton

    gen = torch.Generator(device="cuda").manual_seed(num_chunks)
    keys = torch.randn(num_chunks, 16, kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    kmin, kmax = keys.amin(1), keys.amax(1)
    q = torch.randn(heads, head_dim, device="cuda", generator=gen).to(dtype)
    got = chunk_scores_triton(q, kmin, kmax)
    want = chunk_scores_reference(q, kmin, kmax)
    assert got.dtype == torch.float32 and got.shape == (num_chunks,)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-3)
    k = min(64, num_chunks)
    overlap = set(top_chunks_reference(got, k).tolist()) & set(top_chunks_reference(want, k).tolist())
    assert len(overlap) >= k - 1  # at most a rounding tie at the boundary
