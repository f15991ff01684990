"""Plain PyTorch accepted path of a tree on the device: the CPU path and the oracle for
``diffspec_kernels.accepted_path_triton``.

A verify's acceptance computed where the forward ran, without reading anything back (``target_service/
device_acceptance.py`` says why). The accepted path ends at the deepest real node whose ancestors and itself
all match (matching siblings are never both kept, so the matching nodes form one path from the root). Greedy:
a node matches when its token is the target's choice after its parent, and the bonus is the choice after the
path's end. Sampled: the step's outcomes say which nodes match and what the bonus at each node is.

The path comes out as entries, padded to ``max_entries`` rows by repeating the last: the forward's row of
each (the root's, then each accepted node's) and the token emitted after it (the next node's, then the bonus).
"""

from __future__ import annotations

import torch


def check_accepted_path_inputs(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    ancestor_mask: torch.Tensor,
    nodes: int,
    max_entries: int,
    choices: torch.Tensor | None,
    accepted: torch.Tensor | None,
    bonus: torch.Tensor | None,
) -> None:
    capacity = tokens.numel()
    if not 1 <= nodes <= capacity or max_entries < 1:
        raise ValueError(f"need 1 <= nodes <= {capacity} tree nodes and max_entries >= 1, got {nodes}, {max_entries}")
    if parents.shape != tokens.shape or depths.shape != tokens.shape or ancestor_mask.shape != (capacity, capacity):
        raise ValueError("parents and depths must be shaped as tokens, and the ancestor mask [capacity, capacity]")
    if (choices is None) == (accepted is None) or (accepted is None) != (bonus is None):
        raise ValueError("give the target's choices (greedy), or the accepted flags and bonus tokens (sampled)")
    for name, given in (("choices", choices), ("accepted", accepted), ("bonus", bonus)):
        if given is not None and given.shape != (nodes,):
            raise ValueError(f"{name} must be [{nodes}], got {list(given.shape)}")


def accepted_path_reference(
    tokens: torch.Tensor,  # [capacity] int64: the tree's tokens, padding after its real nodes
    parents: torch.Tensor,  # [capacity] int64, -1 for the root and padding
    depths: torch.Tensor,  # [capacity] int64
    ancestor_mask: torch.Tensor,  # [capacity, capacity] bool: [i, j] = node j is node i or one of its ancestors
    num_nodes: torch.Tensor,  # [] int64: the real nodes
    nodes: int,  # the nodes the forward verified (the real ones first)
    max_entries: int,  # the depth bound + 1
    first_row: int,  # the forward's row of the root
    choices: torch.Tensor | None = None,  # [nodes] int64 (greedy): the target's token after each node
    accepted: torch.Tensor | None = None,  # [nodes] bool (sampled): the node's parent took it
    bonus: torch.Tensor | None = None,  # [nodes] int64 (sampled): the token sampled after each node, -1 for none
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows [max_entries] int64: the forward's row of each entry; next_tokens [max_entries] int64: the token
    emitted after it; num_entries [] int64: how many rows are real). Nothing is read back to the host."""
    check_accepted_path_inputs(tokens, parents, depths, ancestor_mask, nodes, max_entries, choices, accepted, bonus)
    device = tokens.device
    index = torch.arange(nodes, device=device)
    node_tokens, node_depths, mask = tokens[:nodes], depths[:nodes], ancestor_mask[:nodes, :nodes]
    if choices is not None:
        matches = node_tokens == choices[parents[:nodes].clamp(min=0)]
    else:
        assert accepted is not None
        matches = accepted
    matches = matches | (index == 0)
    real = index < num_nodes
    on_matching_path = ~(mask & ~(matches & real)[None, :]).any(dim=1) & real
    # one element, not a 0-dim tensor: indexing with a 0-dim tensor reads it back to the host (``item``), which
    # would wait for the forward this runs behind
    leaf = torch.where(on_matching_path, node_depths, -1).argmax(dim=0, keepdim=True)
    if choices is not None:
        after_leaf = choices[leaf]
    else:
        assert bonus is not None
        after_leaf = bonus[leaf].clamp(min=0)  # no distribution there: the host fails the session; a valid token
    num_entries = (node_depths[leaf] + 1).squeeze(0)
    # the path's node at each depth: scatter its nodes by depth (the others into a spare last slot)
    slots = torch.where(mask[leaf].squeeze(0), node_depths, max_entries)
    by_depth = torch.zeros(max_entries + 1, dtype=torch.int64, device=device).scatter_(0, slots, index)
    entry = torch.arange(max_entries, device=device)
    path = torch.where(entry < num_entries, by_depth[:max_entries], leaf)  # padded with the leaf
    following = by_depth[(entry + 1).clamp(max=max_entries - 1)]
    next_tokens = torch.where(entry + 1 < num_entries, node_tokens[following], after_leaf)
    return first_row + path, next_tokens, num_entries
