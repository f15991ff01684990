"""A proposal's last step in two launches: its candidates reranked into the final padded trees, with their ancestor masks.

Same function as ``diffspec_kernels.tree_rerank_ref`` (the PyTorch reference, which the CPU runs), bit for bit:
that is some sixty small kernels (a sort, scatters, a cumsum, a gather and a scatter per depth for
the mask), and in a proposal's CUDA graph each is a node the GPU waits on.

Two launches. The ranking is the O(slots^2) part, so it runs wide: ``_kept_kernel`` gives each block of
RANK_BLOCK slots of a session its own program, and each counts a slot's place in the ranking rather than
sorting, as in ``diffspec_kernels.tree_frontier_triton``: the slots whose key is larger, plus the equal ones
before it (keys: the cumulative log-prob, at least the lowest float64, for a valid slot; -inf otherwise),
which is the order of a stable descending sort. A valid slot ranked below ``total_tokens - 1`` is kept, and
its flag stored to a scratch row. A step compares RANK_BLOCK slots with OTHERS others and the counts are
summed across threads once per program. (In one program per session, as a first version ran it, the count
took about 200 us at the 710 slots of a depth-8 tree on an H200.)

Then ``_rerank_kernel``, one program per session, in four passes over its slots and nodes:

1. A running count of the kept flags (a cumsum), stored in place over the scratch row: a kept slot's node
   index, the root being node 0.
2. The root (node 0) and the padding past the kept nodes are written.
3. Each kept slot is written at its node: its token, depth, draft probability (exp of its float32
   log-prob in float64, rounded to float32, as the reference computes it) and its parent's node, read
   from the scratch row at the parent's slot (the root's children: node 0).
4. The ancestor mask: each node walks up its parents, ``max_depth`` steps, marking every node it meets.

The tree fields also go to the host rows (float64), the one copy the host reads. Passes 3 and 4 read
what the pass before them stored, so a barrier separates them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffspec_kernels.stable_order_triton import ahead_of
from diffspec_kernels.tree_rerank_ref import LOWEST, rerank_reference

# More candidates take the reference (a sort): the count is O(slots^2) per session. On an H200, in a CUDA graph,
# the reference takes 110-175 us whatever the size.
MAX_SLOTS = 1024
MAX_NODES = 512  # a mask row is one block of registers; larger trees take the reference
RANK_BLOCK = 32  # slots ranked per program of ``_kept_kernel``
OTHERS = 64  # a step of the count compares RANK_BLOCK slots with this many others: 2,048 counts, as [128, 16] held
SLOT_BLOCK = 128  # slots per step of the running count and of pass 3
MASK_BLOCK = 4096  # mask entries per step of pass 4


@triton.jit
def _rank_keys(log_probs_ptr, valid_ptr, row, slots, S, LOWEST: tl.constexpr):
    """Validity and rank keys [BLOCK] of ``slots`` in one session's ``row`` (-inf past ``S``)."""
    inside = slots < S
    log_prob = tl.load(log_probs_ptr + row + slots, mask=inside, other=0.0)
    valid = (tl.load(valid_ptr + row + slots, mask=inside, other=0) != 0) & inside
    lowest = tl.full(log_prob.shape, LOWEST, tl.float64)  # explicitly float64: as float32 it would be -inf
    return valid, tl.where(valid, tl.maximum(log_prob, lowest), float("-inf"))


@triton.jit
def _store_nodes(
    tokens_ptr, parents_ptr, draft_probs_ptr, depths_ptr, host_rows_ptr,  # the kernel's outputs
    node_row, host_row, N, nodes, token, parent, draft_prob, depth, write,
):  # fmt: skip
    """Node fields [BLOCK] at ``nodes`` where ``write``, in the tree tensors and the host rows."""
    tl.store(tokens_ptr + node_row + nodes, token, mask=write)
    tl.store(parents_ptr + node_row + nodes, parent, mask=write)
    tl.store(draft_probs_ptr + node_row + nodes, draft_prob, mask=write)
    tl.store(depths_ptr + node_row + nodes, depth, mask=write)
    tl.store(host_rows_ptr + host_row + nodes, token.to(tl.float64), mask=write)
    tl.store(host_rows_ptr + host_row + N + nodes, parent.to(tl.float64), mask=write)
    tl.store(host_rows_ptr + host_row + 2 * N + nodes, draft_prob.to(tl.float64), mask=write)


