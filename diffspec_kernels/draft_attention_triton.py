"""Triton draft attention: split-KV over each session's padded context, a masked new-entry part, an LSE merge.

Same function as ``diffspec_kernels.draft_attention_ref.draft_attention_reference``. Two launches:

1. ``_draft_attention_partials_kernel``, grid (row tiles, num_splits + 1, batch * kv heads), the last
   split only when there are new entries. A program owns one (session, kv head) and one tile of its
   query rows; a query row is one (query, query head of that kv head's group), so all n x group rows of
   a kv head share each key tile it loads and each context byte is read once per row tile. Programs
   with split < num_splits walk an equal, BLOCK_N-aligned share of the keys below their session's
   length (never the padding past it; a share past the end reads nothing); the program with split ==
   num_splits attends to the session's new entries under ``new_mask``. Each writes an fp32 partial
   output, normalised, and its log-sum-exp (base 2).
2. ``diffspec_kernels.split_kv_triton.merge_partials`` merges the parts of every (query, query head) row in fp32
   and writes q's dtype.

The launch plan (``diffspec_kernels.split_plan``) depends only on the shapes (batch, heads, n, context capacity, m,
dtype), never on the lengths, which are read on the device: one plan per padded bucket, no host sync, so a
CUDA graph can capture the call. A query that sees no key at all gets 0 (the reference gets NaN).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from diffspec_kernels.attention_checks import check_draft_attention_inputs, check_triton_head_dim
from diffspec_kernels.split_kv_triton import LOG2_E, finish_partial, merge_partials, online_softmax_update
from diffspec_kernels.split_plan import (
    TUNED_SHARED_MEMORY_BYTES,
    SplitKVPlan,
    plan_split_kv,
    shared_memory_bytes,
    sm_count,
)

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def plan_draft_attention(
    batch: int,
    num_kv_heads: int,
    group: int,
    num_queries: int,  # n
    capacity: int,  # context keys per session, padding included (not the live lengths)
    num_new: int,  # m
    head_dim: int,
    element_size: int,  # bytes per q/k/v element
    num_sms: int,
    shared_bytes: int = TUNED_SHARED_MEMORY_BYTES,  # shared memory one program may use
) -> SplitKVPlan:
    """The split-KV plan over each session's context (tree attention's tiles: the same loop over the same 8B
    shapes), its masked part the new entries when there are any, the tiles sized for the rows' real width."""
    return plan_split_kv(
        num_seqs=batch,
        num_kv_heads=num_kv_heads,
        rows=num_queries * group,
        num_keys=capacity,
        masked_parts=1 if num_new > 0 else 0,
        head_dim=head_dim,
        row_bytes=head_dim * element_size,
        num_sms=num_sms,
        shared_bytes=shared_bytes,
    )


