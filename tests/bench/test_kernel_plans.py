"""The launch plans ``bench.kernels --sweep`` times around a default plan (no GPU needed to list them)."""

from __future__ import annotations

import pytest

from bench.kernels import plan_variants
from diffspec_kernels.tree_attention_triton import plan_tree_attention


@pytest.mark.parametrize(("tree_size", "row_tiles", "wide"), [(1, {16}, False), (16, {64}, False),
                                                            (32, {64, 128}, False), (64, {64, 128, 256}, True)])
def test_variants_start_at_the_default_and_cover_the_row_tiles(tree_size, row_tiles, wide):
    """Llama-3.1-8B's 4 query heads a KV head at 64K on 132 SMs: the default first, no plan twice; 32 tokens
    (128 rows) also try 64-row tiles and 4 warps; 64 tokens (256 rows) keep their 256-row tile's variants."""
    base = plan_tree_attention(1, 8, 4, tree_size, 65536, 128, 132)
    plans = plan_variants(base, 4 * tree_size)
    assert plans[0] == base and len(set(plans)) == len(plans)
    assert {p.block_m for p in plans} == row_tiles | {base.block_m}
    assert any(p.num_warps == 4 and p.block_m == 128 for p in plans) == (tree_size >= 32)
    assert any(p.num_warps == 16 for p in plans) == wide
    assert {p.num_splits for p in plans} == {max(1, base.num_splits // 2), base.num_splits, 2 * base.num_splits}
