"""The token tree a draft proposes and the target verifies, as tensors (the in-process form).

Node 0 is the root: the last committed token, whose KV the target has not computed yet.
Every other node is a draft token whose parent precedes it (``parents[i] < i``), so a tree
is a topologically ordered list. The tree mask and position offsets derive from parents only.
The same tree as plain lists, for the wire and a gateway without torch, is ``TreeNodes``
(``diffspec/tree_nodes.py``); a drafter's tree still on its way to the host is a ``PendingTree``.
All three are a ``ProposedTree``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import InitVar, dataclass

import torch

from diffspec.tree_nodes import ProposedTree, TreeNodes


@dataclass(frozen=True)
class DeviceTree:
    """The same tree where the draft built it (the GPU when it has one), padded to the proposal's
    node capacity, so a target in the same process can read it without a host round trip.
    Nodes past ``num_nodes`` are padding: token 0, parent -1, depth 0, seeing only themselves."""

    tokens: torch.Tensor  # [capacity] int64
    parents: torch.Tensor  # [capacity] int64, -1 for the root and padding
    depths: torch.Tensor  # [capacity] int64: root 0, child = parent + 1 (target positions = committed + depth)
    ancestor_mask: torch.Tensor  # [capacity, capacity] bool: mask[i, j] = node j is node i or one of its ancestors
    num_nodes: torch.Tensor  # [] int64


class PendingTree:
    """A drafter's tree whose nodes the host has not read yet: a target in the same process verifies it
    from ``on_device`` while the proposal is still on the GPU, and ``tree()`` waits for the host copy, once,
    when the acceptance needs the nodes.

    Until then only bounds are known, from the tree's plan: ``num_nodes`` is the most nodes it can have
    (the rows a verify computes; the real nodes come first in ``on_device``, padding after them) and
    ``max_depth`` the deepest a node can be."""

    def __init__(
        self, on_device: DeviceTree, node_bound: int, depth_bound: int, host_tree: Callable[[], DraftTree]
    ) -> None:
        self.on_device = on_device
        self.node_bound = node_bound
        self.depth_bound = depth_bound
        self._host_tree = host_tree

    @property
    def num_nodes(self) -> int:
        return self.node_bound

    @property
    def max_depth(self) -> int:
        return self.depth_bound

    def device_copy(self, device: torch.device) -> DeviceTree | None:
        """The tree's tensors when they already are on ``device`` (a verify there reads them in place), else None."""
        return self.on_device if self.on_device.tokens.device == device else None

    def to_nodes(self) -> TreeNodes:
        return self.tree().to_nodes()

    def tree(self) -> DraftTree:
        return self._tree

    @functools.cached_property
    def _tree(self) -> DraftTree:
        return self._host_tree()


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor  # [num_nodes] int64, target-vocab ids; tokens[0] is the root
    parents: torch.Tensor  # [num_nodes] int64, parents[0] == -1, parents[i] < i
    draft_probs: torch.Tensor  # [num_nodes] float32, draft probability of each node given its parent (root: 1)
    check: InitVar[bool] = True  # False only where the builder guarantees the shape (the drafter's own search)

    def __post_init__(self, check: bool) -> None:
        if not check:
            return
        n = self.tokens.numel()
        if n < 1 or self.parents.numel() != n or self.draft_probs.numel() != n:
            raise ValueError("tree tokens, parents and draft_probs must be non-empty and of equal length")
        if int(self.parents[0]) != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        idx = torch.arange(n)
        if n > 1 and not bool(((self.parents[1:] >= 0) & (self.parents[1:] < idx[1:])).all()):
            raise ValueError("every non-root node needs a parent that precedes it")

    @staticmethod
    def root_only(token: int) -> DraftTree:
        """A tree with just the root: verifying it is one Auto decode step."""
        return DraftTree(
            tokens=torch.tensor([token], dtype=torch.long),
            parents=torch.tensor([-1], dtype=torch.long),
            draft_probs=torch.ones(1),
        )

    @staticmethod
    def chain(tokens: list[int]) -> DraftTree:
        """A single path: root followed by each token in turn."""
        n = len(tokens)
        return DraftTree(
            tokens=torch.tensor(tokens, dtype=torch.long),
            parents=torch.arange(-1, n - 1, dtype=torch.long),
            draft_probs=torch.ones(n),
        )

    @staticmethod
    def random(num_nodes: int, generator: torch.Generator, vocab_size: int = 2, root: int = 0) -> DraftTree:
        """A tree whose every parent is a random earlier node (test and benchmark shapes)."""
        parents = [-1] + [int(torch.randint(0, i, (), generator=generator)) for i in range(1, num_nodes)]
        tokens = [root] + torch.randint(0, vocab_size, (num_nodes - 1,), generator=generator).tolist()
        return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.ones(num_nodes))

    @staticmethod
    def of(tree: ProposedTree) -> DraftTree:
        """``tree`` as tensors: a DraftTree as it is, a pending one once its host copy is read, any other form
        from its nodes."""
        if isinstance(tree, DraftTree):
            return tree
        if isinstance(tree, PendingTree):
            return tree.tree()
        nodes = tree.to_nodes()
        return DraftTree(
            tokens=torch.tensor(nodes.tokens, dtype=torch.long),
            parents=torch.tensor(nodes.parents, dtype=torch.long),
            draft_probs=torch.tensor(nodes.draft_probs, dtype=torch.float32),
        )

    @property
    def num_nodes(self) -> int:
        return self.tokens.numel()

    @property
    def max_depth(self) -> int:
        return int(self.depths().max())

    def to_nodes(self) -> TreeNodes:
        return TreeNodes(self.tokens.tolist(), self.parents.tolist(), self.draft_probs.tolist())

    def depths(self) -> torch.Tensor:
        """[num_nodes] int64: root 0, child = parent + 1 (computed once per tree; do not modify)."""
        return self._depths

    @functools.cached_property
    def _depths(self) -> torch.Tensor:
        depth, parents = [0] * self.num_nodes, self.parents.tolist()
        for i in range(1, self.num_nodes):
            depth[i] = depth[parents[i]] + 1
        return torch.tensor(depth, dtype=torch.long)

    def ancestor_mask(self) -> torch.Tensor:
        """[num_nodes, num_nodes] bool: mask[i, j] = node j is node i or one of its ancestors (computed
        once per tree; do not modify)."""
        return self._ancestor_mask

    @functools.cached_property
    def _ancestor_mask(self) -> torch.Tensor:
        # one tensor op per level, not per node: every row walks up from itself to the root together
        rows = torch.arange(self.num_nodes)
        parents, node = self.parents.clamp(min=0), rows
        mask = torch.zeros(self.num_nodes, self.num_nodes, dtype=torch.bool)
        for _ in range(int(self.depths().max()) + 1):
            mask[rows, node] = True
            node = parents[node]
        return mask

    def children(self) -> list[list[int]]:
        """children()[i] = node indices whose parent is i, in node order (computed once per tree, for the
        acceptance and the hazard profile alike; do not modify)."""
        return self._children

    @functools.cached_property
    def _children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i, p in enumerate(self.parents.tolist()[1:], start=1):
            kids[p].append(i)
        return kids

    def sibling_ranks(self, path: list[int]) -> tuple[list[int], int]:
        """Along the path from the root whose tokens are ``path``: each node's rank among its siblings (node order),
        and the node where the path stops (at its end, or before a token no child carries: a foreign path)."""
        children, tokens = self.children(), self.token_list()
        node, ranks = 0, []
        for token in path:
            match = [rank for rank, child in enumerate(children[node]) if tokens[child] == token]
            if not match:
                break
            ranks.append(match[0])
            node = children[node][match[0]]
        return ranks, node

    def token_list(self) -> list[int]:
        """``tokens`` as a list (computed once per tree; do not modify)."""
        return self._token_list

    @functools.cached_property
    def _token_list(self) -> list[int]:
        return self.tokens.tolist()

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to ``node``, inclusive."""
        path = []
        parents = self.parents.tolist()
        while node != -1:
            path.append(node)
            node = parents[node]
        return path[::-1]
