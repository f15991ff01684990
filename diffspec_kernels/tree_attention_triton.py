"""Triton tree attention over paged KV: split-KV over the committed prefix, a masked new-token block, an LSE merge.

Same function as ``diffspec_kernels.tree_attention_ref.tree_attention_reference``. Two launches:

1. ``_tree_attention_partials_kernel``, grid (row tiles, num_splits + 1, batch * kv heads). A program
   owns one (sequence, kv head) and one tile of its query rows; a query row is one (new token, query
   head of that kv head's group), so all T x group rows of a kv head share each KV tile it loads and
   each KV byte is read once per row tile. Programs with split < num_splits walk their slice of the
   committed prefix with no mask (paged, through the block table); the program with split ==
   num_splits attends to the sequence's own new tokens under ``new_token_mask``. Each writes an fp32
   partial output, normalised, and its log-sum-exp (base 2).
2. ``diffspec_kernels.split_kv_triton.merge_partials``: each program merges the num_splits + 1 partials of a block of
   (new token, query head) rows in fp32 and writes the output dtype.

The launch plan (``diffspec_kernels.split_plan``: tile sizes, split count) depends only on batch size, head counts,
max_q_len and the block-table width, never on the context lengths, so a padded bucket keeps one plan and a
CUDA graph can capture it; each program reads its sequence's context length on the device and takes an
equal share of it (a split past the end is empty and merges with weight 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffspec_kernels.attention_checks import check_attention_inputs, check_triton_head_dim
from diffspec_kernels.attention_metadata import AttentionMetadata
from diffspec_kernels.split_kv_triton import LOG2_E, finish_partial, merge_partials, online_softmax_update
from diffspec_kernels.split_plan import (
    TUNED_SHARED_MEMORY_BYTES,
    SplitKVPlan,
    plan_split_kv,
    shared_memory_bytes,
    sm_count,
)

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TUNED_HEAD_DIM = 128  # narrower heads keep this head_dim's tiles (the fp32 ones: 32 keys)

TreeAttentionPlan = SplitKVPlan  # the name bench/kernels.py tunes


def plan_tree_attention(
    num_seqs: int,
    num_kv_heads: int,
    group: int,
    max_q_len: int,
    max_context_len: int,  # block-table capacity in tokens, not the live lengths
    head_dim: int,
    num_sms: int,
    element_size: int = 2,  # bytes per q/k/v element: 4 (fp32, the exactness replays) halves the tiles
    shared_bytes: int = TUNED_SHARED_MEMORY_BYTES,  # shared memory one program may use
) -> SplitKVPlan:
    """The shared split-KV plan, its masked part the new tokens (a sequence always has at least one)."""
    return plan_split_kv(
        num_seqs=num_seqs,
        num_kv_heads=num_kv_heads,
        rows=max_q_len * group,
        num_keys=max_context_len,
        masked_parts=1,
        head_dim=head_dim,
        row_bytes=max(head_dim, _TUNED_HEAD_DIM) * element_size,
        num_sms=num_sms,
        shared_bytes=shared_bytes,
    )


@triton.jit
def _attend_context_tile(
    acc,
    m_i,
    l_i,
    q,
    k_pages_ptr,  # [num_pages, PAGE_SIZE, num_kv_heads, HEAD_DIM]
    v_pages_ptr,  # [num_pages, PAGE_SIZE, num_kv_heads, HEAD_DIM]
    block_table_ptr,  # [max_pages_per_seq] int32, this sequence's row
    tile_start,
    end,
    head_offset,
    qk_scale,
    num_kv_heads,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
):
    pos = tile_start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    if MASKED:
        valid = pos < end
        page = tl.load(block_table_ptr + pos // PAGE_SIZE, mask=valid, other=0)
    else:
        page = tl.load(block_table_ptr + pos // PAGE_SIZE)
    token_stride = num_kv_heads * HEAD_DIM
    slot_offset = page.to(tl.int64) * (PAGE_SIZE * token_stride) + (pos % PAGE_SIZE) * token_stride + head_offset
    offsets = slot_offset[:, None] + dims[None, :]  # [BLOCK_N, HEAD_DIM]
    if MASKED:
        k = tl.load(k_pages_ptr + offsets, mask=valid[:, None], other=0.0)
        v = tl.load(v_pages_ptr + offsets, mask=valid[:, None], other=0.0)
    else:
        k = tl.load(k_pages_ptr + offsets)
        v = tl.load(v_pages_ptr + offsets)
    qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    if MASKED:
        qk = tl.where(valid[None, :], qk, float("-inf"))
    return online_softmax_update(acc, m_i, l_i, qk, v, qk_scale)


# The three sizes that change from call to call compile once: specialised, each would add a compile for every
# new combination of "is 1" and "is a multiple of 16" met (a prompt chunk's, a longer context's), inside a request.
@triton.jit(do_not_specialize=["num_splits", "max_pages_per_seq", "max_q_len"])
def _tree_attention_partials_kernel(
    q_ptr,  # [total_q, num_kv_heads * group, HEAD_DIM]
    k_new_ptr,  # [total_q, num_kv_heads, HEAD_DIM]
    v_new_ptr,  # [total_q, num_kv_heads, HEAD_DIM]
    k_pages_ptr,  # [num_pages, PAGE_SIZE, num_kv_heads, HEAD_DIM]
    v_pages_ptr,  # [num_pages, PAGE_SIZE, num_kv_heads, HEAD_DIM]
    cu_q_lens_ptr,  # [batch + 1] int32
    context_lens_ptr,  # [batch] int32
    block_tables_ptr,  # [batch, max_pages_per_seq] int32
    new_token_mask_ptr,  # [total_q, max_q_len] uint8 (the bool mask viewed as bytes)
    partial_out_ptr,  # [total_q, num_kv_heads * group, num_splits + 1, HEAD_DIM] fp32, normalised
    partial_lse_ptr,  # [total_q, num_kv_heads * group, num_splits + 1] fp32, log2-sum-exp2 of base-2 scores
    qk_scale,  # softmax scale * log2(e)
    num_kv_heads,
    group,
    num_splits,
    max_pages_per_seq,
    max_q_len,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    row_tile = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2) // num_kv_heads
    kv_head = tl.program_id(2) % num_kv_heads

    q_start = tl.load(cu_q_lens_ptr + seq)
    q_len = tl.load(cu_q_lens_ptr + seq + 1) - q_start
    if row_tile * BLOCK_M >= q_len * group:
        return

    num_heads = num_kv_heads * group
    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # row = token * group + head within the group
    row_valid = rows < q_len * group
    token = q_start + rows // group  # [BLOCK_M] index into total_q
    head = kv_head * group + rows % group  # [BLOCK_M] query head
    dims = tl.arange(0, HEAD_DIM)
    q_offsets = (token.to(tl.int64) * num_heads + head) * HEAD_DIM
    q = tl.load(q_ptr + q_offsets[:, None] + dims[None, :], mask=row_valid[:, None], other=0.0)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    head_offset = kv_head * HEAD_DIM

    if split < num_splits:
        # Committed prefix: an equal, BLOCK_N-aligned share of this sequence's context, no mask.
        context_len = tl.load(context_lens_ptr + seq)
        chunk = tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N
        start = tl.minimum(split * chunk, context_len)  # a split past the end is empty: start == end
        end = tl.minimum(start + chunk, context_len)
        num_full_tiles = (end - start) // BLOCK_N
        block_table_ptr = block_tables_ptr + seq.to(tl.int64) * max_pages_per_seq
        for tile in range(num_full_tiles):
            acc, m_i, l_i = _attend_context_tile(
                acc, m_i, l_i, q, k_pages_ptr, v_pages_ptr, block_table_ptr, start + tile * BLOCK_N, end,
                head_offset, qk_scale, num_kv_heads, BLOCK_N, HEAD_DIM, PAGE_SIZE, MASKED=False,
            )
        tail_start = start + num_full_tiles * BLOCK_N
        if tail_start < end:
            acc, m_i, l_i = _attend_context_tile(
                acc, m_i, l_i, q, k_pages_ptr, v_pages_ptr, block_table_ptr, tail_start, end,
                head_offset, qk_scale, num_kv_heads, BLOCK_N, HEAD_DIM, PAGE_SIZE, MASKED=True,
            )
    else:
        # The sequence's own new tokens, under its new-token mask (a tree: ancestors and self).
        for key_start in range(0, q_len, BLOCK_N):
            keys = key_start + tl.arange(0, BLOCK_N)
            key_valid = keys < q_len
            key_offsets = (q_start + keys).to(tl.int64) * num_kv_heads * HEAD_DIM + head_offset
            kv_offsets = key_offsets[:, None] + dims[None, :]  # [BLOCK_N, HEAD_DIM]
            k = tl.load(k_new_ptr + kv_offsets, mask=key_valid[:, None], other=0.0)
            v = tl.load(v_new_ptr + kv_offsets, mask=key_valid[:, None], other=0.0)
            mask_offsets = token.to(tl.int64)[:, None] * max_q_len + keys[None, :]
            visible = tl.load(
                new_token_mask_ptr + mask_offsets, mask=row_valid[:, None] & key_valid[None, :], other=0
            )
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            qk = tl.where(visible != 0, qk, float("-inf"))
            acc, m_i, l_i = online_softmax_update(acc, m_i, l_i, qk, v, qk_scale)

    out, lse = finish_partial(acc, m_i, l_i)
    part = (token.to(tl.int64) * num_heads + head) * (num_splits + 1) + split
    tl.store(partial_lse_ptr + part, lse, mask=row_valid)
    tl.store(partial_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=row_valid[:, None])


def _check_inputs(q, k_new, v_new, k_pages, v_pages, meta: AttentionMetadata) -> None:
    check_attention_inputs(q, k_new, v_new, k_pages, v_pages, meta, _SUPPORTED_DTYPES)
    check_triton_head_dim(q.shape[2])
    if meta.page_size & (meta.page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {meta.page_size}")


def run_tree_attention(
    q: torch.Tensor,  # [total_q, num_heads, head_dim]
    k_new: torch.Tensor,  # [total_q, num_kv_heads, head_dim]
    v_new: torch.Tensor,  # [total_q, num_kv_heads, head_dim]
    k_pages: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    plan: SplitKVPlan,
    out: torch.Tensor,  # [total_q, num_heads, head_dim], q's dtype, written
) -> torch.Tensor:  # out
    """Launch with an explicit plan and output buffer (tests and benchmarks); inputs are assumed checked."""
    total_q, num_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[1]
    num_parts = plan.num_splits + 1
    partial_out = torch.empty(total_q, num_heads, num_parts, head_dim, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(total_q, num_heads, num_parts, dtype=torch.float32, device=q.device)
    if total_q == 0:
        return out
    group = num_heads // num_kv_heads
    row_tiles = triton.cdiv(meta.max_q_len * group, plan.block_m)
    grid = (row_tiles, num_parts, meta.batch_size * num_kv_heads)
    _tree_attention_partials_kernel[grid](
        q, k_new, v_new, k_pages, v_pages,
        meta.cu_q_lens, meta.context_lens_t, meta.block_tables, meta.new_token_mask.view(torch.uint8),
        partial_out, partial_lse,
        scale * LOG2_E, num_kv_heads, group, plan.num_splits, meta.block_tables.shape[1], meta.max_q_len,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, HEAD_DIM=head_dim, PAGE_SIZE=meta.page_size,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )  # fmt: skip
    merge_partials(partial_out, partial_lse, out)
    return out


def default_plan(q: torch.Tensor, k_new: torch.Tensor, meta: AttentionMetadata) -> SplitKVPlan:
    return plan_tree_attention(
        num_seqs=meta.batch_size,
        num_kv_heads=k_new.shape[1],
        group=q.shape[1] // k_new.shape[1],
        max_q_len=meta.max_q_len,
        max_context_len=meta.block_tables.shape[1] * meta.page_size,
        head_dim=q.shape[2],
        num_sms=sm_count(q.device),
        element_size=q.element_size(),
        shared_bytes=shared_memory_bytes(q.device),
    )


def tree_attention_triton(
    q: torch.Tensor,  # [total_q, num_heads, head_dim]
    k_new: torch.Tensor,  # [total_q, num_kv_heads, head_dim]
    v_new: torch.Tensor,  # [total_q, num_kv_heads, head_dim]
    k_pages: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [total_q, num_heads, head_dim]
    _check_inputs(q, k_new, v_new, k_pages, v_pages, meta)
    plan = default_plan(q, k_new, meta)
    return run_tree_attention(q, k_new, v_new, k_pages, v_pages, meta, scale, plan, torch.empty_like(q))
