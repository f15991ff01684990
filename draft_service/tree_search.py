"""The search half of a proposal as tensor ops over a padded batch: no decision on the host.

Terms. Depth d expands a *frontier* of ``rows`` slots per session into ``k`` children each: a
*slab* of rows * k *candidate slots*, frontier-row major, so slot order is the order in which a
host loop creates the nodes. A candidate is *valid* when its frontier row is, its child rank is
below the session's ``children`` at d, and its cumulative draft log-prob clears the session's
threshold; an invalid slot is padding and never becomes a node. The next frontier is a
session's best ``expand`` valid candidates of the slab by cumulative log-prob, ties to the
earlier slot (a stable sort); the final tree keeps the best ``total_tokens - 1`` valid
candidates of all depths the same way and lists them in slot order behind the root. A child's
cumulative log-prob never exceeds its parent's and its slot comes later, so a kept node's
parent is always kept. Cumulative log-probs are float64 sums of the head's float32 log-probs,
as a host loop over Python floats adds them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffspec_kernels.dispatch import triton_kernels_on
from diffspec_kernels.tree_rerank_ref import ranked, rerank_reference


@dataclass
class Frontier:
    """The nodes one depth runs the head on, ``rows`` per session (depth 0: the root)."""

    tokens: torch.Tensor  # [B, rows] int64 target ids
    parent_rows: torch.Tensor  # [B, rows] int64: the parent's row in the previous depth's head outputs
    log_probs: torch.Tensor  # [B, rows] float64 cumulative draft log-prob from the root
    valid: torch.Tensor  # [B, rows] bool
    slots: torch.Tensor  # [B, rows] int64: the node's candidate slot (-1: the root)


@dataclass
class Candidates:
    """Children proposed at one or more depths, one slot each, in slot order."""

    tokens: torch.Tensor  # [B, slots] int64 target ids
    log_probs: torch.Tensor  # [B, slots] float64 cumulative
    own_log_probs: torch.Tensor  # [B, slots] float32: the child's log-prob given its parent
    valid: torch.Tensor  # [B, slots] bool
    parent_slots: torch.Tensor  # [B, slots] int64 (-1: the root)
    depths: torch.Tensor  # [B, slots] int64: 1 for the root's children

    @staticmethod
    def cat(slabs: list[Candidates]) -> Candidates:
        fields = zip(*[(s.tokens, s.log_probs, s.own_log_probs, s.valid, s.parent_slots, s.depths) for s in slabs])
        return Candidates(*[torch.cat(list(f), dim=1) for f in fields])


@dataclass
class TreeTensors:
    """A batch of finished trees, padded to ``nodes`` (see ``diffspec.tree.DeviceTree``)."""

    tokens: torch.Tensor  # [B, nodes] int64
    parents: torch.Tensor  # [B, nodes] int64, -1 for the root and padding
    draft_probs: torch.Tensor  # [B, nodes] float32, 0 for padding
    depths: torch.Tensor  # [B, nodes] int64
    ancestor_mask: torch.Tensor  # [B, nodes, nodes] bool
    num_nodes: torch.Tensor  # [B] int64
    host_rows: torch.Tensor  # [B, 3 * nodes + 1] float64: tokens | parents | draft_probs | num_nodes, one copy out


def root_frontier(root_tokens: torch.Tensor, grows: torch.Tensor) -> Frontier:
    """Depth 0's frontier: the root, one row per session; ``grows`` [B] bool: the session's plan has a depth."""
    zeros = torch.zeros_like(root_tokens)[:, None]  # [B, 1]
    return Frontier(root_tokens[:, None], zeros, zeros.double(), grows[:, None], zeros - 1)


def expand(
    frontier: Frontier,
    top_log_probs: torch.Tensor,  # [B, rows, k] float32, each row's best children first
    top_tokens: torch.Tensor,  # [B, rows, k] int64 target ids
    children: torch.Tensor,  # [B] int64: children per expanded node this depth
    min_log_prob: torch.Tensor,  # [B] float64: log of the threshold (-inf: none)
    depth: int,  # 0-based depth of the frontier
) -> Candidates:
    """The frontier's children as one slab of rows * k slots."""
    batch, rows, k = top_log_probs.shape
    cumulative = frontier.log_probs[..., None] + top_log_probs.double()  # [B, rows, k]
    rank = torch.arange(k, device=children.device)
    valid = frontier.valid[..., None] & (rank < children[:, None, None]) & (cumulative >= min_log_prob[:, None, None])
    return Candidates(
        tokens=top_tokens.flatten(1),
        log_probs=cumulative.flatten(1),
        own_log_probs=top_log_probs.flatten(1),
        valid=valid.flatten(1),
        parent_slots=frontier.slots[..., None].expand(batch, rows, k).flatten(1),
        depths=torch.full((batch, rows * k), depth + 1, dtype=torch.int64, device=children.device),
    )


