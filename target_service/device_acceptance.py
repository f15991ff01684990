"""A greedy session's accepted path, computed on the device from the verify's argmax without reading it back.

Why: the host reads a verify's results once per step, and a draft in the same process then commits the
accepted entries, a few dozen launches of host time during which the GPU would idle. Computed here
instead, behind the forward, the draft queues that commit while the forward still runs, and the host's
read of the results waits for the forward only.

The rule is ``diffspec.acceptance.accept_greedy``'s, in tensors: a node matches when its token is the
target's argmax at its parent; the accepted path ends at the deepest node whose ancestors all match (in a
drafter's tree siblings differ, so the matching nodes form one path from the root). The bonus is the
argmax at that node. The host's acceptance, computed afterwards from the same argmax, is what the
results carry; a draft that committed from this one checks that they agree.
"""

from __future__ import annotations

import torch

from diffspec.tree import DeviceTree
from diffspec.device_accept import DeviceAccept
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
    device = tree.tokens.device
    index = torch.arange(nodes, device=device)
    tokens, parents, depths = tree.tokens[:nodes], tree.parents[:nodes], tree.depths[:nodes]
    choices = argmax[first_row : first_row + nodes]  # [nodes]: the target's token after each node
    real = index < tree.num_nodes
    matches = ((tokens == choices[parents.clamp(min=0)]) | (index == 0)) & real
    ancestors = tree.ancestor_mask[:nodes, :nodes]  # [nodes, nodes]: j is i or an ancestor of i
    on_matching_path = ~(ancestors & ~matches[None, :]).any(dim=1) & real
    # [1] the deepest: the accepted path's end. One element, not a 0-dim tensor: indexing with a 0-dim tensor
    # reads it back to the host (``item``), which would wait for the forward this runs behind
    leaf = torch.where(on_matching_path, depths, -1).argmax(dim=0, keepdim=True)
    num_entries = (depths[leaf] + 1).squeeze(0)
    max_entries = max_depth + 1
    # the path's node at each depth: scatter its nodes by depth (the others into a spare last slot)
    slots = torch.where(ancestors[leaf].squeeze(0), depths, max_entries)
    by_depth = torch.zeros(max_entries + 1, dtype=torch.int64, device=device).scatter_(0, slots, index)
    entry = torch.arange(max_entries, device=device)
    path = torch.where(entry < num_entries, by_depth[:max_entries], leaf)  # [max_entries], padded with the leaf
    following = by_depth[(entry + 1).clamp(max=max_entries - 1)]
    next_tokens = torch.where(entry + 1 < num_entries, tokens[following], choices[leaf])
    features = forward.features_of(first_row + path, layers)
    return DeviceAccept(features, next_tokens, num_entries, max_entries)
