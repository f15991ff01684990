"""One depth of the tree search in one launch: the frontier's children scored, then the next frontier.

Same function as ``draft_service.tree_search.expand`` followed by ``best_frontier`` (the PyTorch
reference, which the CPU runs), bit for bit: those are some twenty small kernels per depth, and in
a proposal's CUDA graph each is a node the GPU waits on and the launch walks.

One program per BLOCK slots of a session (a [128, 128] count in one program per session spilled registers and
took about 18 us a depth on an H200). A slab slot i (frontier row i // K, child rank i % K) gets its
cumulative log-prob (float64: the frontier's plus the child's float32 one, as the reference adds
them) and its validity. Its place in the ranking is counted rather than sorted: the slots whose
key is larger, plus the equal ones before it (keys: the cumulative log-prob, at least the lowest
float64, for a valid slot; -inf for an invalid one), which is the order of a stable descending
sort. The slots ranked below ``next_rows`` become the next frontier, at their rank. Counting is
O(slots^2) per session: a slab is at most a few hundred slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffspec_kernels.stable_order_triton import ahead_of

_LOWEST = torch.finfo(torch.float64).min
MAX_SLOTS = 4096  # a slab wider than this is left to the reference (a sort), which no bucket reaches today
BLOCK = 32  # slots of one program
OTHERS = 64  # a step of the count compares BLOCK slots with this many others


@triton.jit
def _slot_keys(
    slots, b, S, K,
    frontier_log_probs_ptr, frontier_valid_ptr, top_log_probs_ptr, children, min_log_prob, R,
    LOWEST: tl.constexpr,
):  # fmt: skip
    """Cumulative log-probs [BLOCK] float64, validity and rank keys of ``slots`` of session ``b``."""
    in_slab = slots < S
    rows = slots // K
    parent = tl.load(frontier_log_probs_ptr + b * R + rows, mask=in_slab, other=0.0)
    own = tl.load(top_log_probs_ptr + b * S + slots, mask=in_slab, other=0.0).to(tl.float64)
    cumulative = parent + own
    parent_valid = tl.load(frontier_valid_ptr + b * R + rows, mask=in_slab, other=0) != 0
    valid = parent_valid & ((slots % K) < children) & (cumulative >= min_log_prob) & in_slab
    lowest = tl.full(cumulative.shape, LOWEST, tl.float64)  # explicitly float64: as float32 it would be -inf
    key = tl.where(valid, tl.maximum(cumulative, lowest), float("-inf"))
    return cumulative, valid, key


# The widths are runtime values, not specialised: an online policy meets many of them, and a compile per
# width would stall its first proposals for seconds each. Nor is the alignment of children_ptr and
# expand_rows_ptr: they point into columns of the proposal's facts, 16-byte aligned or not by the column's
# parity (which follows the depth and the tree's depth), and each is one scalar load per program.
@triton.jit(
    do_not_specialize=["first_slot", "children_stride", "expand_rows_stride", "R", "K", "next_rows"],
    do_not_specialize_on_alignment=["children_ptr", "expand_rows_ptr"],
)
def _frontier_kernel(
    frontier_log_probs_ptr,  # [B, R] float64
    frontier_valid_ptr,  # [B, R] uint8 (bool)
    frontier_slots_ptr,  # [B, R] int64
    top_log_probs_ptr,  # [B, R, K] float32
    top_tokens_ptr,  # [B, R, K] int64
    children_ptr,  # [B] int64, every children_stride-th element
    min_log_prob_ptr,  # [B] float64
    expand_rows_ptr,  # [B] int64, every expand_rows_stride-th element: next depth's rows each session expands
    cumulative_ptr,  # [B, S] float64 out
    valid_ptr,  # [B, S] uint8 out
    parent_slots_ptr,  # [B, S] int64 out
    next_tokens_ptr,  # [B, next_rows] int64 out
    next_parent_rows_ptr,  # [B, next_rows] int64 out
    next_log_probs_ptr,  # [B, next_rows] float64 out
    next_valid_ptr,  # [B, next_rows] uint8 out
    next_slots_ptr,  # [B, next_rows] int64 out
    first_slot,
    children_stride,
    expand_rows_stride,
    R,  # frontier rows
    K,  # children per row
    next_rows,  # rows of the next frontier
    HAS_NEXT: tl.constexpr,  # False at the last depth: no next frontier
    BLOCK: tl.constexpr,  # slots of this program
    OTHERS: tl.constexpr,  # slots compared against per step of the count
    LOWEST: tl.constexpr,  # the lowest float64: a valid slot's key is at least this
):
    b = tl.program_id(0)
    S = R * K
    children = tl.load(children_ptr + b * children_stride)
    min_log_prob = tl.load(min_log_prob_ptr + b)
    slots = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_slab = slots < S
    cumulative, valid, key = _slot_keys(
        slots, b, S, K, frontier_log_probs_ptr, frontier_valid_ptr, top_log_probs_ptr, children, min_log_prob, R,
        LOWEST,
    )  # fmt: skip
    tl.store(cumulative_ptr + b * S + slots, cumulative, mask=in_slab)
    tl.store(valid_ptr + b * S + slots, valid.to(tl.uint8), mask=in_slab)
    parent_slot = tl.load(frontier_slots_ptr + b * R + slots // K, mask=in_slab, other=0)
    tl.store(parent_slots_ptr + b * S + slots, parent_slot, mask=in_slab)
    if HAS_NEXT:
        ahead_count = tl.zeros([BLOCK, OTHERS], dtype=tl.int32)  # summed once, after the loop
        for other_start in range(0, S, OTHERS):
            others = other_start + tl.arange(0, OTHERS)
            _, _, other_key = _slot_keys(
                others, b, S, K, frontier_log_probs_ptr, frontier_valid_ptr, top_log_probs_ptr,
                children, min_log_prob, R, LOWEST,
            )  # fmt: skip
            ahead_count += ahead_of(key, slots, other_key, others)  # a slot past S: key -inf, a larger index
        rank = tl.sum(ahead_count, axis=1)
        chosen = in_slab & (rank < next_rows)
        expand_rows = tl.load(expand_rows_ptr + b * expand_rows_stride)
        out = b * next_rows + rank
        token = tl.load(top_tokens_ptr + b * S + slots, mask=in_slab, other=0)
        tl.store(next_tokens_ptr + out, token, mask=chosen)
        tl.store(next_parent_rows_ptr + out, (slots // K).to(tl.int64), mask=chosen)
        tl.store(next_log_probs_ptr + out, cumulative, mask=chosen)
        tl.store(next_valid_ptr + out, (valid & (rank < expand_rows)).to(tl.uint8), mask=chosen)
        tl.store(next_slots_ptr + out, (slots + first_slot).to(tl.int64), mask=chosen)


def frontier_step_triton(
    frontier_log_probs: torch.Tensor,  # [B, R] float64
    frontier_valid: torch.Tensor,  # [B, R] bool
    frontier_slots: torch.Tensor,  # [B, R] int64
    top_log_probs: torch.Tensor,  # [B, R, K] float32
    top_tokens: torch.Tensor,  # [B, R, K] int64
    children: torch.Tensor,  # [B] int64, any stride (a column of the proposal's facts)
    min_log_prob: torch.Tensor,  # [B] float64
    expand_rows: torch.Tensor,  # [B] int64, any stride (read only when next_rows > 0)
    next_rows: int,  # rows of the next frontier; 0 at the last depth
    first_slot: int,  # the slab's first candidate slot in the whole tree
) -> tuple[torch.Tensor, ...]:
    """-> cumulative [B, S] float64, valid [B, S] bool, parent_slots [B, S] int64, then the next frontier's
    tokens, parent_rows [B, next_rows] int64, log_probs float64, valid bool, slots int64 (empty when
    next_rows is 0)."""
    batch, rows, k = top_log_probs.shape
    slots = rows * k
    if slots > MAX_SLOTS or next_rows > slots:
        raise ValueError(f"a slab of {rows} x {k} slots and {next_rows} next rows: beyond this kernel")
    if top_tokens.shape != top_log_probs.shape or frontier_log_probs.shape != (batch, rows):
        raise ValueError(f"shapes top {tuple(top_log_probs.shape)}, frontier {tuple(frontier_log_probs.shape)}")
    device = top_log_probs.device
    cumulative = torch.empty(batch, slots, dtype=torch.float64, device=device)
    valid = torch.empty(batch, slots, dtype=torch.uint8, device=device)
    parent_slots = torch.empty(batch, slots, dtype=torch.int64, device=device)
    next_tokens = torch.empty(batch, next_rows, dtype=torch.int64, device=device)
    next_parent_rows = torch.empty_like(next_tokens)
    next_log_probs = torch.empty(batch, next_rows, dtype=torch.float64, device=device)
    next_valid = torch.empty(batch, next_rows, dtype=torch.uint8, device=device)
    next_slots = torch.empty_like(next_tokens)
    if batch and slots:
        block = min(BLOCK, triton.next_power_of_2(slots))
        _frontier_kernel[(batch, triton.cdiv(slots, block))](
            frontier_log_probs.contiguous(), frontier_valid.contiguous().view(torch.uint8), frontier_slots.contiguous(),
            top_log_probs.contiguous(), top_tokens.contiguous(), children, min_log_prob.contiguous(),
            expand_rows, cumulative, valid, parent_slots,
            next_tokens, next_parent_rows, next_log_probs, next_valid, next_slots,
            first_slot, children.stride(0), expand_rows.stride(0),
            rows, k, next_rows, HAS_NEXT=next_rows > 0, BLOCK=block, OTHERS=OTHERS, LOWEST=_LOWEST,
        )  # fmt: skip
    return (
        cumulative, valid.view(torch.bool), parent_slots,
        next_tokens, next_parent_rows, next_log_probs, next_valid.view(torch.bool), next_slots,
    )  # fmt: skip
