"""The split-KV launch plans (``diffspec_kernels.split_plan``) of tree attention and draft attention, pinned shape by shape:
the tuned tiles at the 8B shapes, the shrunk tiles of wide rows, split counts bounded by the chip, by the keys and
by the cap, and the small shapes the interpreted kernel tests run."""

from __future__ import annotations

import pytest
import torch

from diffspec_kernels.draft_attention_triton import plan_draft_attention
from diffspec_kernels.split_plan import TUNED_SHARED_MEMORY_BYTES, shared_memory_bytes
from diffspec_kernels.tree_attention_triton import plan_tree_attention

# (num_seqs, num_kv_heads, group, max_q_len, max_context_len, head_dim, num_sms, element_size)
#   -> (block_m, block_n, num_splits, num_warps)
TREE_PLANS = [
    ((1, 8, 4, 1, 65536, 128, 132, 2), (16, 128, 32, 4)),  # a decode step at 64K: 8 programs a split, 32 splits
    ((1, 8, 4, 16, 65536, 128, 132, 2), (64, 64, 32, 4)),  # 64 rows at head_dim 128: 64-key tiles
    ((1, 8, 4, 32, 65536, 128, 132, 2), (128, 64, 32, 4)),  # 128 rows: 64-key tiles over 4 warps
    ((1, 8, 4, 64, 65536, 128, 132, 2), (256, 64, 15, 16)),  # 256 rows: one wide tile, one program per SM
    ((1, 8, 4, 64, 65536, 128, 132, 4), (128, 32, 15, 8)),  # fp32: no wide tile, 32-key tiles
    ((1, 8, 4, 64, 65536, 64, 132, 4), (128, 32, 15, 8)),  # fp32 keeps head_dim 128's tiles below it
    ((1, 8, 4, 64, 65536, 256, 132, 2), (128, 32, 15, 8)),  # bf16 at head_dim 256: rows twice as wide
    ((1, 8, 4, 64, 65536, 256, 132, 4), (64, 16, 7, 4)),  # fp32 at head_dim 256: four times as wide
    ((1, 8, 4, 64, 131072, 128, 304, 2), (256, 64, 37, 16)),  # an MI300X's 304 CUs
    ((1, 8, 8, 8, 4096, 64, 132, 2), (64, 128, 16, 4)),  # 64 rows at head_dim 64: 128-key tiles; 16 x 256 keys
    ((1, 8, 4, 16, 300, 128, 132, 2), (64, 64, 2, 4)),  # a short block table: splits of >= 256 keys
    ((16, 8, 4, 8, 4096, 128, 132, 2), (32, 128, 1, 4)),  # a batch fills the chip with one split
    ((64, 8, 4, 32, 4096, 128, 132, 2), (128, 64, 1, 4)),  # more programs than the chip holds: still one split
    ((2, 8, 4, 2048, 4096, 128, 132, 4), (128, 32, 1, 8)),  # the fp32 replay's prefill chunk
    ((1, 2, 1, 1, 4, 16, 132, 4), (16, 32, 1, 4)),  # the interpreted cases
    ((2, 2, 2, 4, 40, 32, 132, 2), (16, 128, 1, 4)),
    ((2, 1, 2, 6, 160, 16, 132, 4), (16, 32, 1, 4)),
]


@pytest.mark.parametrize("shape, expected", TREE_PLANS, ids=str)
def test_tree_attention_plan(shape: tuple[int, ...], expected: tuple[int, int, int, int]) -> None:
    plan = plan_tree_attention(*shape)
    assert (plan.block_m, plan.block_n, plan.num_splits, plan.num_warps, plan.num_stages) == (*expected, 2)