# The sizes are runtime values, not specialised: a compile per slot count would stall a proposal's first
# run of each shape for seconds.
@triton.jit(do_not_specialize=["total_tokens_stride", "S"])
def _kept_kernel(
    log_probs_ptr,  # [B, S] float64 cumulative
    valid_ptr,  # [B, S] uint8 (bool)
    total_tokens_ptr,  # [B] int64, every total_tokens_stride-th element
    kept_ptr,  # [B, S] int32 out: 1 where the slot is kept
    total_tokens_stride,
    S,  # candidate slots
    RANK_BLOCK: tl.constexpr,  # slots of this program
    OTHERS: tl.constexpr,  # slots compared against per step of the count
    LOWEST: tl.constexpr,  # the lowest float64: a valid slot's key is at least this
):
    b = tl.program_id(0)
    row = b * S
    limit = tl.load(total_tokens_ptr + b * total_tokens_stride) - 1  # the root is one of total_tokens
    slots = tl.program_id(1) * RANK_BLOCK + tl.arange(0, RANK_BLOCK)
    valid, key = _rank_keys(log_probs_ptr, valid_ptr, row, slots, S, LOWEST)
    ahead_count = tl.zeros([RANK_BLOCK, OTHERS], dtype=tl.int32)  # summed once, after the loop
    for other_start in range(0, S, OTHERS):
        others = other_start + tl.arange(0, OTHERS)
        _, other_key = _rank_keys(log_probs_ptr, valid_ptr, row, others, S, LOWEST)
        ahead_count += ahead_of(key, slots, other_key, others)  # a slot past S: key -inf, a larger index
    rank = tl.sum(ahead_count, axis=1)
    tl.store(kept_ptr + row + slots, (valid & (rank < limit)).to(tl.int32), mask=slots < S)


