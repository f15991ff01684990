"""A tree's accepted path on the device in one launch.

Same function as ``diffspec_kernels.accepted_path_ref.accepted_path_reference``, whose two dozen small
launches cost the host about as much time as the rest of a step's acceptance: this runs while the verify's
forward is on the GPU, but on a fast GPU the host's work per step is what sets its pace. One program holds
the whole tree (a verify's trees have at most a few hundred nodes): each node's match, the deepest node whose
ancestors all match (one row of the ancestor mask each), and the path's nodes by depth.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffspec_kernels.accepted_path_ref import check_accepted_path_inputs


# one compile per (block, rule): the integers and the argmax slice's offset (a step's row) take no part in it
@triton.jit(
    do_not_specialize=["mask_stride", "nodes", "max_entries", "first_row"],
    do_not_specialize_on_alignment=["choices_ptr", "accepted_ptr", "bonus_ptr"],
)
def _accepted_path_kernel(
    tokens_ptr,  # [capacity] int64
    parents_ptr,  # [capacity] int64
    depths_ptr,  # [capacity] int64
    mask_ptr,  # [capacity, capacity] uint8 (a bool mask's bytes), rows of ``mask_stride``
    num_nodes_ptr,  # [] int64
    choices_ptr,  # [nodes] int64 (GREEDY)
    accepted_ptr,  # [nodes] uint8 (not GREEDY: a bool tensor's bytes)
    bonus_ptr,  # [nodes] int64 (not GREEDY)
    out_ptr,  # [2 * max_entries + 1] int64: rows, then next tokens, then the entry count
    mask_stride,
    nodes,
    max_entries,
    first_row,
    GREEDY: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= nodes
    ENTRIES: tl.constexpr,  # a power of two >= max_entries (``entries_block``)
):
    node = tl.arange(0, BLOCK)
    verified = node < nodes
    real = verified & (node < tl.load(num_nodes_ptr))
    tokens = tl.load(tokens_ptr + node, mask=verified, other=0)
    depths = tl.load(depths_ptr + node, mask=verified, other=0)
    if GREEDY:
        parents = tl.maximum(tl.load(parents_ptr + node, mask=verified, other=0), 0)
        matches = tokens == tl.load(choices_ptr + parents, mask=verified, other=-1)
    else:
        matches = tl.load(accepted_ptr + node, mask=verified, other=0) != 0
    good = (matches | (node == 0)) & real
    # row i, column j: node j is node i or one of its ancestors; a node is on the matching path when each is good
    both = verified[:, None] & verified[None, :]
    ancestors = tl.load(mask_ptr + node[:, None] * mask_stride + node[None, :], mask=both, other=0) != 0
    broken = tl.sum((ancestors & (good[None, :] == 0)).to(tl.int32), axis=1)
    on_path = (broken == 0) & real
    leaf_depth = tl.max(tl.where(on_path, depths, -1), axis=0)  # the path is a chain: one node per depth
    leaf = tl.sum(tl.where(on_path & (depths == leaf_depth), node, 0), axis=0)
    num_entries = leaf_depth + 1
    on_leaf_path = tl.load(mask_ptr + leaf * mask_stride + node, mask=verified, other=0) != 0
    entry = tl.arange(0, ENTRIES)
    at_depth = on_leaf_path[None, :] & (depths[None, :] == entry[:, None])  # [ENTRIES, BLOCK]
    path = tl.where(entry < num_entries, tl.sum(tl.where(at_depth, node[None, :], 0), axis=1), leaf)
    at_next_depth = on_leaf_path[None, :] & (depths[None, :] == entry[:, None] + 1)
    next_node_token = tl.sum(tl.where(at_next_depth, tokens[None, :], 0), axis=1)
    if GREEDY:
        after_leaf = tl.load(choices_ptr + leaf)
    else:
        after_leaf = tl.maximum(tl.load(bonus_ptr + leaf), 0)  # no distribution there: a valid token all the same
    next_tokens = tl.where(entry + 1 < num_entries, next_node_token, after_leaf)
    stored = entry < max_entries
    tl.store(out_ptr + entry, first_row + path, mask=stored)
    tl.store(out_ptr + max_entries + entry, next_tokens, mask=stored)
    tl.store(out_ptr + 2 * max_entries, num_entries)


ENTRY_ROWS = 64  # entry rows every launch computes at least: a tree budget's deepest bound (32) and its root, and more


def entries_block(block: int, max_entries: int) -> int:
    """The kernel's entry rows: ``ENTRY_ROWS``, or the node block where it is larger, unless the depth bound asks
    for more still (never, within a draft's budgets). One compile per node block then serves every depth bound,
    and the [entries, block] tile is no larger than the kernel's [block, block] ancestor tile past 64 nodes."""
    return max(block, ENTRY_ROWS, triton.next_power_of_2(max_entries))


def accepted_path_triton(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    ancestor_mask: torch.Tensor,
    num_nodes: torch.Tensor,
    nodes: int,
    max_entries: int,
    first_row: int,
    choices: torch.Tensor | None = None,
    accepted: torch.Tensor | None = None,
    bonus: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``accepted_path_reference``'s (rows, next_tokens, num_entries), as views of one output buffer."""
    check_accepted_path_inputs(tokens, parents, depths, ancestor_mask, nodes, max_entries, choices, accepted, bonus)
    if not ancestor_mask.is_contiguous():
        raise ValueError("the ancestor mask must be contiguous")
    out = torch.empty(2 * max_entries + 1, dtype=torch.int64, device=tokens.device)
    greedy = choices is not None
    unused = tokens  # any pointer for the mode's absent inputs: never read
    block = triton.next_power_of_2(nodes)
    flags = unused if accepted is None else accepted.view(torch.uint8)  # bools as bytes, as every backend loads them
    _accepted_path_kernel[(1,)](
        tokens, parents, depths, ancestor_mask.view(torch.uint8), num_nodes,
        choices if greedy else unused, flags, unused if greedy else bonus,
        out, ancestor_mask.stride(0), nodes, max_entries, first_row,
        GREEDY=greedy, BLOCK=block, ENTRIES=entries_block(block, max_entries), num_warps=8 if block >= 128 else 4,
    )  # fmt: skip
    return out[:max_entries], out[max_entries : 2 * max_entries], out[2 * max_entries]
