"""Bundle order: contiguous shared paths, and verification results identical to tree order."""

from __future__ import annotations

import random

import pytest
import torch

from diffspec.sampling import SamplingParams
from diffspec.settings import DiffSpecSettings
from diffspec.tree import DraftTree
from target_service.bundle_scheduler import schedule
from target_service.runtime import TargetRuntime


def test_layout_of_a_small_tree():
    #        0
    #      /   \
    #     1     2
    #    / \    |
    #   3   4   5
    #   |
    #   6
    tree = DraftTree(torch.arange(7) + 10, torch.tensor([-1, 0, 0, 1, 1, 2, 3]), torch.ones(7))
    scheduled, layout = schedule(tree)
    assert layout.order == [0, 1, 3, 6, 4, 2, 5]
    assert scheduled.tokens.tolist() == [10, 11, 13, 16, 14, 12, 15]
    assert scheduled.parents.tolist() == [-1, 0, 1, 2, 1, 0, 5]
    assert [(b.branch_node, b.shared_path, b.leaves, b.rows) for b in layout.bundles] == [
        (0, [0], [6], (1, 7)),
        (1, [0, 1], [3, 4], (2, 5)),
    ]
    assert torch.equal(scheduled.tokens[scheduled.parents[1:]], tree.tokens[tree.parents[layout.order[1:]]])


def _tree_around(path: list[int], num_nodes: int, rng: random.Random) -> DraftTree:
    """The greedy path (root first) plus random distractor nodes hung anywhere."""
    tokens, parents = list(path), [-1, *range(len(path) - 1)]
    while len(tokens) < num_nodes:
        parents.append(rng.randrange(len(tokens)))
        tokens.append(rng.randrange(3, 8192))
    order = sorted(range(1, num_nodes), key=lambda _: rng.random())
    # shuffle node numbering while keeping parents before children
    ranked = sorted(range(1, num_nodes), key=lambda n: (_depth(parents, n), order.index(n)))
    new = {0: 0, **{old: i + 1 for i, old in enumerate(ranked)}}
    perm = [0, *ranked]
    return DraftTree(
        torch.tensor([tokens[n] for n in perm]),
        torch.tensor([-1] + [new[parents[n]] for n in perm[1:]]),
        torch.ones(num_nodes),
    )


def _depth(parents: list[int], node: int) -> int:
    depth = 0
    while node > 0:
        node, depth = parents[node], depth + 1
    return depth


@pytest.mark.parametrize("seed", range(4))
def test_bundled_verification_equals_tree_order(tiny_target_dir, seed):
    runtime = TargetRuntime(DiffSpecSettings(base_model=tiny_target_dir, num_pages=128))
    rng = random.Random(seed)
    prompt = [0] + [rng.randrange(3, 8192) for _ in range(30)]
    greedy = [runtime.prefill("ref", prompt, SamplingParams(), False).first_token]
    greedy += [runtime.decode("ref").bonus_token for _ in range(6)]
    tree = _tree_around(greedy[: rng.randrange(2, 6)], 24, rng)
    results = {}
    for bundled in (True, False):
        runtime.bundle_trees = bundled
        runtime.prefill(f"b{bundled}", prompt, SamplingParams(), want_features=True)
        results[bundled] = runtime.verify(f"b{bundled}", tree)
    with_bundles, plain = results[True], results[False]
    assert with_bundles.accepted_nodes == plain.accepted_nodes and with_bundles.bonus_token == plain.bonus_token
    assert with_bundles.accepted_tokens == tree.tokens[plain.accepted_nodes].tolist()
    assert torch.allclose(with_bundles.features, plain.features, atol=1e-5)
    assert runtime.pool.committed_token_ids("bTrue") == runtime.pool.committed_token_ids("bFalse")
