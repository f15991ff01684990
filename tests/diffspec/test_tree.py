"""Tree masks and positions derive from parents alone."""

from __future__ import annotations

import pytest
import torch

from diffspec.tree import DraftTree


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


@pytest.mark.parametrize(
    "parents", [[0, 0], [-1, 1], [-1, 0, 3, 1], [-1, -1]], ids=["root-has-parent", "self", "forward", "two-roots"]
)
def test_malformed_parents_are_rejected(parents):
    n = len(parents)
    with pytest.raises(ValueError):
        DraftTree(torch.arange(n), torch.tensor(parents), torch.ones(n))
