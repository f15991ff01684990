"""A session's accepted path, computed on the device from the verify's outputs without reading them back.

Why: the host reads a verify's results once per step, and a draft in the same process then commits the
accepted entries, a few dozen launches of host time during which the GPU would idle. Computed here
instead, behind the forward, the draft queues that commit while the forward still runs, and the host's
read of the results waits for the forward only.

The rules are ``diffspec.acceptance``'s, in tensors. Greedy: a node matches when its token is the target's
argmax at its parent, and the bonus is the argmax at the path's end. Sampled: a node matches when the step's
outcomes have its parent take it, and the bonus is the sample at the path's end; the host walks the
same outcomes. Either way the accepted path ends at the
deepest node whose ancestors all match (matching siblings are never both kept, so they form one path from
the root). The host's acceptance, computed afterwards from the same values, is what the results carry; a
draft that committed from this one checks that they agree.
"""

from __future__ import annotations

import torch

from diffspec.acceptance import SamplingOutcomes
from diffspec.device_accept import DeviceAccept
from diffspec.tree import DeviceTree
from target_service.llama import PagedForwardOutput


def greedy_device_accept(
    tree: DeviceTree,
    nodes: int,
    max_depth: int,
    argmax: torch.Tensor,
    first_row: int,
    forward: PagedForwardOutput,
    layers: tuple[int, ...],
) -> DeviceAccept:
    """tree: the device copy of a tree whose first ``nodes`` nodes the forward verified, from row ``first_row``
    of ``argmax`` [rows] int64; ``max_depth``: its depth bound. Nothing is read back to the host."""
    index = torch.arange(nodes, device=tree.tokens.device)
    choices = argmax[first_row : first_row + nodes]  # [nodes]: the target's token after each node
    matches = (tree.tokens[:nodes] == choices[tree.parents[:nodes].clamp(min=0)]) | (index == 0)
    leaf = _path_end(tree, nodes, matches)
    return _entries(tree, nodes, max_depth, leaf, choices[leaf], first_row, forward, layers)


def sampled_device_accept(
    tree: DeviceTree,
    max_depth: int,
    outcomes: SamplingOutcomes,
    first_row: int,
    forward: PagedForwardOutput,
    layers: tuple[int, ...],
) -> DeviceAccept:
    """As ``greedy_device_accept``, from the step's ``outcomes``, which cover the tree's first nodes: the rows the
    forward computed for it."""
    nodes = outcomes.accepted.numel()
    index = torch.arange(nodes, device=tree.tokens.device)
    leaf = _path_end(tree, nodes, outcomes.accepted | (index == 0))
    # a row that is no distribution has bonus -1: the host fails the session, and the entry stays a valid token
    bonus = outcomes.bonus[leaf].clamp(min=0)
    return _entries(tree, nodes, max_depth, leaf, bonus, first_row, forward, layers)


def _path_end(tree: DeviceTree, nodes: int, matches: torch.Tensor) -> torch.Tensor:
    """[1] int64: the deepest real node whose ancestors (and itself) all match."""
    index = torch.arange(nodes, device=matches.device)
    real = index < tree.num_nodes
    ancestors = tree.ancestor_mask[:nodes, :nodes]  # [nodes, nodes]: j is i or an ancestor of i
    on_matching_path = ~(ancestors & ~(matches & real)[None, :]).any(dim=1) & real
    # one element, not a 0-dim tensor: indexing with a 0-dim tensor reads it back to the host (``item``), which
    # would wait for the forward this runs behind
    return torch.where(on_matching_path, tree.depths[:nodes], -1).argmax(dim=0, keepdim=True)


def _entries(
    tree: DeviceTree,
    nodes: int,
    max_depth: int,
    leaf: torch.Tensor,
    bonus: torch.Tensor,
    first_row: int,
    forward: PagedForwardOutput,
    layers: tuple[int, ...],
) -> DeviceAccept:
    """The path from the root to ``leaf`` as entries: each node's features and the token emitted after it (the
    next node's, then ``bonus`` [1]), padded to ``max_depth`` + 1 rows by repeating the last."""
    device = leaf.device
    index = torch.arange(nodes, device=device)
    depths = tree.depths[:nodes]
    num_entries = (depths[leaf] + 1).squeeze(0)
    max_entries = max_depth + 1
    # the path's node at each depth: scatter its nodes by depth (the others into a spare last slot)
    slots = torch.where(tree.ancestor_mask[:nodes, :nodes][leaf].squeeze(0), depths, max_entries)
    by_depth = torch.zeros(max_entries + 1, dtype=torch.int64, device=device).scatter_(0, slots, index)
    entry = torch.arange(max_entries, device=device)
    path = torch.where(entry < num_entries, by_depth[:max_entries], leaf)  # [max_entries], padded with the leaf
    following = by_depth[(entry + 1).clamp(max=max_entries - 1)]
    next_tokens = torch.where(entry + 1 < num_entries, tree.tokens[:nodes][following], bonus)
    features = forward.features_of(first_row + path, layers)
    return DeviceAccept(features, next_tokens, num_entries, max_entries)
