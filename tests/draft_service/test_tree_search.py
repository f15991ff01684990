"""The tree search's tensor steps on hand-made candidates: frontier choice, rerank, ancestor masks."""

from __future__ import annotations

import math

import torch

from diffspec.tree import DraftTree
from diffspec_kernels.tree_rerank_ref import ancestor_mask
from draft_service.tree_search import Candidates, best_frontier, expand, rerank, root_frontier

NEG = -math.inf


def slab(log_probs: list[list[float]], valid: list[list[bool]], parents: list[list[int]], depth: int) -> Candidates:
    lp = torch.tensor(log_probs, dtype=torch.float64)
    tokens = torch.arange(lp.numel()).view(lp.shape) + 100 * depth
    depths = torch.full(lp.shape, depth)
    return Candidates(tokens, lp, lp.float(), torch.tensor(valid), torch.tensor(parents), depths)


def test_the_frontier_takes_the_best_valid_candidates_ties_to_the_earlier_slot():
    candidates = slab(
        [[-1.0, -0.5, -0.5, -0.1], [-2.0, -3.0, -1.0, -1.0]],
        [[True, True, True, False], [True, False, True, True]],
        [[-1] * 4, [-1] * 4],
        depth=1,
    )
    frontier = best_frontier(candidates, rows=3, k=2, expand_rows=torch.tensor([3, 2]), first_slot=10)
    assert frontier.slots.tolist() == [[11, 12, 10], [12, 13, 10]]  # slot 3 of session 0 is padding
    assert frontier.parent_rows.tolist() == [[0, 1, 0], [1, 1, 0]]  # slab position // k
    assert frontier.valid.tolist() == [[True, True, True], [True, True, False]]  # session 1 expands 2
    assert frontier.tokens.tolist() == [[101, 102, 100], [106, 107, 104]]


def test_children_stop_at_the_plan_width_and_the_threshold():
    frontier = root_frontier(torch.tensor([7, 8]), torch.tensor([True, True]))
    top = torch.log(torch.tensor([[[0.5, 0.3, 0.1]], [[0.6, 0.2, 0.1]]]))
    children = expand(frontier, top, torch.tensor([[[1, 2, 3]], [[4, 5, 6]]]), torch.tensor([3, 2]),
                      torch.tensor([math.log(0.2), NEG], dtype=torch.float64), depth=0)  # fmt: skip
    assert children.valid.tolist() == [[True, True, False], [True, True, False]]
    assert children.parent_slots.tolist() == [[-1] * 3] * 2 and children.depths.tolist() == [[1] * 3] * 2


def test_rerank_keeps_the_best_with_their_parents_in_slot_order():
    # session 0: root children a (-0.1), b (-0.7); a's children c (-0.3), d (-0.9); b's child e (-0.8)
    first = slab([[-0.1, -0.7], [-0.2, -0.3]], [[True, True], [True, False]], [[-1, -1], [-1, -1]], depth=1)
    second = slab(
        [[-0.3, -0.9, -0.8], [-0.25, NEG, NEG]],
        [[True, True, True], [True, False, False]],
        [[0, 0, 1], [0, 0, 0]],
        depth=2,
    )
    out = rerank(Candidates.cat([first, second]), torch.tensor([5, 6]), torch.tensor([4, 8]), nodes=5, max_depth=2)
    # session 0 keeps a, c, b (-0.1, -0.3, -0.7) of 5 candidates; session 1 keeps all 2 valid ones
    assert out.num_nodes.tolist() == [4, 3]
    assert out.tokens.tolist() == [[5, 100, 101, 200, 0], [6, 102, 203, 0, 0]]
    assert out.parents.tolist() == [[-1, 0, 0, 1, -1], [-1, 0, 1, -1, -1]]
    assert out.depths.tolist() == [[0, 1, 1, 2, 0], [0, 1, 2, 0, 0]]
    want_probs = torch.tensor([1.0, math.exp(-0.1), math.exp(-0.7), math.exp(-0.3)])
    torch.testing.assert_close(out.draft_probs[0, :4], want_probs)
    assert out.host_rows[1, -1] == 3 and out.host_rows[0, 5:10].tolist() == [-1, 0, 0, 1, -1]


def test_ancestor_masks_match_the_draft_tree_and_padding_sees_itself():
    trees = [DraftTree.random(n, torch.Generator().manual_seed(n)) for n in (9, 5)]
    parents = torch.full((2, 9), -1)
    for b, tree in enumerate(trees):
        parents[b, : tree.num_nodes] = tree.parents
    mask = ancestor_mask(parents, max_depth=8)
    for b, tree in enumerate(trees):
        n = tree.num_nodes
        assert torch.equal(mask[b, :n, :n], tree.ancestor_mask())
        assert torch.equal(mask[b, n:], torch.eye(9, dtype=torch.bool)[n:])
