"""A proposal's last step in PyTorch: its candidates reranked into the final padded trees, with their ancestor masks.

The CPU path and the oracle for ``diffspec_kernels.tree_rerank_triton``. Terms as in ``draft_service.tree_search``:
each session keeps its root and its best ``total_tokens - 1`` valid candidate slots by cumulative
log-prob (ties to the earlier slot), listed in slot order behind the root; what is left of ``nodes``
is padding (token 0, parent -1, draft prob 0, depth 0, seeing only itself in the mask).
"""

from __future__ import annotations

import torch

LOWEST = torch.finfo(torch.float64).min  # a valid candidate's rank key is at least this; padding's is -inf


def rerank_reference(
    tokens: torch.Tensor,  # [B, slots] int64 target ids
    log_probs: torch.Tensor,  # [B, slots] float64 cumulative
    own_log_probs: torch.Tensor,  # [B, slots] float32: a child's log-prob given its parent
    valid: torch.Tensor,  # [B, slots] bool
    parent_slots: torch.Tensor,  # [B, slots] int64 (-1: the root)
    depths: torch.Tensor,  # [B, slots] int64
    root_tokens: torch.Tensor,  # [B] int64
    total_tokens: torch.Tensor,  # [B] int64: nodes to keep, root included (at most ``nodes``)
    nodes: int,  # tree nodes out per session, root included
    max_depth: int,  # the deepest candidate's depth
) -> tuple[torch.Tensor, ...]:
    """-> the fields of ``draft_service.tree_search.TreeTensors`` in its order: tokens [B, nodes] int64, parents
    [B, nodes] int64, draft_probs [B, nodes] float32, depths [B, nodes] int64, ancestor_mask [B, nodes, nodes]
    bool, num_nodes [B] int64, host_rows [B, 3 * nodes + 1] float64."""
    batch, slots = tokens.shape
    order = ranked(log_probs, valid)  # [B, slots]
    positions = torch.arange(slots, device=order.device).expand(batch, slots)
    rank = torch.empty_like(order).scatter_(1, order, positions)  # [B, slots]: each slot's place in the ranking
    kept = valid & (rank < (total_tokens - 1)[:, None])
    index = kept.long().cumsum(1)  # [B, slots]: a kept slot's node index (the root is node 0)
    dest = torch.where(kept, index, nodes)  # what is not kept lands in a column cut off below
    parent_index = index.gather(1, parent_slots.clamp(min=0))
    parent_index = torch.where(parent_slots < 0, 0, parent_index)
    out_tokens = _place(root_tokens, tokens, dest, nodes, 0)
    parents = _place(torch.full_like(root_tokens, -1), parent_index, dest, nodes, -1)
    probs = own_log_probs.double().exp().float()
    draft_probs = _place(torch.ones_like(probs[:, 0]), probs, dest, nodes, 0.0)
    out_depths = _place(torch.zeros_like(root_tokens), depths, dest, nodes, 0)
    num_nodes = 1 + kept.sum(1)
    host_rows = torch.cat([out_tokens.double(), parents.double(), draft_probs.double(), num_nodes[:, None].double()], 1)
    mask = ancestor_mask(parents, max_depth)
    return out_tokens, parents, draft_probs, out_depths, mask, num_nodes, host_rows


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """parents [B, nodes] int64 (-1: none) of trees at most ``max_depth`` deep -> [B, nodes, nodes] bool,
    mask[b, i, j] = node j is node i or one of its ancestors; one gather per level."""
    batch, nodes = parents.shape
    mask = torch.eye(nodes, dtype=torch.bool, device=parents.device).expand(batch, nodes, nodes).clone()
    node = torch.arange(nodes, device=parents.device).expand(batch, nodes)
    for _ in range(max_depth):
        parent = parents.gather(1, node)
        node = torch.where(parent < 0, node, parent)
        mask.scatter_(2, node[..., None], True)
    return mask


def ranked(log_probs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, slots] slot positions, valid ones first, by cumulative log-prob descending, ties in slot order."""
    key = torch.where(valid, log_probs.clamp(min=LOWEST), float("-inf"))
    return key.sort(dim=1, descending=True, stable=True).indices


def _place(
    root: torch.Tensor, values: torch.Tensor, dest: torch.Tensor, nodes: int, padding: float
) -> torch.Tensor:
    """[B, nodes]: ``root`` [B] at node 0, ``values`` [B, slots] at ``dest`` (column ``nodes`` is dropped)."""
    out = torch.full((values.shape[0], nodes + 1), padding, dtype=values.dtype, device=values.device)
    out.scatter_(1, dest, values)
    out[:, 0] = root
    return out[:, :nodes]
