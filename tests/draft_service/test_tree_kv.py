"""A batch of trees' entries laid out depth by depth: each depth's rows see exactly their ancestors and themselves."""

from __future__ import annotations

import torch

from diffspec.tree import DraftTree
from draft_service.tree_kv import TreeKV


def test_rows_see_their_ancestor_paths_depth_by_depth():
    trees = [DraftTree.random(n, torch.Generator().manual_seed(seed)) for seed, n in enumerate((30, 12))]
    depths = [t.depths().tolist() for t in trees]
    max_depth = max(max(d) for d in depths)
    per_depth = [[[n for n in range(t.num_nodes) if d[n] == depth] for t, d in zip(trees, depths)]
                 for depth in range(1, max_depth + 1)]  # fmt: skip
    depth_rows = [max(len(nodes) for nodes in nodes_at) + 1 for nodes_at in per_depth]  # + 1: a padded row per depth
    kv = TreeKV(2, depth_rows, num_kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"),
                num_layers=2)  # fmt: skip
    entry_of = [{}, {}]  # node -> entry, per tree
    row_of = [{0: 0}, {0: 0}]  # node -> its row at its depth
    for depth, nodes_at in enumerate(per_depth, start=1):
        rows = depth_rows[depth - 1]
        parent_rows = torch.zeros(2, rows, dtype=torch.int64)
        for b, nodes in enumerate(nodes_at):
            for row, n in enumerate(nodes):
                parent_rows[b, row] = row_of[b][int(trees[b].parents[n])]
                row_of[b][n], entry_of[b][n] = row, kv.starts[depth - 1] + row
        k = torch.randn(2, 2, rows, 2, 4)  # [layers, B, rows, kv, hd]
        for layer in range(2):
            keys, values = kv.entries(depth, layer)
            keys.copy_(k[layer])
            values.copy_(-k[layer])
        sees = kv.link(depth, parent_rows)
        for layer in range(2):
            assert torch.equal(kv.layer(layer)[0][:, kv.starts[depth - 1] : kv.starts[depth]], k[layer])
        for b, nodes in enumerate(nodes_at):
            want = trees[b].ancestor_mask()
            for row, n in enumerate(nodes):
                seen = set(sees[b, row].nonzero().flatten().tolist())
                ancestors = {entry_of[b][m] for m in range(1, trees[b].num_nodes) if want[n, m]}
                assert seen == ancestors  # the root has no entry
    assert torch.equal(kv.values, -kv.keys)


def test_a_rewritten_depth_forgets_the_last_tree():
    kv = TreeKV(1, [2, 2], num_kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"))
    kv.link(1, torch.zeros(1, 2, dtype=torch.int64))
    no, yes = False, True
    # depth 2's rows (entries 2, 3) under parent row 1 (entry 1), then both under parent row 0 (entry 0)
    assert kv.link(2, torch.tensor([[1, 1]]))[0].tolist() == [[no, yes, yes, no], [no, yes, no, yes]]
    assert kv.link(2, torch.tensor([[0, 0]]))[0].tolist() == [[yes, no, yes, no], [yes, no, no, yes]]
