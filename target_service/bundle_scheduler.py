"""Bundle scheduling: order a tree so that leaves sharing a branching ancestor sit together.

A *bundle* is the set of leaves whose deepest branching ancestor (the deepest ancestor with two
or more children; the root when there is none) is the same node; its *shared path* runs from
the root to that ancestor. Depth-first preorder makes every subtree, and so every bundle and
its shared path, a contiguous run of rows, which lets an attention kernel read a bundle's
shared prefix once for all its members. Reordering changes no result: each node still sees
exactly its own ancestors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffspec.tree import DraftTree


@dataclass(frozen=True)
class Bundle:
    branch_node: int  # the branching ancestor, as a row of the scheduled tree
    shared_path: list[int]  # rows from the root to branch_node, inclusive
    leaves: list[int]  # rows of the bundle's leaves
    rows: tuple[int, int]  # [start, end): the contiguous rows below branch_node holding the leaves' paths


@dataclass(frozen=True)
class BundleLayout:
    order: list[int]  # order[row] = node index in the original tree
    bundles: list[Bundle]

    def to_original(self, rows: list[int]) -> list[int]:
        return [self.order[r] for r in rows]


def schedule(tree: DraftTree) -> tuple[DraftTree, BundleLayout]:
    """The tree in depth-first preorder, and its bundles."""
    children = tree.children()
    order: list[int] = []
    stack = [0]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(children[node]))
    row_of = {node: row for row, node in enumerate(order)}
    parents = tree.parents.tolist()
    scheduled = DraftTree(
        tokens=tree.tokens[order],
        parents=torch.tensor([row_of[parents[n]] if n else -1 for n in order], dtype=torch.long),
        draft_probs=tree.draft_probs[order],
    )
    return scheduled, BundleLayout(order=order, bundles=_bundles(scheduled))


def _bundles(tree: DraftTree) -> list[Bundle]:
    children = tree.children()
    parents = tree.parents.tolist()
    subtree_end = list(range(1, tree.num_nodes + 1))  # preorder: a subtree is [node, subtree_end)
    for node in range(tree.num_nodes - 1, 0, -1):
        subtree_end[parents[node]] = max(subtree_end[parents[node]], subtree_end[node])
    groups: dict[int, list[int]] = {}
    for leaf in (n for n in range(tree.num_nodes) if not children[n]):
        branch = parents[leaf] if leaf else 0
        while branch > 0 and len(children[branch]) < 2:
            branch = parents[branch]
        groups.setdefault(max(branch, 0), []).append(leaf)
    return [
        Bundle(
            branch_node=branch,
            shared_path=tree.path_to(branch),
            leaves=leaves,
            rows=(branch + 1, subtree_end[branch]) if leaves != [branch] else (branch, branch + 1),
        )
        for branch, leaves in sorted(groups.items())
    ]
