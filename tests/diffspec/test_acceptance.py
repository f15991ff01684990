"""Acceptance rules: greedy paths, and the lossless sampling rule coupled to each token's index."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from diffspec.acceptance import Acceptance, TokenUniforms, accept_greedy, accept_sampling, sampling_outcomes
from diffspec.sampling import SamplingParams, inverse_cdf, target_probs
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


def accept_sampled(tree: DraftTree, probs: torch.Tensor, uniforms: torch.Tensor) -> Acceptance:
    """One sampled step as the target takes it: every outcome in tensors, then the walk. ``uniforms``: the step's
    token indices' (at least the tree's depth + 1)."""
    return accept_sampling(tree, sampling_outcomes(tree.tokens, tree.parents, probs, uniforms[tree.depths()]))


def fresh(generator: torch.Generator) -> torch.Tensor:
    """A step's uniforms, independent of every other step's (enough for any tree here)."""
    return torch.rand(16, generator=generator, dtype=torch.float64)


@pytest.mark.parametrize(
    "children, uniforms, nodes, bonus",
    [
        # p = [0.1, 0.6, 0.3] at every node: u < 0.1 samples token 0, u < 0.7 token 1, else token 2
        ([1, 2], [0.5, 0.05], [1], 0),  # the root samples 1: its child 1 is taken, whose row samples 0
        ([1, 2], [0.75, 0.95], [2], 2),  # the root samples 2: the second child
        ([1, 2], [0.05, 0.5], [], 0),  # the root samples 0, which no child has: the bonus
        ([1, 1, 2], [0.5, 0.95], [1], 2),  # a repeated token: the first sibling with it
        ([0], [0.69, 0.5], [], 1),  # the root samples 1 and its child is 0
    ],
)
def test_a_child_is_taken_when_its_token_is_its_parent_s_sample(children, uniforms, nodes, bonus):
    tokens = [0, *children]
    tree = DraftTree(torch.tensor(tokens), torch.tensor([-1] + [0] * len(children)), torch.ones(len(tokens)))
    probs = torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64).expand(tree.num_nodes, 3)
    result = accept_sampled(tree, probs, torch.tensor(uniforms, dtype=torch.float64))
    assert (result.accepted_nodes, result.bonus_token) == (nodes, bonus)


def test_the_inverse_cdf_never_draws_a_token_without_mass():
    probs = torch.tensor([[0.0, 0.6, 0.0, 0.4, 0.0]] * 4, dtype=torch.float64)
    uniforms = torch.tensor([0.0, 0.59, 0.61, 1.0 - 1e-16], dtype=torch.float64)
    assert inverse_cdf(probs, uniforms).tolist() == [1, 1, 3, 3]


def test_the_uniforms_of_an_index_do_not_depend_on_the_windows_asked():
    """Auto asks one index at a time, a tree as many as its depth bound: the k-th uniform is the same."""
    one_by_one, windows = (TokenUniforms(torch.Generator().manual_seed(4)) for _ in range(2))
    singles = []
    for _ in range(20):
        singles.append(float(one_by_one.window(1)[0]))
        one_by_one.advance(1)
    seen = []
    for size, emitted in [(9, 3), (2, 1), (9, 5), (4, 4), (12, 7)]:
        window = windows.window(size)
        seen += window[:emitted].tolist()
        assert window[:emitted].tolist() == singles[len(seen) - emitted : len(seen)]
        windows.advance(emitted)
    assert seen == singles


def test_every_emitted_token_is_the_one_auto_emits_at_its_index():
    """A toy target whose distribution at a position depends on the token before it, seeded sampling: steps over
    random trees (random shapes and tokens, some children the target's samples) emit exactly the tokens that
    Auto (one token a step) emits with the seed, whatever the trees."""
    vocab, length = 6, 40
    table = torch.softmax(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(1)), dim=-1).double()

    def auto() -> list[int]:
        uniforms, out, last = TokenUniforms(torch.Generator().manual_seed(7)), [], 0
        while len(out) < length:
            last = int(inverse_cdf(table[last][None], uniforms.window(1))[0])
            uniforms.advance(1)
            out.append(last)
        return out

    want = auto()
    for trial in range(5):
        trees = torch.Generator().manual_seed(100 + trial)
        uniforms, out, last = TokenUniforms(torch.Generator().manual_seed(7)), [], 0
        while len(out) < length:
            tree = DraftTree.random(int(torch.randint(1, 12, (), generator=trees)), trees, vocab, root=last)
            if trial % 2:  # drafts that are the target's own next tokens, so long paths are accepted
                expected = want[len(out) :] + [0] * 12
                tokens = [last] + [expected[d - 1] for d in tree.depths().tolist()[1:]]
                tree = DraftTree(torch.tensor(tokens), tree.parents, tree.draft_probs)
            probs = table[tree.tokens]  # each node's row: the distribution after its token
            result = accept_sampled(tree, probs, uniforms.window(tree.max_depth + 1))
            emitted = [int(tree.tokens[n]) for n in result.accepted_nodes] + [result.bonus_token]
            uniforms.advance(len(emitted))
            out += emitted
            last = emitted[-1]
        assert out[:length] == want, trial


@pytest.mark.parametrize("row", [[float("nan"), 0.5, 0.5], [0.0, 0.0, 0.0]], ids=["NaN", "no mass"])
def test_a_row_that_is_no_distribution_fails_the_step_where_it_is_drawn_from(row):
    tree = DraftTree.chain([0, 1])
    uniforms = torch.tensor([0.5, 0.5], dtype=torch.float64)
    broken = torch.tensor([row, [0.2, 0.3, 0.5]], dtype=torch.float64)
    outcomes = sampling_outcomes(tree.tokens, tree.parents, broken, uniforms[tree.depths()])
    assert outcomes.bonus.tolist()[0] == -1 and not outcomes.accepted.any()
    with pytest.raises(ValueError, match="not one"):
        accept_sampling(tree, outcomes)
    # the same row past the accepted path is never drawn from (the root samples 2, not the child's 1)
    fine = sampling_outcomes(tree.tokens, tree.parents, broken.flip(0), uniforms[tree.depths()])
    assert accept_sampling(tree, fine) == Acceptance([], 2) and fine.bonus.tolist()[1] == -1


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
        result = accept_sampled(tree, probs, fresh(gen))
        first = int(tree.tokens[result.accepted_nodes[0]]) if result.accepted_nodes else result.bonus_token
        counts[first] += 1
    support = p > 0
    assert counts[~support].sum() == 0, "a token outside the top-p set was emitted"
    assert chisquare(counts[support].numpy(), (p[support] * trials).numpy()).pvalue > 1e-3


def test_the_first_two_emitted_tokens_follow_the_target_jointly():
    """Past the first token: a tree whose first child has children of its own, the same distribution at every
    node, so the first two emitted tokens are independent draws from it (the second an accepted grandchild,
    the bonus after an accepted child, or the token after the bonus's step, which a step never emits)."""
    logits = torch.tensor([0.2, 1.5, -1.0, 0.8, -0.3, 2.0])
    p = target_probs(logits, SamplingParams(temperature=1.0, seed=3))
    tree = _tree_with_children([5, 1])  # root -> 5 (-> 1, 2), 1
    probs, gen, trials = p.expand(tree.num_nodes, 6), torch.Generator().manual_seed(11), 6000
    pairs = torch.zeros(6, 6)
    counted = 0
    for _ in range(trials):
        result = accept_sampled(tree, probs, fresh(gen))
        emitted = [int(tree.tokens[n]) for n in result.accepted_nodes] + [result.bonus_token]
        if len(emitted) >= 2:
            pairs[emitted[0], emitted[1]] += 1
            counted += 1
    # two tokens come out exactly when the first is accepted; given that, the pair's law is p(x1 | x1 in {5, 1})
    # times p(x2)
    first = torch.zeros(6)
    first[[5, 1]] = p[[5, 1]] / p[[5, 1]].sum()
    expected = (first[:, None] * p[None, :]).flatten() * counted
    frequent = expected >= 5
    observed = torch.cat([pairs.flatten()[frequent], pairs.flatten()[~frequent].sum().view(1)])
    expected = torch.cat([expected[frequent], expected[~frequent].sum().view(1)])
    keep = expected > 0  # pairs whose first token is no child never come out
    assert counted > trials // 2
    assert chisquare(observed[keep].numpy(), expected[keep].numpy()).pvalue > 1e-3


def test_a_deterministic_draft_changes_nothing_but_speed():
    """A tree whose only child is the target's likeliest token is accepted with exactly p(x)."""
    p = torch.tensor([0.1, 0.6, 0.3])
    tree = DraftTree.chain([0, 1])
    gen = torch.Generator().manual_seed(0)
    accepted = sum(bool(accept_sampled(tree, p.expand(2, 3), fresh(gen)).accepted_nodes) for _ in range(4000))
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
