"""Trees as a drafter in the same process hands them to the target: pending, with a padded device copy."""

from __future__ import annotations

import torch

from diffspec.tree import DeviceTree, DraftTree, PendingTree


def pending_tree(
    tree: DraftTree,
    capacity: int,
    mask: torch.Tensor | None = None,
    depth_bound: int = 8,
    device: torch.device = torch.device("cpu"),
) -> PendingTree:
    """``tree`` as the drafter hands it out: a device copy padded to ``capacity`` nodes (on ``device``), bounds
    for the target's size checks (``capacity`` nodes: a thresholded tree may keep fewer than its plan allows),
    and the host tree behind ``tree()``."""
    n = tree.num_nodes
    padded_mask = torch.eye(capacity, dtype=torch.bool)
    padded_mask[:n, :n] = tree.ancestor_mask() if mask is None else mask
    pad = capacity - n
    fields = dict(
        tokens=torch.cat([tree.tokens, torch.zeros(pad, dtype=torch.long)]),
        parents=torch.cat([tree.parents, torch.full((pad,), -1)]),
        depths=torch.cat([tree.depths(), torch.zeros(pad, dtype=torch.long)]),
        ancestor_mask=padded_mask,
        num_nodes=torch.tensor(n),
    )
    on_device = DeviceTree(**{name: t.to(device) for name, t in fields.items()})
    return PendingTree(on_device, capacity, max(depth_bound, tree.max_depth), lambda: tree)
