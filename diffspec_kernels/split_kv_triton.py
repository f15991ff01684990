"""What every split-KV (flash-decoding) Triton attention kernel here shares: the online-softmax step, a
part's normalised output and log-sum-exp, and the merge of the parts.

A partials kernel cuts the keys of each query row into parts; each part folds its keys in with
``online_softmax_update`` and ends with ``finish_partial``: an fp32 output normalised by its own
softmax sum, and that sum's log (base 2, of scores already scaled by ``softmax scale * log2(e)``).
``merge_partials`` weighs each part by exp2(its lse - the row's largest) and writes the output dtype.
A part that saw no key (empty, or every key masked) has lse -inf and weight 0, and its output is not read.
How the keys are cut into parts, and the tiles, is ``diffspec_kernels.split_plan``'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634
_MERGE_ELEMENTS = 32  # rows x parts a merge program holds at once (times HEAD_DIM fp32 values)


@triton.jit
def online_softmax_update(acc, m_i, l_i, qk, v, qk_scale):
    """Fold one tile in: q.k dot products qk [BLOCK_M, BLOCK_N] (-inf where hidden), values v [BLOCK_N, D].

    m_i and the partial's lse are in base-2 units of the scaled scores (qk * qk_scale).
    """
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    # A row with nothing visible yet keeps m = -inf; shift by 0 instead so no -inf - -inf NaN appears.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk * qk_scale - m_shift[:, None])  # one FMA per score
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def finish_partial(acc, m_i, l_i):
    """(normalised output [BLOCK_M, D] fp32, lse [BLOCK_M] base 2) of one part. Nothing visible (an empty
    part, or a fully masked row): output 0 with lse -inf, which merges with weight 0."""
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    return out, lse


@triton.jit(do_not_specialize=["num_rows", "num_parts"])  # one compile for every batch and width
def _merge_partials_kernel(
    partial_out_ptr,  # [num_rows, num_parts, HEAD_DIM] fp32; a row is one (query, query head)
    partial_lse_ptr,  # [num_rows, num_parts] fp32, base 2
    out_ptr,  # [num_rows, HEAD_DIM] output dtype
    num_rows,
    num_parts,
    BLOCK_R: tl.constexpr,  # rows per program
    BLOCK_P: tl.constexpr,  # >= num_parts
    PART_CHUNK: tl.constexpr,  # partials summed per step
    HEAD_DIM: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_valid = rows < num_rows
    rows = rows.to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    all_parts = tl.arange(0, BLOCK_P)
    lse = tl.load(
        partial_lse_ptr + rows[:, None] * num_parts + all_parts[None, :],
        mask=row_valid[:, None] & (all_parts < num_parts)[None, :],
        other=float("-inf"),
    )  # [BLOCK_R, BLOCK_P]
    lse_max = tl.max(lse, 1)
    lse_shift = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    total = tl.sum(tl.math.exp2(lse - lse_shift[:, None]), 1)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32)
    for first in range(0, num_parts, PART_CHUNK):
        parts = first + tl.arange(0, PART_CHUNK)
        part_offsets = rows[:, None] * num_parts + parts[None, :]  # [BLOCK_R, PART_CHUNK]
        chunk_lse = tl.load(
            partial_lse_ptr + part_offsets,
            mask=row_valid[:, None] & (parts < num_parts)[None, :],
            other=float("-inf"),
        )
        weight = tl.math.exp2(chunk_lse - lse_shift[:, None])  # 0 for empty parts, which are not read at all
        partial = tl.load(
            partial_out_ptr + part_offsets[:, :, None] * HEAD_DIM + dims[None, None, :],
            mask=(weight > 0.0)[:, :, None],
            other=0.0,
        )  # [BLOCK_R, PART_CHUNK, HEAD_DIM]
        acc += tl.sum(weight[:, :, None] * partial, 1)
    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * HEAD_DIM + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def merge_launch(num_rows: int, num_parts: int) -> tuple[int, int, int, int]:
    """(programs, BLOCK_R, BLOCK_P, PART_CHUNK) for the merge. Few parts (a batch of short contexts)
    merge many rows per program: one program per row made a batch-16 verify launch 8,192 programs of
    almost no work each, measured at 59 us a layer on an H200. Many parts (one long context) keep one
    row per program, its parts summed 16 at a time."""
    part_chunk = min(16, triton.next_power_of_2(num_parts))
    block_r = max(1, _MERGE_ELEMENTS // part_chunk)
    return triton.cdiv(num_rows, block_r), block_r, triton.next_power_of_2(num_parts), part_chunk


def merge_partials(
    partial_out: torch.Tensor,  # [num_rows, num_parts, head_dim] fp32 (any leading shape that flattens to it)
    partial_lse: torch.Tensor,  # [num_rows, num_parts] fp32
    out: torch.Tensor,  # [num_rows, head_dim] (same flattening), written in its own dtype
) -> None:
    head_dim, num_parts = partial_out.shape[-1], partial_out.shape[-2]
    num_rows = partial_lse.numel() // num_parts
    programs, block_r, block_p, part_chunk = merge_launch(num_rows, num_parts)
    _merge_partials_kernel[(programs,)](
        partial_out, partial_lse, out, num_rows, num_parts,
        BLOCK_R=block_r, BLOCK_P=block_p, PART_CHUNK=part_chunk, HEAD_DIM=head_dim, num_warps=4,
    )  # fmt: skip
