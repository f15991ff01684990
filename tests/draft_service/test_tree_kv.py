"""A batch of trees' entries laid out by layer: each depth's rows see exactly their ancestors and themselves."""

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
    layer_rows = [max(len(nodes) for nodes in layer) + 1 for layer in per_depth]  # + 1: a padded row per layer
    kv = TreeKV(2, layer_rows, num_kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
    entry_of = [{}, {}]  # node -> entry, per tree
    row_of = [{0: 0}, {0: 0}]  # node -> its row at its depth
    for depth, layer in enumerate(per_depth, start=1):
        rows = layer_rows[depth - 1]
        parent_rows = torch.zeros(2, rows, dtype=torch.int64)
        for b, nodes in enumerate(layer):
            for row, n in enumerate(nodes):
                parent_rows[b, row] = row_of[b][int(trees[b].parents[n])]
                row_of[b][n], entry_of[b][n] = row, kv.starts[depth - 1] + row
        k = torch.randn(2, rows, 2, 4)
        keys, values = kv.entries(depth)
        keys.copy_(k)
        values.copy_(-k)
        sees = kv.link(depth, parent_rows)
        assert torch.equal(kv.keys[:, kv.starts[depth - 1] : kv.starts[depth]], k)
        for b, nodes in enumerate(layer):
            want = trees[b].ancestor_mask()
            for row, n in enumerate(nodes):
                seen = set(sees[b, row].nonzero().flatten().tolist())
                ancestors = {entry_of[b][m] for m in range(1, trees[b].num_nodes) if want[n, m]}
                assert seen == ancestors  # the root has no entry
    assert torch.equal(kv.values, -kv.keys)


def test_a_rewritten_layer_forgets_the_last_tree():
    kv = TreeKV(1, [2, 2], num_kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"))
    kv.link(1, torch.zeros(1, 2, dtype=torch.int64))
    no, yes = False, True
    # layer 2's rows (entries 2, 3) under parent row 1 (entry 1), then both under parent row 0 (entry 0)
    assert kv.link(2, torch.tensor([[1, 1]]))[0].tolist() == [[no, yes, yes, no], [no, yes, no, yes]]
    assert kv.link(2, torch.tensor([[0, 0]]))[0].tolist() == [[yes, no, yes, no], [yes, no, no, yes]]