def best_frontier(slab: Candidates, rows: int, k: int, expand_rows: torch.Tensor, first_slot: int) -> Frontier:
    """The next depth's ``rows`` frontier slots: each session's best candidates of ``slab`` (made with ``k``
    children per row, its slots starting at ``first_slot``), valid up to ``expand_rows`` [B] int64 of them."""
    order = ranked(slab.log_probs, slab.valid)[:, :rows]  # [B, rows] positions in the slab
    row = torch.arange(rows, device=order.device)
    return Frontier(
        tokens=slab.tokens.gather(1, order),
        parent_rows=order // k,
        log_probs=slab.log_probs.gather(1, order),
        valid=slab.valid.gather(1, order) & (row < expand_rows[:, None]),
        slots=order + first_slot,
    )


def top_children(
    logits: torch.Tensor,  # [B, rows, vocab] the head's draft-vocab logits, in its dtype
    k: int,
    target_ids: torch.Tensor,  # [vocab] int64: the target id of each draft id
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, rows, k] float32 log-probs, best first; [B, rows, k] int64 target ids
    """Each row's ``k`` best children: one Triton kernel on a GPU (``diffspec_kernels.top_children_triton``), the PyTorch
    reference elsewhere."""
    if not triton_kernels_on(logits.device):
        from diffspec_kernels.top_children_ref import top_children_reference

        return top_children_reference(logits, k, target_ids)
    from diffspec_kernels.top_children_triton import top_children_triton

    return top_children_triton(logits, k, target_ids)


def grow(
    frontier: Frontier,
    top_log_probs: torch.Tensor,  # [B, rows, k] float32, each row's best children first
    top_tokens: torch.Tensor,  # [B, rows, k] int64 target ids
    children: torch.Tensor,  # [B] int64: children per expanded node this depth
    min_log_prob: torch.Tensor,  # [B] float64
    depth: int,  # 0-based depth of the frontier
    next_rows: int,  # the next frontier's rows; 0 at the last depth
    expand_rows: torch.Tensor,  # [B] int64: of those, how many each session expands
    first_slot: int,  # the slab's first candidate slot
) -> tuple[Candidates, Frontier | None]:
    """One depth: ``expand`` then ``best_frontier`` (None at the last depth). On a GPU both are one Triton
    kernel (``diffspec_kernels.tree_frontier_triton``), bit for bit the same; these tensor ops are its reference."""
    if not triton_kernels_on(top_log_probs.device):
        slab = expand(frontier, top_log_probs, top_tokens, children, min_log_prob, depth)
        k = top_log_probs.shape[2]
        return slab, best_frontier(slab, next_rows, k, expand_rows, first_slot) if next_rows else None
    from diffspec_kernels.tree_frontier_triton import frontier_step_triton

    batch, rows, k = top_log_probs.shape
    cumulative, valid, parent_slots, *following = frontier_step_triton(
        frontier.log_probs, frontier.valid, frontier.slots, top_log_probs, top_tokens,
        children, min_log_prob, expand_rows, next_rows, first_slot,
    )  # fmt: skip
    slab = Candidates(
        tokens=top_tokens.flatten(1),
        log_probs=cumulative,
        own_log_probs=top_log_probs.flatten(1),
        valid=valid,
        parent_slots=parent_slots,
        depths=torch.full((batch, rows * k), depth + 1, dtype=torch.int64, device=top_log_probs.device),
    )
    return slab, Frontier(*following) if next_rows else None


def rerank(
    candidates: Candidates, root_tokens: torch.Tensor, total_tokens: torch.Tensor, nodes: int, max_depth: int
) -> TreeTensors:
    """Each session's root plus its best ``total_tokens - 1`` ([B] int64) valid candidates, in slot order, with
    the trees' ancestor masks: two Triton launches on a GPU (``diffspec_kernels.tree_rerank_triton``), its PyTorch
    reference elsewhere (``diffspec_kernels.tree_rerank_ref``), bit for bit the same."""
    fields = (
        candidates.tokens, candidates.log_probs, candidates.own_log_probs, candidates.valid,
        candidates.parent_slots, candidates.depths,
    )  # fmt: skip
    if not triton_kernels_on(candidates.tokens.device):
        return TreeTensors(*rerank_reference(*fields, root_tokens, total_tokens, nodes, max_depth))
    from diffspec_kernels.tree_rerank_triton import rerank_triton

    return TreeTensors(*rerank_triton(*fields, root_tokens, total_tokens, nodes, max_depth))