# (batch, num_kv_heads, group, num_queries, capacity, num_new, head_dim, element_size, num_sms)
#   -> (block_m, block_n, num_splits, num_warps)
DRAFT_PLANS = [
    ((1, 8, 4, 10, 65536, 64, 128, 2, 132), (64, 64, 32, 4)),  # 2 x 132 SMs / 8 programs, less the new-entry set
    ((16, 8, 4, 10, 65536, 64, 128, 2, 132), (64, 64, 1, 4)),  # 128 programs: one split and the new entries fill it
    ((1, 8, 4, 1, 65536, 0, 128, 2, 132), (16, 128, 33, 4)),  # no new entries: no new-entry set to leave room for
    ((1, 8, 4, 64, 65536, 64, 128, 2, 132), (256, 64, 15, 16)),  # the wide tile
    ((1, 8, 4, 64, 65536, 64, 128, 4, 132), (128, 32, 15, 8)),  # fp32 at head_dim 128: rows twice as wide
    ((1, 8, 4, 64, 65536, 64, 256, 2, 132), (128, 32, 15, 8)),  # bf16 at head_dim 256: the same bytes
    ((1, 8, 4, 64, 65536, 64, 256, 4, 132), (64, 16, 7, 4)),  # four times as wide: quarter tiles
    ((1, 8, 4, 64, 65536, 64, 64, 4, 132), (256, 64, 15, 16)),  # fp32 at head_dim 64: the tuned row bytes
    ((1, 8, 4, 64, 65536, 64, 16, 4, 132), (256, 64, 15, 16)),  # narrower rows keep the tuned tiles
    ((16, 8, 4, 64, 131072, 64, 128, 2, 304), (256, 64, 1, 16)),
    ((0, 8, 4, 10, 65536, 64, 128, 2, 132), (64, 64, 64, 4)),  # an empty batch: the cap
    ((1, 8, 4, 1, 300, 4, 128, 2, 132), (16, 128, 2, 4)),  # a short context: splits of >= 256 keys
    ((3, 2, 4, 5, 160, 7, 16, 4, 132), (32, 128, 1, 4)),  # the interpreted cases
    ((2, 2, 1, 3, 48, 0, 32, 4, 132), (16, 128, 1, 4)),
    ((2, 2, 4, 4, 130, 6, 16, 2, 132), (16, 128, 1, 4)),
    ((1, 1, 2, 2, 20, 1, 16, 4, 132), (16, 128, 1, 4)),
]


@pytest.mark.parametrize("shape, expected", DRAFT_PLANS, ids=str)
def test_draft_attention_plan(shape: tuple[int, ...], expected: tuple[int, int, int, int]) -> None:
    plan = plan_draft_attention(*shape)
    assert (plan.block_m, plan.block_n, plan.num_splits, plan.num_warps, plan.num_stages) == (*expected, 2)


# (rows of a decode step and of a 16-row draft frontier, and a 256-row tree) on a chip with 64 KiB of shared memory
# per program (AMD's LDS): 64-key tiles where the H200 takes 128-key ones; the others already fit
AMD_SHARED = 64 * 1024


@pytest.mark.parametrize(
    "max_q_len, h200_block_n, amd_block_n", [(1, 128, 64), (4, 128, 64), (16, 64, 64), (64, 64, 64)]
)
def test_a_chip_with_less_shared_memory_takes_key_tiles_that_fit(max_q_len, h200_block_n, amd_block_n):
    shape = (1, 8, 4, max_q_len, 65536, 128, 304, 2)
    h200, amd = plan_tree_attention(*shape), plan_tree_attention(*shape, shared_bytes=AMD_SHARED)
    assert (h200.block_n, amd.block_n) == (h200_block_n, amd_block_n)
    assert (h200.block_m, h200.num_splits, h200.num_warps) == (amd.block_m, amd.num_splits, amd.num_warps)
    draft = plan_draft_attention(1, 8, 4, max_q_len, 65536, 0, 128, 2, 304, shared_bytes=AMD_SHARED)
    assert draft.block_n == amd_block_n


@pytest.mark.gpu
def test_the_gpu_reports_the_shared_memory_a_launch_may_use():
    """Triton's opt-in maximum, not torch's 48 KiB default: on Hopper the tuned plans keep their 128-key tiles."""
    shared = shared_memory_bytes(torch.device("cuda"))
    assert shared >= 64 * 1024
    if torch.version.hip is None and torch.cuda.get_device_capability() >= (9, 0):
        assert shared == TUNED_SHARED_MEMORY_BYTES
        assert plan_tree_attention(1, 8, 4, 1, 65536, 128, 132, shared_bytes=shared).block_n == 128
