"""Tree masks and positions derive from parents alone; the list form and the tensor form agree."""

from __future__ import annotations

import pytest
import torch

from diffspec.errors import InvalidRequest
from diffspec.tree import DraftTree
from diffspec.tree_nodes import TreeNodes
from diffspec.v1 import tensor_pb2


def test_mask_depths_and_paths():
    tree = DraftTree(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, 0, 0, 1, 3]), torch.ones(5))
    assert tree.depths().tolist() == [0, 1, 1, 2, 3]
    assert tree.ancestor_mask().int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 1, 1],
    ]
    assert tree.path_to(4) == [0, 1, 3, 4] and tree.children() == [[1, 2], [3], [], [4], []]
    assert tree.token_list() == [5, 6, 7, 8, 9]
    assert tree.children() is tree.children() and tree.token_list() is tree.token_list()  # computed once per tree


@pytest.mark.parametrize(
    "parents", [[0, 0], [-1, 1], [-1, 0, 3, 1], [-1, -1]], ids=["root-has-parent", "self", "forward", "two-roots"]
)
def test_malformed_parents_are_rejected(parents):
    n = len(parents)
    with pytest.raises(ValueError):
        DraftTree(torch.arange(n), torch.tensor(parents), torch.ones(n))
    unchecked = DraftTree(torch.arange(n), torch.tensor(parents), torch.ones(n), check=False)  # the drafter's own
    assert unchecked.parents.tolist() == parents


# (tokens, parents): trees as plain lists, their depth, and the same tree as tensors
NODE_TREES = [
    ([7], [-1]),
    ([5, 6, 7, 8], [-1, 0, 0, 1]),
    ([1, 2, 3, 4, 5], [-1, 0, 1, 2, 3]),
    ([9, 1, 1, 1, 2, 2], [-1, 0, 0, 0, 3, 4]),
]


@pytest.mark.parametrize("tokens, parents", NODE_TREES)
def test_tree_nodes_and_draft_tree_agree(tokens, parents):
    probs = [1.0] + [0.5] * (len(tokens) - 1)
    nodes = TreeNodes(tokens, parents, probs)
    tree = DraftTree.of(nodes)
    assert tree.tokens.tolist() == tokens and tree.parents.tolist() == parents
    assert (nodes.num_nodes, nodes.max_depth) == (tree.num_nodes, tree.max_depth) == (len(tokens), max(tree.depths().tolist()))
    assert tree.to_nodes() == nodes and DraftTree.of(tree) is tree
    assert TreeNodes.from_proto(nodes.to_proto()) == nodes


@pytest.mark.parametrize(
    "message",
    [
        tensor_pb2.DraftTree(),
        tensor_pb2.DraftTree(tokens=[1, 2], parents=[-1, 1], draft_probs=[1, 1]),
        tensor_pb2.DraftTree(tokens=[1, 2], parents=[-1], draft_probs=[1, 1]),
        tensor_pb2.DraftTree(tokens=[1, 2], parents=[0, 0], draft_probs=[1, 1]),
    ],
)
def test_malformed_trees_from_the_wire_are_invalid_requests(message):
    with pytest.raises(InvalidRequest, match="malformed draft tree"):
        TreeNodes.from_proto(message)


def test_a_root_only_tree_is_one_auto_step():
    root = TreeNodes.root_only(42)
    assert (root.num_nodes, root.max_depth, root.tokens) == (1, 0, [42])
    assert DraftTree.of(root).tokens.tolist() == DraftTree.root_only(42).tokens.tolist()


def test_sibling_ranks_follow_a_path_and_stop_where_the_tree_lacks_its_token():
    # root 0 -> children 1 (token 5), 2 (token 6); node 2 -> children 3 (token 7), 4 (token 8)
    tree = DraftTree(torch.tensor([9, 5, 6, 7, 8]), torch.tensor([-1, 0, 0, 2, 2]), torch.ones(5))
    assert tree.sibling_ranks([6, 8]) == ([1, 1], 4)
    assert tree.sibling_ranks([5]) == ([0], 1)
    assert tree.sibling_ranks([6, 3, 8]) == ([1], 2)  # 3 is no child of node 2: the path stops there
    assert tree.sibling_ranks([]) == ([], 0)
