"""The launch plans ``bench.kernels --sweep`` times around a default plan (no GPU needed to list them)."""

from __future__ import annotations

import dataclasses

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
    # the default plan's key loop, pipelined 2-4 deep and warp-specialised, each way
    loops = {(p.key_loop_stages, p.key_loop_warp_specialize) for p in plans if p.block_m == base.block_m}
    assert loops == {(stages, specialize) for stages in (None, 2, 3, 4) for specialize in (False, True)}
    assert base.key_loop_stages is None and not base.key_loop_warp_specialize
    # half the exponentials on the FMA units: the default's plan among them, never a tile of 16 keys
    fma = [p for p in plans if p.fma_exponentials]
    assert dataclasses.replace(base, fma_exponentials=True) in fma and all(p.block_n >= 32 for p in fma)
    assert {dataclasses.replace(p, fma_exponentials=False) for p in fma} <= set(plans)  # each also plain
    lazy = {(p.key_loop_stages, p.fma_exponentials) for p in plans if p.lazy_rescale}
    assert lazy == {(stages, fma) for stages in (None, 2) for fma in (False, True) if base.block_n >= 32 or not fma}
