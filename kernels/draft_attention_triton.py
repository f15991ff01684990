"""Triton draft attention: split-KV over each session's padded context, a masked new-entry part, an LSE merge.

Same function as ``kernels.draft_attention_ref.draft_attention_reference``. Two launches:

1. ``_draft_attention_partials_kernel``, grid (row tiles, num_splits + 1, batch * kv heads), the last
   split only when there are new entries. A program owns one (session, kv head) and one tile of its
   query rows; a query row is one (query, query head of that kv head's group), so all n x group rows of
   a kv head share each key tile it loads and each context byte is read once per row tile. Programs
   with split < num_splits walk an equal, BLOCK_N-aligned share of the keys below their session's
   length (never the padding past it; a share past the end reads nothing); the program with split ==
   num_splits attends to the session's new entries under ``new_mask``. Each writes an fp32 partial
   output, normalised, and its log-sum-exp (base 2).
2. ``kernels.split_kv_triton.merge_partials`` merges the parts of every (query, query head) row in fp32
   and writes q's dtype.

The launch plan depends only on the shapes (batch, heads, n, context capacity, m, dtype), never on the
lengths, which are read on the device: one plan per padded bucket, no host sync, so a CUDA graph can
capture the call. A query that sees no key at all gets 0 (the reference gets NaN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.split_kv_triton import LOG2_E, finish_partial, merge_partials, online_softmax_update, sm_count

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Split heuristic, as tree attention's: enough programs to fill the chip, no split shorter than this many keys.
_PROGRAMS_PER_SM = 2
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 64
_TUNED_ROW_BYTES = 256  # tiles below were measured (for tree attention) at bf16 x head_dim 128; wider rows shrink them


@dataclass(frozen=True)
class DraftAttentionPlan:
    """How the partials kernel is launched; fixed for a padded (batch, n, capacity, m) bucket."""

    block_m: int  # query rows (queries x query heads of one kv head) per program, >= 16 for tl.dot
    block_n: int  # keys per inner-loop tile, >= 16 for tl.dot
    num_splits: int  # programs along the context per (session, kv head, row tile)
    num_warps: int
    num_stages: int


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
) -> DraftAttentionPlan:
    """Tree attention's tiles (the same loop over the same 8B shapes), shrunk for rows wider than 256 bytes
    (fp32, or head_dim > 128) so the q tile and two stages of key/value tiles fit 227 KB of shared memory."""
    rows = num_queries * group
    shrink = max(1, head_dim * element_size // _TUNED_ROW_BYTES)
    # Past 128 rows, one 256-row tile over 16 warps reads the context once instead of twice; it fills an
    # SM's registers, so one program per SM.
    wide = rows > 128 and shrink == 1
    block_m = 256 if wide else max(16, min(128 // max(1, shrink // 2), triton.next_power_of_2(rows)))
    if shrink == 1:
        block_n = 64 if (block_m == 64 and head_dim >= 128) or wide else 128
    else:
        block_n = max(16, 64 // shrink)
    programs_per_split = max(1, batch * num_kv_heads * triton.cdiv(rows, block_m))
    new_entry_splits = 1 if num_new > 0 else 0  # the new-entry programs are one more such set
    num_splits = min(
        ((1 if wide else _PROGRAMS_PER_SM) * num_sms) // programs_per_split - new_entry_splits,  # no straggler wave
        triton.cdiv(max(capacity, 1), _MIN_KEYS_PER_SPLIT),
        _MAX_SPLITS,
    )
    return DraftAttentionPlan(
        block_m=block_m,
        block_n=block_n,
        num_splits=max(1, num_splits),
        num_warps=16 if wide else 8 if block_m >= 128 else 4,
        num_stages=2,
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
    plan: DraftAttentionPlan,
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


def default_plan(q: torch.Tensor, ctx_k: torch.Tensor, new_k: torch.Tensor) -> DraftAttentionPlan:
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
    )


def _check_inputs(
    q: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    new_mask: torch.Tensor,
    ctx_lengths: torch.Tensor | None,
) -> None:
    """Shapes, dtypes, devices and contiguity the kernel relies on, so a bad call fails here and not in the kernel."""
    tensors = {"q": q, "ctx_k": ctx_k, "ctx_v": ctx_v, "new_k": new_k, "new_v": new_v}
    for name, tensor in tensors.items():
        if tensor.dtype != q.dtype or q.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(f"{name} is {tensor.dtype}; q, ctx_k/v and new_k/v must share one of {_SUPPORTED_DTYPES}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if q.dim() < 3:
        raise ValueError(f"q must be [..., n, heads, hd], got {tuple(q.shape)}")
    *lead, num_queries, num_heads, head_dim = q.shape
    lead = tuple(lead)
    capacity, num_kv_heads = ctx_k.shape[-3], ctx_k.shape[-2]
    num_new = new_k.shape[-3] if new_k.dim() >= 3 else -1
    if ctx_k.shape != (*lead, capacity, num_kv_heads, head_dim) or ctx_v.shape != ctx_k.shape:
        raise ValueError(f"ctx_k/ctx_v must be [{lead}, ctx, kv_heads, {head_dim}], got {ctx_k.shape}, {ctx_v.shape}")
    if new_k.shape != (*lead, num_new, num_kv_heads, head_dim) or new_v.shape != new_k.shape:
        raise ValueError(f"new_k/new_v must be [{lead}, m, {num_kv_heads}, {head_dim}], got {new_k.shape}, {new_v.shape}")
    if new_mask.dtype != torch.bool or new_mask.shape != (*lead, num_queries, num_new):
        raise ValueError(f"new_mask must be bool [{lead}, {num_queries}, {num_new}], got {new_mask.dtype} {new_mask.shape}")
    if num_new > 1 and new_mask.stride(-1) != 1:
        raise ValueError("new_mask's last dim must be contiguous")
    if ctx_lengths is not None and (ctx_lengths.dtype != torch.int64 or ctx_lengths.shape != lead):
        raise ValueError(f"ctx_lengths must be int64 [{lead}], got {ctx_lengths.dtype} {tuple(ctx_lengths.shape)}")
    others = [ctx_k, ctx_v, new_k, new_v, new_mask] + ([] if ctx_lengths is None else [ctx_lengths])
    if any(tensor.device != q.device for tensor in others):
        raise ValueError(f"every input must be on q's device, {q.device}")
    if num_queries < 1 or num_heads % num_kv_heads:
        raise ValueError(f"need n >= 1 queries and heads ({num_heads}) a multiple of kv heads ({num_kv_heads})")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")


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
    _check_inputs(q, ctx_k, ctx_v, new_k, new_v, new_mask, ctx_lengths)
    *lead, n, heads, hd = q.shape
    batch = math.prod(lead)  # the leading dims flatten to one batch dim (views: the tensors are contiguous)
    q, ctx_k, ctx_v, new_k, new_v = (t.reshape(batch, *t.shape[len(lead) :]) for t in (q, ctx_k, ctx_v, new_k, new_v))
    new_mask = new_mask.reshape(batch, n, new_mask.shape[-1])
    ctx_lengths = None if ctx_lengths is None else ctx_lengths.reshape(batch)
    plan = default_plan(q, ctx_k, new_k)
    out = torch.empty_like(q)
    run_draft_attention(q, ctx_k, ctx_v, new_k, new_v, new_mask, scale, ctx_lengths, plan, out)
    return out.view(*lead, n, heads, hd)