@triton.jit(do_not_specialize=["root_tokens_stride", "S", "N", "max_depth"])
def _rerank_kernel(
    tokens_ptr,  # [B, S] int64 candidates' target ids
    own_log_probs_ptr,  # [B, S] float32
    parent_slots_ptr,  # [B, S] int64 (-1: the root)
    depths_ptr,  # [B, S] int64
    root_tokens_ptr,  # [B] int64, every root_tokens_stride-th element
    node_of_slot_ptr,  # [B, S] int32: in, 1 at a kept slot (``_kept_kernel``); out, kept slots up to and including it
    out_tokens_ptr,  # [B, N] int64 out
    out_parents_ptr,  # [B, N] int64 out
    out_draft_probs_ptr,  # [B, N] float32 out
    out_depths_ptr,  # [B, N] int64 out
    mask_ptr,  # [B, N, N] uint8 (bool) out
    num_nodes_ptr,  # [B] int64 out
    host_rows_ptr,  # [B, 3 * N + 1] float64 out: tokens | parents | draft_probs | num_nodes
    root_tokens_stride,
    S,  # candidate slots
    N,  # nodes per tree
    max_depth,  # parent steps of the mask's walk
    BLOCK: tl.constexpr,  # slots per step
    NODE_BLOCK: tl.constexpr,  # nodes per step, at least N: a mask row
    ROW_BLOCK: tl.constexpr,  # mask rows per step
):
    b = tl.program_id(0)
    row = b * S

    # 1. the running count of kept slots
    kept_count = tl.zeros([], dtype=tl.int32)
    for start in range(0, S, BLOCK):
        slots = start + tl.arange(0, BLOCK)
        kept = tl.load(node_of_slot_ptr + row + slots, mask=slots < S, other=0)
        tl.store(node_of_slot_ptr + row + slots, kept_count + tl.cumsum(kept, 0), mask=slots < S)
        kept_count += tl.sum(kept, 0)
    num_nodes = kept_count + 1
    tl.store(num_nodes_ptr + b, num_nodes.to(tl.int64))
    host_row = b * (3 * N + 1)
    tl.store(host_rows_ptr + host_row + 3 * N, num_nodes.to(tl.float64))
    tl.debug_barrier()  # pass 3 reads counts other threads stored

    # 2. the root and the padding
    node_row = b * N
    root_token = tl.load(root_tokens_ptr + b * root_tokens_stride)
    for start in range(0, N, NODE_BLOCK):
        nodes = start + tl.arange(0, NODE_BLOCK)
        is_root = nodes == 0
        _store_nodes(
            out_tokens_ptr, out_parents_ptr, out_draft_probs_ptr, out_depths_ptr, host_rows_ptr, node_row, host_row, N,
            nodes, tl.where(is_root, root_token, 0), tl.full([NODE_BLOCK], -1, tl.int64),
            tl.where(is_root, 1.0, 0.0).to(tl.float32), tl.zeros([NODE_BLOCK], dtype=tl.int64),
            (nodes < N) & (is_root | (nodes >= num_nodes)),
        )  # fmt: skip

    # 3. the kept candidates, at their nodes
    for start in range(0, S, BLOCK):
        slots = start + tl.arange(0, BLOCK)
        inside = slots < S
        node = tl.load(node_of_slot_ptr + row + slots, mask=inside, other=0)
        before = tl.load(node_of_slot_ptr + row + slots - 1, mask=inside & (slots > 0), other=0)
        kept = inside & (node != before) & (node < N)  # the count steps up at a kept slot
        parent_slot = tl.load(parent_slots_ptr + row + slots, mask=inside, other=-1)
        has_parent = kept & (parent_slot >= 0) & (parent_slot < S)
        parent = tl.load(node_of_slot_ptr + row + parent_slot, mask=has_parent, other=0)  # the root's children: 0
        own = tl.load(own_log_probs_ptr + row + slots, mask=kept, other=0.0)
        _store_nodes(
            out_tokens_ptr, out_parents_ptr, out_draft_probs_ptr, out_depths_ptr, host_rows_ptr, node_row, host_row, N,
            node, tl.load(tokens_ptr + row + slots, mask=kept, other=0), parent.to(tl.int64),
            tl.exp(own.to(tl.float64)).to(tl.float32), tl.load(depths_ptr + row + slots, mask=kept, other=0), kept,
        )  # fmt: skip
    tl.debug_barrier()  # pass 4 walks parents other threads stored

    # 4. the ancestor mask
    cols = tl.arange(0, NODE_BLOCK)
    for start in range(0, N, ROW_BLOCK):
        rows = start + tl.arange(0, ROW_BLOCK)
        inside = rows < N
        node = rows.to(tl.int64)
        seen = node[:, None] == cols[None, :]
        for _ in range(max_depth):
            parent = tl.load(out_parents_ptr + node_row + node, mask=inside & (node < N), other=-1)
            node = tl.where(parent < 0, node, parent)
            seen = seen | (node[:, None] == cols[None, :])
        out = mask_ptr + b * N * N + rows[:, None] * N + cols[None, :]
        tl.store(out, seen.to(tl.uint8), mask=inside[:, None] & (cols[None, :] < N))


