"""Tree policies and the ``total_tokens:threshold:depth`` budget string.

- ``chain``: one path of ``depth`` tokens (the draft's top-1 at every step).
- ``uniform<K>``: every node branches into its top-K children, breadth first, until the
  budget is spent.
- ``full``: EAGLE-2's dynamic tree (the EAGLE-3 baseline): each depth expands the
  ``FULL_TOP_K`` frontier nodes with the highest cumulative draft log-probability, each
  into its top ``FULL_TOP_K`` children; at the end the best ``total_tokens`` nodes are kept.
- ``online``: chooses, every few steps, among ``full``'s trees at the candidate grid's budgets and the
  request's own, and a hazard-shaped tree, by predicted tokens per second (``draft_service.tree_plan``);
  the request's budget is where it starts.

``threshold`` prunes nodes whose cumulative draft probability falls below it (0 disables).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from diffspec.errors import InvalidRequest

FULL_TOP_K = 10  # EAGLE-2/3's published top-k per expansion
MAX_TREE_TOKENS = 256
MAX_DEPTH = 32


@dataclass(frozen=True)
class TreeBudget:
    total_tokens: int  # nodes in the tree, root included
    threshold: float  # minimum cumulative draft probability of a kept node
    depth: int  # deepest draft token

    @staticmethod
    def parse(text: str) -> TreeBudget:
        parts = text.split(":")
        try:
            if len(parts) != 3:
                raise ValueError
            budget = TreeBudget(int(parts[0]), float(parts[1]), int(parts[2]))
        except ValueError:
            raise InvalidRequest(
                f"bad tree config {text!r}: expected total_tokens:threshold:depth, e.g. 64:0.08:8"
            ) from None
        if not 2 <= budget.total_tokens <= MAX_TREE_TOKENS:
            raise InvalidRequest(f"total_tokens must be in [2, {MAX_TREE_TOKENS}], got {budget.total_tokens}")
        if not 0.0 <= budget.threshold < 1.0:
            raise InvalidRequest(f"threshold must be in [0, 1), got {budget.threshold}")
        if not 1 <= budget.depth <= MAX_DEPTH:
            raise InvalidRequest(f"depth must be in [1, {MAX_DEPTH}], got {budget.depth}")
        return budget

    @property
    def config(self) -> str:
        """The budget as a ``total_tokens:threshold:depth`` string, e.g. 64:0.0:8."""
        return f"{self.total_tokens}:{self.threshold}:{self.depth}"


@dataclass(frozen=True)
class TreePolicy:
    name: str  # chain, uniform, full, online
    branching: int  # children per expanded node (1 for chain, K for uniform<K>)

    @staticmethod
    def parse(text: str) -> TreePolicy:
        if text == "chain":
            return TreePolicy("chain", 1)
        if text in ("full", "online"):
            return TreePolicy(text, FULL_TOP_K)
        match = re.fullmatch(r"uniform(\d+)", text)
        if match and 1 <= int(match.group(1)) <= 64:
            return TreePolicy("uniform", int(match.group(1)))
        raise InvalidRequest(f"unknown policy {text!r}; expected auto, chain, uniform<K> (K in 1..64), full or online")


@dataclass(frozen=True)
class DepthPlan:
    """How one depth of the tree grows: which frontier nodes expand and into how many children."""

    expand: int  # frontier nodes expanded at this depth (the best by cumulative log-prob)
    children: int  # top children each expanded node proposes
