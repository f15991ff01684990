"""The working set's candidates ranked in one launch; same function as ``rank_candidates_reference``.

The reference is about fifteen launches for the batch (the eligibility masks, a sort, the sums, a cat), each
host time in every accept of a working-set session. Here the grid is (rows, width / BLOCK): a program ranks
BLOCK chunks of one row by counting, over the whole row in OTHERS-wide steps, the chunks that come before each
in stable descending order of its key (the score where eligible, else -inf; ``stable_order_triton``), and
writes each chunk whose rank is below the ranked width to that column. The ranks of a row are a permutation,
so every column is written once. The row's first program also writes its three leading columns. A row of
128K context in 64-token chunks has 2,048 chunks: 64 programs of 2,048 x 32 comparisons each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffspec_kernels.candidate_rank_ref import RANKED_AT, check_candidate_inputs
from diffspec_kernels.stable_order_triton import ahead_of

BLOCK = 32  # chunks ranked per program
OTHERS = 64  # chunks compared against per step of the count


@triton.jit
def _keys(scores_ptr, row, chunks, width, sinks_end, recent_start):
    """Eligibility and rank keys [BLOCK] of ``chunks`` of one row: the score where eligible, else -inf."""
    inside = chunks < width
    score = tl.load(scores_ptr + row * width + chunks, mask=inside, other=float("-inf"))
    eligible = inside & (chunks >= sinks_end) & (chunks < recent_start) & (tl.abs(score) < float("inf"))
    return eligible, tl.where(eligible, score, float("-inf"))


# Widths and rows move with the contexts: not specialised, so one compile serves every batch.
@triton.jit(do_not_specialize=["width", "ranked"], do_not_specialize_on_alignment=["num_chunks_ptr", "forced_ptr"])
def _rank_candidates_kernel(
    scores_ptr,  # [rows, width] float32
    num_chunks_ptr,  # [rows] int64
    forced_ptr,  # [2 * rows] int64: sink_chunks of every row, then recent_chunks of every row
    out_ptr,  # [rows, RANKED_AT + ranked] int64
    width,
    ranked,  # ranked columns: min(max_ranked, width)
    RANKED_AT: tl.constexpr,
    BLOCK: tl.constexpr,
    OTHERS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    rows = tl.num_programs(0)
    n = tl.load(num_chunks_ptr + row)
    sinks_end = tl.minimum(tl.load(forced_ptr + row), n)
    recent_start = tl.maximum(n - tl.load(forced_ptr + rows + row), 0)
    chunks = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    _, key = _keys(scores_ptr, row, chunks, width, sinks_end, recent_start)
    ahead_count = tl.zeros([BLOCK, OTHERS], dtype=tl.int32)  # summed once, after the loop
    eligible_count = tl.zeros([OTHERS], dtype=tl.int32)
    for other_start in range(0, width, OTHERS):
        others = other_start + tl.arange(0, OTHERS)
        other_eligible, other_key = _keys(scores_ptr, row, others, width, sinks_end, recent_start)
        ahead_count += ahead_of(key, chunks, other_key, others)  # a chunk past the width: -inf, a larger id
        eligible_count += other_eligible.to(tl.int32)
    rank = tl.sum(ahead_count, axis=1)
    out_row = out_ptr + row * (RANKED_AT + ranked)
    tl.store(out_row + RANKED_AT + rank, chunks.to(tl.int64), mask=(chunks < width) & (rank < ranked))
    if tl.program_id(1) == 0:
        tl.store(out_row, sinks_end)
        tl.store(out_row + 1, recent_start)
        tl.store(out_row + 2, tl.sum(eligible_count).to(tl.int64))


def rank_candidates_triton(
    scores: torch.Tensor,  # [rows, width] float32; row i's first num_chunks[i] score its chunks
    num_chunks: torch.Tensor,  # [rows] int64
    forced: torch.Tensor,  # [2 * rows] int64: each row's sink_chunks, then each row's recent_chunks
    max_ranked: int,  # chunks a row may choose by score at most
) -> torch.Tensor:  # [rows, RANKED_AT + min(max_ranked, width)] int64
    check_candidate_inputs(scores, num_chunks, forced)
    scores, num_chunks, forced = scores.contiguous(), num_chunks.contiguous(), forced.contiguous()
    rows, width = scores.shape
    ranked = min(max_ranked, width)
    out = torch.empty(rows, RANKED_AT + ranked, dtype=torch.int64, device=scores.device)
    if rows == 0:
        return out
    grid = (rows, max(1, triton.cdiv(width, BLOCK)))  # a row of no chunks still writes its leading columns
    _rank_candidates_kernel[grid](
        scores, num_chunks, forced, out, width, ranked, RANKED_AT=RANKED_AT, BLOCK=BLOCK, OTHERS=OTHERS
    )
    return out