def launch_blocks(slots: int, nodes: int) -> tuple[int, int, int]:
    """(BLOCK, NODE_BLOCK, ROW_BLOCK) of the launch for ``slots`` candidates and trees of ``nodes``."""
    node_block = max(16, triton.next_power_of_2(nodes))
    return min(SLOT_BLOCK, max(16, triton.next_power_of_2(slots))), node_block, min(node_block, MASK_BLOCK // node_block)


def rerank_triton(
    tokens: torch.Tensor,  # [B, slots] int64 target ids
    log_probs: torch.Tensor,  # [B, slots] float64 cumulative
    own_log_probs: torch.Tensor,  # [B, slots] float32
    valid: torch.Tensor,  # [B, slots] bool
    parent_slots: torch.Tensor,  # [B, slots] int64 (-1: the root)
    depths: torch.Tensor,  # [B, slots] int64
    root_tokens: torch.Tensor,  # [B] int64, any stride (a column of the proposal's facts)
    total_tokens: torch.Tensor,  # [B] int64, any stride: nodes to keep, root included (at most ``nodes``)
    nodes: int,  # tree nodes out per session, root included
    max_depth: int,  # the deepest candidate's depth
) -> tuple[torch.Tensor, ...]:
    """``diffspec_kernels.tree_rerank_ref.rerank_reference`` in two launches: the same seven tensors, bit for bit. More
    than MAX_SLOTS slots or MAX_NODES nodes take the reference."""
    batch, slots = tokens.shape
    if slots > MAX_SLOTS or nodes > MAX_NODES:
        return rerank_reference(
            tokens, log_probs, own_log_probs, valid, parent_slots, depths, root_tokens, total_tokens, nodes, max_depth
        )
    per_slot = {"tokens": (tokens, torch.int64), "log_probs": (log_probs, torch.float64),
                "own_log_probs": (own_log_probs, torch.float32), "valid": (valid, torch.bool),
                "parent_slots": (parent_slots, torch.int64), "depths": (depths, torch.int64)}  # fmt: skip
    per_session = {"root_tokens": root_tokens, "total_tokens": total_tokens}
    for name, (tensor, dtype) in per_slot.items():
        if tensor.shape != (batch, slots) or tensor.dtype != dtype:
            raise ValueError(f"{name} must be {dtype} [{batch}, {slots}], got {tensor.dtype} {tuple(tensor.shape)}")
    for name, tensor in per_session.items():
        if tensor.shape != (batch,) or tensor.dtype != torch.int64:
            raise ValueError(f"{name} must be int64 [{batch}], got {tensor.dtype} {tuple(tensor.shape)}")
    if nodes < 1 or max_depth < 0:
        raise ValueError(f"a tree of {nodes} nodes (the root at least) and depth {max_depth}")
    device = tokens.device
    out_tokens = torch.empty(batch, nodes, dtype=torch.int64, device=device)
    parents = torch.empty_like(out_tokens)
    draft_probs = torch.empty(batch, nodes, dtype=torch.float32, device=device)
    out_depths = torch.empty_like(out_tokens)
    mask = torch.empty(batch, nodes, nodes, dtype=torch.uint8, device=device)
    num_nodes = torch.empty(batch, dtype=torch.int64, device=device)
    host_rows = torch.empty(batch, 3 * nodes + 1, dtype=torch.float64, device=device)
    if batch:
        block, node_block, row_block = launch_blocks(slots, nodes)
        log_probs, valid = log_probs.contiguous(), valid.contiguous().view(torch.uint8)
        node_of_slot = torch.empty(batch, slots, dtype=torch.int32, device=device)
        if slots:
            _kept_kernel[(batch, triton.cdiv(slots, RANK_BLOCK))](
                log_probs, valid, total_tokens, node_of_slot, total_tokens.stride(0), slots,
                RANK_BLOCK=RANK_BLOCK, OTHERS=OTHERS, LOWEST=LOWEST,
            )  # fmt: skip
        _rerank_kernel[(batch,)](
            tokens.contiguous(), own_log_probs.contiguous(), parent_slots.contiguous(), depths.contiguous(),
            root_tokens, node_of_slot, out_tokens, parents, draft_probs, out_depths, mask, num_nodes, host_rows,
            root_tokens.stride(0), slots, nodes, max_depth, BLOCK=block, NODE_BLOCK=node_block, ROW_BLOCK=row_block,
        )  # fmt: skip
    return out_tokens, parents, draft_probs, out_depths, mask.view(torch.bool), num_nodes, host_rows