@triton.jit
def _attend_keys(
    acc,
    m_i,
    l_i,
    q,
    k_ptr,  # [keys, token_stride]: this (session, kv head)'s first key; HEAD_DIM of each row are read
    v_ptr,  # [keys, token_stride]
    keys,  # [BLOCK_N] key indices
    key_valid,  # [BLOCK_N] keys that exist (MASKED only)
    visible,  # [BLOCK_M, BLOCK_N] query row sees key (MASKED only)
    qk_scale,
    token_stride,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
):
    dims = tl.arange(0, HEAD_DIM)
    offsets = keys.to(tl.int64)[:, None] * token_stride + dims[None, :]  # [BLOCK_N, HEAD_DIM]
    if MASKED:
        k = tl.load(k_ptr + offsets, mask=key_valid[:, None], other=0.0)
        v = tl.load(v_ptr + offsets, mask=key_valid[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + offsets)
        v = tl.load(v_ptr + offsets)
    qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    if MASKED:
        qk = tl.where(visible, qk, float("-inf"))
    return online_softmax_update(acc, m_i, l_i, qk, v, qk_scale)


# Sizes are runtime values, not specialised: an online policy's widths and a growing context would
# otherwise compile a variant per divisibility pattern, seconds each on the first proposals.
@triton.jit(
    do_not_specialize=[
        "num_queries", "num_kv_heads", "group", "capacity", "num_new", "num_splits", "num_parts",
        "mask_batch_stride", "mask_row_stride", "lengths_stride",
    ]
)  # fmt: skip
def _draft_attention_partials_kernel(
    q_ptr,  # [batch, num_queries, num_kv_heads * group, HEAD_DIM]
    ctx_k_ptr,  # [batch, capacity, num_kv_heads, HEAD_DIM]
    ctx_v_ptr,  # [batch, capacity, num_kv_heads, HEAD_DIM]
    new_k_ptr,  # [batch, num_new, num_kv_heads, HEAD_DIM]
    new_v_ptr,  # [batch, num_new, num_kv_heads, HEAD_DIM]
    new_mask_ptr,  # [batch, num_queries, num_new] uint8 (the bool mask as bytes), strides (mask_batch_stride, mask_row_stride, 1)
    ctx_lengths_ptr,  # [batch] int64, stride lengths_stride; None: every context is capacity keys long
    partial_out_ptr,  # [batch, num_queries, num_kv_heads * group, num_parts, HEAD_DIM] fp32, normalised
    partial_lse_ptr,  # [batch, num_queries, num_kv_heads * group, num_parts] fp32, log2-sum-exp2 of base-2 scores
    qk_scale,  # softmax scale * log2(e)
    num_queries,
    num_kv_heads,
    group,
    capacity,
    num_new,
    num_splits,
    num_parts,  # num_splits, plus 1 when num_new > 0
    mask_batch_stride,
    mask_row_stride,
    lengths_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    row_tile = tl.program_id(0)
    split = tl.program_id(1)
    session = tl.program_id(2) // num_kv_heads
    kv_head = tl.program_id(2) % num_kv_heads

    num_heads = num_kv_heads * group
    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # row = query * group + head within the group
    row_valid = rows < num_queries * group
    query = rows // group  # [BLOCK_M]
    q_rows = (session.to(tl.int64) * num_queries + query) * num_heads + kv_head * group + rows % group  # [BLOCK_M]
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + q_rows[:, None] * HEAD_DIM + dims[None, :], mask=row_valid[:, None], other=0.0)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    token_stride = num_kv_heads * HEAD_DIM
    head_offset = kv_head * HEAD_DIM

    if split < num_splits:
        # The context: an equal, BLOCK_N-aligned share of the keys below this session's length, no mask.
        if ctx_lengths_ptr is None:
            length = capacity
        else:
            length = tl.load(ctx_lengths_ptr + session * lengths_stride).to(tl.int32)
            length = tl.minimum(tl.maximum(length, 0), capacity)
        chunk = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
        start = tl.minimum(split * chunk, length)  # a split past the end is empty: start == end
        end = tl.minimum(start + chunk, length)
        num_full_tiles = (end - start) // BLOCK_N
        session_offset = session.to(tl.int64) * capacity * token_stride + head_offset
        k_ptr, v_ptr = ctx_k_ptr + session_offset, ctx_v_ptr + session_offset
        for tile in range(num_full_tiles):
            keys = start + tile * BLOCK_N + tl.arange(0, BLOCK_N)
            acc, m_i, l_i = _attend_keys(
                acc, m_i, l_i, q, k_ptr, v_ptr, keys, None, None, qk_scale, token_stride, HEAD_DIM, MASKED=False
            )
        tail_start = start + num_full_tiles * BLOCK_N
        if tail_start < end:
            keys = tail_start + tl.arange(0, BLOCK_N)
            key_valid = keys < end
            acc, m_i, l_i = _attend_keys(
                acc, m_i, l_i, q, k_ptr, v_ptr, keys, key_valid, key_valid[None, :], qk_scale, token_stride,
                HEAD_DIM, MASKED=True,
            )  # fmt: skip
    else:
        # The session's new entries, under its mask (in a tree: ancestors and self).
        session_offset = session.to(tl.int64) * num_new * token_stride + head_offset
        k_ptr, v_ptr = new_k_ptr + session_offset, new_v_ptr + session_offset
        mask_rows = session.to(tl.int64) * mask_batch_stride + query * mask_row_stride  # [BLOCK_M]
        for key_start in range(0, num_new, BLOCK_N):
            keys = key_start + tl.arange(0, BLOCK_N)
            key_valid = keys < num_new
            seen = tl.load(
                new_mask_ptr + mask_rows[:, None] + keys[None, :], mask=row_valid[:, None] & key_valid[None, :], other=0
            )
            acc, m_i, l_i = _attend_keys(
                acc, m_i, l_i, q, k_ptr, v_ptr, keys, key_valid, seen != 0, qk_scale, token_stride, HEAD_DIM,
                MASKED=True,
            )  # fmt: skip

    out, lse = finish_partial(acc, m_i, l_i)
    part = q_rows * num_parts + split
    tl.store(partial_lse_ptr + part, lse, mask=row_valid)
    tl.store(partial_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=row_valid[:, None])


def run_draft_attention(
    q: torch.Tensor,  # [batch, n, heads, hd]
    ctx_k: torch.Tensor,  # [batch, capacity, kv_heads, hd]
    ctx_v: torch.Tensor,  # [batch, capacity, kv_heads, hd]
    new_k: torch.Tensor,  # [batch, m, kv_heads, hd]
    new_v: torch.Tensor,  # [batch, m, kv_heads, hd]
    new_mask: torch.Tensor,  # [batch, n, m] bool, last dim contiguous
    scale: float,
    ctx_lengths: torch.Tensor | None,  # [batch] int64, or None: all capacity keys valid
    plan: SplitKVPlan,
    out: torch.Tensor,  # [batch, n, heads, hd], q's dtype, contiguous, written
) -> torch.Tensor:  # out
    """Launch with an explicit plan and output buffer (tests and benchmarks); inputs are assumed checked."""
    batch, num_queries, num_heads, head_dim = q.shape
    capacity, num_kv_heads = ctx_k.shape[1], ctx_k.shape[2]
    num_new = new_k.shape[1]
    num_parts = plan.num_splits + (1 if num_new > 0 else 0)
    partial_out = torch.empty(batch, num_queries, num_heads, num_parts, head_dim, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(batch, num_queries, num_heads, num_parts, dtype=torch.float32, device=q.device)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    grid = (triton.cdiv(num_queries * group, plan.block_m), num_parts, batch * num_kv_heads)
    _draft_attention_partials_kernel[grid](
        q, ctx_k, ctx_v, new_k, new_v, new_mask.view(torch.uint8), ctx_lengths, partial_out, partial_lse,
        scale * LOG2_E, num_queries, num_kv_heads, group, capacity, num_new, plan.num_splits, num_parts,
        new_mask.stride(0), new_mask.stride(1), 0 if ctx_lengths is None else ctx_lengths.stride(0),
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, HEAD_DIM=head_dim,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )  # fmt: skip
    merge_partials(partial_out, partial_lse, out)
    return out


def default_plan(q: torch.Tensor, ctx_k: torch.Tensor, new_k: torch.Tensor) -> SplitKVPlan:
    """The plan for batch-flattened inputs (q [batch, n, heads, hd], ctx_k and new_k [batch, keys, kv_heads, hd])."""
    batch, num_queries, num_heads, head_dim = q.shape
    return plan_draft_attention(
        batch=batch,
        num_kv_heads=ctx_k.shape[2],
        group=num_heads // ctx_k.shape[2],
        num_queries=num_queries,
        capacity=ctx_k.shape[1],
        num_new=new_k.shape[1],
        head_dim=head_dim,
        element_size=q.element_size(),
        num_sms=sm_count(q.device),
        shared_bytes=shared_memory_bytes(q.device),
    )


def draft_attention_triton(
    q: torch.Tensor,  # [..., n, heads, hd]
    ctx_k: torch.Tensor,  # [..., ctx, kv_heads, hd] committed keys (whole context or working set)
    ctx_v: torch.Tensor,  # [..., ctx, kv_heads, hd]
    new_k: torch.Tensor,  # [..., m, kv_heads, hd] keys of entries not yet committed
    new_v: torch.Tensor,  # [..., m, kv_heads, hd]
    new_mask: torch.Tensor,  # [..., n, m] bool: query i sees new entry j
    scale: float,
    ctx_lengths: torch.Tensor | None = None,  # [...] int64: keys at index >= length are padding; None: all valid
) -> torch.Tensor:  # [..., n, heads, hd] in q's dtype
    check_draft_attention_inputs(q, ctx_k, ctx_v, new_k, new_v, new_mask, ctx_lengths, _SUPPORTED_DTYPES)
    check_triton_head_dim(q.shape[-1])
    *lead, n, heads, hd = q.shape
    batch = math.prod(lead)  # the leading dims flatten to one batch dim (views: the tensors are contiguous)
    q, ctx_k, ctx_v, new_k, new_v = (t.reshape(batch, *t.shape[len(lead) :]) for t in (q, ctx_k, ctx_v, new_k, new_v))
    new_mask = new_mask.reshape(batch, n, new_mask.shape[-1])
    ctx_lengths = None if ctx_lengths is None else ctx_lengths.reshape(batch)
    plan = default_plan(q, ctx_k, new_k)
    out = torch.empty_like(q)
    run_draft_attention(q, ctx_k, ctx_v, new_k, new_v, new_mask, scale, ctx_lengths, plan, out)
    return out.view(*lead, n, heads, hd)
