"""A growing tree's entries: each depth's mask rows are exactly its nodes' ancestors and themselves."""

from __future__ import annotations

import torch

from diffspec.tree import DraftTree
from draft_service.tree_kv import TreeKV


def test_masks_are_ancestor_paths_depth_by_depth():
    tree = DraftTree.random(30, torch.Generator().manual_seed(0))
    depths = tree.depths().tolist()
    want = tree.ancestor_mask()  # [node, node]: ancestors and self
    kv = TreeKV(capacity=29, max_depth=max(depths), num_kv_heads=2, head_dim=4, dtype=torch.float32,
                device=torch.device("cpu"))  # fmt: skip
    entry_of = {0: kv.root}  # the root has no entry; depth-1 nodes name the root's path
    order = []  # node of each entry
    for depth in range(1, max(depths) + 1):
        nodes = [n for n in range(tree.num_nodes) if depths[n] == depth]
        parents = torch.tensor([entry_of[int(tree.parents[n])] for n in nodes])
        k = torch.randn(len(nodes), 2, 4)
        mask = kv.append(k, -k, parents, depth)
        for i, n in enumerate(nodes):
            entry_of[n] = len(order) + i
        order += nodes
        for i, n in enumerate(nodes):
            seen = {order[e] for e in mask[i].nonzero().flatten().tolist()}
            assert seen == {m for m in range(1, tree.num_nodes) if want[n, m]}  # root excluded: it has no entry
    keys, values = kv.view()
    assert keys.shape[0] == 29 and torch.equal(values, -keys)
