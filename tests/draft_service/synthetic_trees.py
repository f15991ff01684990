"""A synthetic draft and target for the tree planner's tests: trees grown as the device grows them, paths
accepted as a calibrated target accepts them.

A ``World`` is one step's unseen truth: every node (a path of sibling ranks from the root) has draft
probabilities for its top ``FULL_TOP_K`` children, its confidence drawn afresh per node (confident
or unsure), and the target accepts child rank r with exactly the draft's probability of it (a
calibrated draft), or none. ``grow`` builds the tree of a plan and budget by the proposal's rule
(``draft_service/tree_search.py``): per depth each frontier node proposes its top children down to
the threshold, the next frontier is the best ``expand`` of them by cumulative log-prob (ties to the
earlier slot), and the best ``total_tokens - 1`` of all are kept, in slot order.
"""

from __future__ import annotations

import math
import random

import torch

from diffspec.tree import DraftTree
from draft_service.tree_budget import FULL_TOP_K, DepthPlan, TreeBudget

Path = tuple[int, ...]  # sibling ranks from the root


class World:
    def __init__(self, rng: random.Random, confident: float = 0.5) -> None:
        self.rng = rng
        self.confident = confident  # share of nodes whose top child is nearly sure
        self._probs: dict[Path, list[float]] = {}
        self._choice: dict[Path, int | None] = {}

    def probs(self, path: Path) -> list[float]:
        """Draft probabilities of the node's top children, best first."""
        if path not in self._probs:
            top = self.rng.uniform(0.8, 0.97) if self.rng.random() < self.confident else self.rng.uniform(0.15, 0.45)
            rest = [0.55**r for r in range(1, FULL_TOP_K)]
            scale = (1.0 - top) * 0.9 / sum(rest)  # a tenth of the rest lies outside the top children
            self._probs[path] = [top, *[p * scale for p in rest]]
        return self._probs[path]

    def choice(self, path: Path) -> int | None:
        """The child rank the target accepts at the node (None: a token the draft did not propose)."""
        if path not in self._choice:
            draw, chosen = self.rng.random(), None
            for rank, p in enumerate(self.probs(path)):
                draw -= p
                if draw < 0:
                    chosen = rank
                    break
            self._choice[path] = chosen
        return self._choice[path]


def grow(world: World, plan: list[DepthPlan], budget: TreeBudget) -> tuple[DraftTree, list[Path]]:
    """The tree of ``plan`` and ``budget`` over ``world``, and each node's path (node 0 is the root)."""
    floor = math.log(budget.threshold) if budget.threshold > 0 else -math.inf
    slots: list[tuple[Path, float, int, float]] = []  # (path, cumulative log-prob, parent slot, own prob)
    frontier: list[tuple[Path, float, int]] = [((), 0.0, -1)]  # (path, cumulative log-prob, slot)
    for depth, step in enumerate(plan[: budget.depth]):
        slab = []
        for path, log_prob, slot in frontier:
            for rank, p in enumerate(world.probs(path)[: step.children]):
                if log_prob + math.log(p) >= floor:
                    slab.append(len(slots))
                    slots.append(((*path, rank), log_prob + math.log(p), slot, p))
        if depth + 1 < min(len(plan), budget.depth):
            ranked = sorted(slab, key=lambda s: -slots[s][1])[: plan[depth + 1].expand]
            frontier = [(slots[s][0], slots[s][1], s) for s in ranked]
    kept = sorted(sorted(range(len(slots)), key=lambda s: -slots[s][1])[: budget.total_tokens - 1])
    node_of = {-1: 0, **{slot: i + 1 for i, slot in enumerate(kept)}}
    parents = [-1] + [node_of[slots[s][2]] for s in kept]
    tokens = list(range(len(parents)))  # distinct ids: the path is found by ranks
    probs = [1.0] + [slots[s][3] for s in kept]
    tree = DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(probs, dtype=torch.float32))
    return tree, [()] + [slots[s][0] for s in kept]


def verify(world: World, tree: DraftTree, paths: list[Path]) -> tuple[list[int], int]:
    """(the accepted child's place among its parent's kept children per depth, children where the path
    stopped: 0 at a leaf), as the runtime feeds its hazard profile."""
    children: list[list[int]] = [[] for _ in paths]
    for node, parent in enumerate(tree.parents.tolist()[1:], start=1):
        children[parent].append(node)
    node, ranks = 0, []
    while children[node]:
        wanted = world.choice(paths[node])
        places = [i for i, child in enumerate(children[node]) if paths[child][-1] == wanted]
        if not places:
            return ranks, len(children[node])
        ranks.append(places[0])
        node = children[node][places[0]]
    return ranks, 0
