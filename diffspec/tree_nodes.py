"""A token tree as plain lists, and what the engine loop needs of any tree.

The in-process draft hands out ``DraftTree`` (``diffspec/tree.py``: tensors, with a copy on the
draft's device); a tree that crossed the wire, or an Auto step's root-only tree, is a ``TreeNodes``.
The engine loop and the gRPC clients read either through ``ProposedTree``, so a gateway that only
relays trees between services never needs torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from diffspec.errors import InvalidRequest
from diffspec.v1 import tensor_pb2


class ProposedTree(Protocol):
    """What the engine loop and the wire read of a tree, whatever holds its nodes."""

    @property
    def num_nodes(self) -> int: ...  # the rows a verify computes: the nodes (a pending tree: its padded size)

    @property
    def max_depth(self) -> int: ...  # depth of the deepest node, root = 0 (a pending tree: the most it can be)

    def to_nodes(self) -> TreeNodes: ...


@dataclass(frozen=True)
class TreeNodes:
    """Node 0 is the root (the last committed token); every other node's parent precedes it."""

    tokens: list[int]  # [num_nodes] target-vocab ids; tokens[0] is the root
    parents: list[int]  # [num_nodes] parents[0] == -1, parents[i] < i
    draft_probs: list[float]  # [num_nodes] draft probability of each node given its parent (root: 1)
    max_depth: int = field(init=False)  # depth of the deepest node, found while the parents are checked

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if n < 1 or len(self.parents) != n or len(self.draft_probs) != n:
            raise ValueError("tree tokens, parents and draft_probs must be non-empty and of equal length")
        if self.parents[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        depths = [0] * n
        for node in range(1, n):
            parent = self.parents[node]
            if not 0 <= parent < node:
                raise ValueError("every non-root node needs a parent that precedes it")
            depths[node] = depths[parent] + 1
        object.__setattr__(self, "max_depth", max(depths))

    @staticmethod
    def root_only(token: int) -> TreeNodes:
        """A tree with just the root: verifying it is one Auto decode step."""
        return TreeNodes([token], [-1], [1.0])

    @staticmethod
    def from_proto(message: tensor_pb2.DraftTree) -> TreeNodes:
        """Raises InvalidRequest for a tree that is not one (empty, ragged, a parent after its child)."""
        try:
            return TreeNodes(list(message.tokens), list(message.parents), list(message.draft_probs))
        except ValueError as bad:
            raise InvalidRequest(f"malformed draft tree: {bad}") from None

    def to_proto(self) -> tensor_pb2.DraftTree:
        return tensor_pb2.DraftTree(tokens=self.tokens, parents=self.parents, draft_probs=self.draft_probs)

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    def to_nodes(self) -> TreeNodes:
        return self
