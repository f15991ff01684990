"""Draft attention against a plain softmax over the concatenated keys."""

from __future__ import annotations

import pytest
import torch

from draft_service.draft_attention import draft_attention


@pytest.mark.parametrize("heads, kv_heads, ctx, new", [(4, 2, 37, 5), (3, 3, 0, 4), (8, 1, 100, 1), (4, 4, 64, 0)])
def test_matches_softmax_over_concatenated_keys(heads, kv_heads, ctx, new):
    gen = torch.Generator().manual_seed(heads * 100 + ctx)
    n, hd = 6, 16
    q = torch.randn(n, heads, hd, generator=gen)
    ctx_k, ctx_v = torch.randn(2, ctx, kv_heads, hd, generator=gen)
    new_k, new_v = torch.randn(2, new, kv_heads, hd, generator=gen)
    mask = torch.rand(n, new, generator=gen) < 0.6
    got = draft_attention(q, ctx_k, ctx_v, new_k, new_v, mask, 0.25)

    keys = torch.cat([ctx_k, new_k]).repeat_interleave(heads // kv_heads, dim=1)
    values = torch.cat([ctx_v, new_v]).repeat_interleave(heads // kv_heads, dim=1)
    visible = torch.cat([torch.ones(n, ctx, dtype=torch.bool), mask], dim=1)
    scores = torch.einsum("nhd,khd->hnk", q, keys) * 0.25
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    expected = torch.einsum("hnk,khd->nhd", probs, values)
    assert torch.allclose(got.nan_to_num(0.0), expected, atol=1e-5)
    if ctx > 0:
        assert not got.isnan().any()


def test_a_batch_equals_each_session_alone():
    """Leading batch dims: each session's queries over its own (padded, masked) context and entries."""
    gen = torch.Generator().manual_seed(7)
    batch, n, heads, kv_heads, hd, capacity, m = 3, 4, 4, 2, 8, 20, 5
    q = torch.randn(batch, n, heads, hd, generator=gen)
    ctx_k, ctx_v = torch.randn(2, batch, capacity, kv_heads, hd, generator=gen)
    new_k, new_v = torch.randn(2, batch, m, kv_heads, hd, generator=gen)
    mask = torch.rand(batch, n, m, generator=gen) < 0.5
    mask[..., 0] = True
    lengths = [20, 3, 0]
    got = draft_attention(q, ctx_k, ctx_v, new_k, new_v, mask, 0.3, torch.tensor(lengths))
    for b, length in enumerate(lengths):
        alone = draft_attention(q[b], ctx_k[b, :length], ctx_v[b, :length], new_k[b], new_v[b], mask[b], 0.3)
        torch.testing.assert_close(got[b], alone, rtol=1e-5, atol=1e-6)
