"""Acceptance rules: greedy paths, and the lossless multi-draft sampling rule."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from diffspec.acceptance import accept_greedy, accept_sampling
from diffspec.sampling import SamplingParams, target_probs
from diffspec.tree import DraftTree

#            root
#          /   |   \
#     n1:7   n2:8   n3:9
#      |       |
#    n4:4    n5:5
#      |
#    n6:6
TREE = DraftTree(
    tokens=torch.tensor([0, 7, 8, 9, 4, 5, 6]),
    parents=torch.tensor([-1, 0, 0, 0, 1, 2, 4]),
    draft_probs=torch.ones(7),
)


@pytest.mark.parametrize(
    "argmax, nodes, bonus",
    [
        ([3, 0, 0, 0, 0, 0, 0], [], 3),  # root's argmax matches no child
        ([8, 0, 5, 0, 0, 2, 0], [2, 5], 2),  # 8 then 5, bonus = argmax at n5
        ([7, 4, 0, 0, 6, 0, 11], [1, 4, 6], 11),  # the full deepest path
        ([9, 0, 0, 12, 0, 0, 0], [3], 12),  # a leaf at depth 1
    ],
)
def test_greedy_walks_the_matching_path(argmax, nodes, bonus):
    result = accept_greedy(TREE, argmax)
    assert result.accepted_nodes == nodes and result.bonus_token == bonus


def _tree_with_children(children: list[int]) -> DraftTree:
    """Root with the given depth-1 children; the first child also gets two grandchildren."""
    tokens = [0, *children, 1, 2]
    parents = [-1] + [0] * len(children) + [1, 1]
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.ones(len(tokens)))


@pytest.mark.parametrize(
    "temperature, top_p, children",
    [
        (1.0, 1.0, [5, 1]),  # the two likeliest tokens, likeliest first
        (1.0, 1.0, [2]),  # one unlikely child
        (0.7, 1.0, [1, 1, 4]),  # a repeated candidate
        (1.3, 0.8, [2, 0, 3, 4, 5, 1]),  # every token, some outside the top-p set
    ],
)
def test_first_emitted_token_follows_the_target_distribution(temperature, top_p, children):
    vocab, trials = 6, 5000
    logits = torch.tensor([0.2, 1.5, -1.0, 0.8, -0.3, 2.0])
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=5)
    p = target_probs(logits, params)
    tree = _tree_with_children(children)
    probs = p.expand(tree.num_nodes, vocab)
    counts = torch.zeros(vocab)
    gen = params.generator()
    for _ in range(trials):
        result = accept_sampling(tree, probs, gen)
        first = int(tree.tokens[result.accepted_nodes[0]]) if result.accepted_nodes else result.bonus_token
        counts[first] += 1
    support = p > 0
    assert counts[~support].sum() == 0, "a token outside the top-p set was emitted"
    assert chisquare(counts[support].numpy(), (p[support] * trials).numpy()).pvalue > 1e-3


def test_a_deterministic_draft_changes_nothing_but_speed():
    """A tree whose only child is the target's likeliest token is accepted with exactly p(x)."""
    p = torch.tensor([0.1, 0.6, 0.3])
    tree = DraftTree.chain([0, 1])
    gen = torch.Generator().manual_seed(0)
    accepted = sum(bool(accept_sampling(tree, p.expand(2, 3), gen).accepted_nodes) for _ in range(4000))
    assert abs(accepted / 4000 - 0.6) < 0.03


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.75))
    assert torch.allclose(kept, torch.tensor([0.625, 0.375, 0.0, 0.0]))


@pytest.mark.parametrize("kwargs", [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_bad_sampling_params_are_rejected(kwargs):
    from diffspec.errors import InvalidRequest

    with pytest.raises(InvalidRequest):
        SamplingParams(**kwargs)
