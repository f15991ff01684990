"""A verify batch's epilogue: accepted paths, commits, and the features each session wants, gathered once."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from diffspec.acceptance import TokenUniforms, accept_sampling, sampling_outcomes
from diffspec.sampling import target_probs
from diffspec.sampling_params import SamplingParams
from diffspec.tree import DraftTree, PendingTree
from target_service import acceptance_step
from target_service.acceptance_step import SampledReads, accept_batch, greedy_argmax, sampling_outcomes_of
from target_service.backend import VerifyStep
from target_service.llama import PagedForwardOutput
from target_service.session import TargetSession
from target_service.step_graphs import StepOutputs
from tests.target_service.trees import pending_tree

VOCAB, HIDDEN = 16, 4
FORWARD_LAYERS = (2, 5, 7)  # the layers whose features the forward computed, in column order


@dataclass(frozen=True)
class Case:
    tree: list[int]  # a chain: the root, then the drafts
    argmax: list[int]  # the target's argmax at each node
    want_features: bool = True
    layers: tuple[int, ...] = FORWARD_LAYERS


# Sessions of one batch: the forward's layers, a subset in another order, none wanted; every acceptance
# length from none to the whole chain.
CASES = [
    Case([3, 4, 5], [4, 9, 1]),  # accepts 4, then 9 is the bonus
    Case([6, 7], [8, 0], layers=(7, 2)),  # accepts nothing
    Case([1, 2, 3, 4], [2, 3, 4, 11], want_features=False),  # accepts the whole chain
    Case([9], [12], layers=(5,)),  # Auto: the root alone
    Case([5, 6, 7], [6, 7, 2]),
]
ACCEPTED = [[1], [], [1, 2, 3], [], [1, 2]]
BONUS = [9, 8, 11, 12, 2]


def _ran(offsets: list[int], rows: int, cases: list[Case]) -> StepOutputs:
    logits = torch.zeros(rows, VOCAB)
    for case, offset in zip(cases, offsets):
        for node, token in enumerate(case.argmax):
            logits[offset + node, token] = 1.0
    features = torch.randn(rows, len(FORWARD_LAYERS) * HIDDEN, generator=torch.Generator().manual_seed(0))
    empty = torch.zeros(1, rows, 1, HIDDEN)
    forward = PagedForwardOutput(torch.zeros(rows, HIDDEN), features, empty, empty, FORWARD_LAYERS)
    return StepOutputs(forward, logits, offsets)


@pytest.mark.parametrize("padded", [False, True], ids=["eager rows", "graph bucket rows"])
def test_each_session_gets_its_own_rule_from_one_batch(padded):
    offsets = [8 * b for b in range(len(CASES))] if padded else [0, 3, 5, 9, 10]
    ran = _ran(offsets, offsets[-1] + 8, CASES)
    steps = [VerifyStep(f"s{b}", DraftTree.chain(case.tree)) for b, case in enumerate(CASES)]
    sessions = [
        TargetSession([0], SamplingParams(), None, case.want_features, 1, case.tree[0], case.layers) for case in CASES
    ]
    results, commits, failures = accept_batch(steps, sessions, ran, greedy_argmax(sessions, ran).tolist(), {})
    assert not failures
    for b, (case, offset, commit) in enumerate(zip(CASES, offsets, commits)):
        result, rows = results[f"s{b}"], [offset + node for node in [0, *ACCEPTED[b]]]
        assert (result.accepted_nodes, result.bonus_token) == (ACCEPTED[b], BONUS[b])
        assert result.accepted_tokens == [case.tree[node] for node in ACCEPTED[b]]
        assert sessions[b].pending_token == BONUS[b]
        assert (commit.session_id, commit.rows) == (f"s{b}", rows)
        assert commit.tokens == [case.tree[0], *result.accepted_tokens]
        if not case.want_features:
            assert result.features is None
            continue
        assert result.features is not None
        assert torch.equal(result.features, ran.forward.features_of(rows, case.layers))  # the per-session rule


def test_a_session_with_a_device_acceptance_takes_its_features_instead_of_a_gather(monkeypatch):
    """The device acceptance gathered the same rows (padded to the depth bound): its first rows are the result's
    features, and only the other sessions that want features are gathered."""
    offsets = [0, 3, 5, 9, 10]
    ran = _ran(offsets, 18, CASES)
    steps = [VerifyStep(f"s{b}", DraftTree.chain(case.tree)) for b, case in enumerate(CASES)]
    sessions = [
        TargetSession([0], SamplingParams(), None, case.want_features, 1, case.tree[0], case.layers) for case in CASES
    ]
    rows = [offsets[0] + node for node in [0, *ACCEPTED[0]]]
    padded = ran.forward.features_of([*rows, rows[-1]], CASES[0].layers)  # one row past the path, as the device pads
    gathered: list[list[int]] = []
    features_of = ran.forward.features_of
    def counted(rows: list[int], layers: tuple[int, ...]) -> torch.Tensor:
        gathered.append(list(rows))
        return features_of(rows, layers)

    monkeypatch.setattr(ran.forward, "features_of", counted)
    results, _, failures = accept_batch(steps, sessions, ran, greedy_argmax(sessions, ran).tolist(), {}, {"s0": padded})
    assert not failures
    assert torch.equal(results["s0"].features, padded[: len(rows)])
    assert results["s0"].features.data_ptr() == padded.data_ptr()  # a view: nothing gathered for it
    assert gathered and all(row not in rows for batch in gathered for row in batch)
    for b in (1, 3, 4):  # the others that want features: gathered as before
        want = ran.forward.features_of([offsets[b] + node for node in [0, *ACCEPTED[b]]], CASES[b].layers)
        assert torch.equal(results[f"s{b}"].features, want)
    assert results["s2"].features is None


def test_no_argmax_is_read_for_a_batch_without_a_greedy_session():
    ran = _ran([0], 8, CASES[:1])
    sampled = TargetSession([0], SamplingParams(temperature=0.7), None, True, 1, 3, FORWARD_LAYERS)
    assert greedy_argmax([sampled], ran) is None
    greedy = TargetSession([0], SamplingParams(), None, True, 1, 3, FORWARD_LAYERS)
    assert greedy_argmax([sampled, greedy], ran) is not None


def test_a_sampled_session_walks_the_outcomes_of_its_own_rows_and_draws():
    """A greedy and a sampled session in one batch: the sampled one's outcomes come from its rows of the logits
    and from the uniforms of its next token indices, one per depth, and its acceptance walks them; it spends
    one uniform per emitted token. The greedy one's is its argmax path, as alone."""
    cases = [CASES[0], Case([5, 6, 7], [6, 7, 2])]
    ran = _ran([0, 3], 6, cases)
    sampling = SamplingParams(temperature=0.3, seed=4)  # a peaked distribution: long paths, and not always
    steps = [VerifyStep(f"s{b}", DraftTree.chain(case.tree)) for b, case in enumerate(cases)]
    sessions = [
        TargetSession([0], SamplingParams(), None, True, 1, 3, FORWARD_LAYERS),
        TargetSession([0], sampling, TokenUniforms(sampling.generator()), True, 1, 5, FORWARD_LAYERS),
    ]
    sampled = sampling_outcomes_of(steps, sessions, ran)
    assert sampled is not None and list(sampled.spans) == ["s1"]
    tree, uniforms = steps[1].tree, torch.rand(8, generator=sampling.generator(), dtype=torch.float64)
    probs = target_probs(ran.logits[3:6], sampling)
    want = accept_sampling(tree, sampling_outcomes(tree.tokens, tree.parents, probs, uniforms[:3][tree.depths()]))
    outcomes = SampledReads(sampled).get()
    results, commits, failures = accept_batch(steps, sessions, ran, greedy_argmax(sessions, ran).tolist(), outcomes)
    assert not failures
    assert (results["s0"].accepted_nodes, results["s0"].bonus_token) == (ACCEPTED[0], BONUS[0])
    assert (results["s1"].accepted_nodes, results["s1"].bonus_token) == (want.accepted_nodes, want.bonus_token)
    assert commits[1].rows == [3 + node for node in [0, *want.accepted_nodes]]
    emitted = len(want.accepted_nodes) + 1
    assert torch.equal(sessions[1].uniforms.window(8 - emitted), uniforms[emitted:])  # its next index's on


LAWS = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.3, top_p=0.9, top_k=5, seed=2)]


@pytest.mark.parametrize("seed", range(6))
def test_sampled_sessions_side_by_side_decide_as_each_alone(seed, monkeypatch):
    """Sampled sessions of two laws, host and pending trees, padded rows, a greedy one among them: the outcomes
    computed side by side are each session's computed alone, every node's parent found in its own tree; each
    law's distributions are computed once for all its sessions."""
    generator = torch.Generator().manual_seed(seed)
    sizes, laws = [5, 1, 9, 3, 7], [0, 1, 0, None, 1]  # None: greedy
    trees = [DraftTree(torch.randint(0, VOCAB, (n,), generator=generator), DraftTree.random(n, generator).parents,
                       torch.ones(n)) for n in sizes]
    offsets = [0, 12, 24, 36, 48]  # graph bucket rows: each tree's padded to 12
    ran = StepOutputs(_ran(offsets, 60, []).forward, torch.randn(60, VOCAB, generator=generator) * 2, offsets)
    steps, sessions = [], []
    for b, (tree, law) in enumerate(zip(trees, laws)):
        on_device = b % 2 == 0 and law is not None
        steps.append(VerifyStep(f"s{b}", pending_tree(tree, tree.num_nodes + 2, depth_bound=tree.max_depth + 1) if on_device else tree))
        sampling = LAWS[law] if law is not None else SamplingParams()
        uniforms = TokenUniforms(sampling.generator()) if law is not None else None
        sessions.append(TargetSession([0], sampling, uniforms, True, 1, int(tree.tokens[0]), FORWARD_LAYERS))
    computed = []

    def counted(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        computed.append(params)
        return target_probs(logits, params)

    monkeypatch.setattr(acceptance_step, "target_probs", counted)

    sampled = sampling_outcomes_of(steps, sessions, ran)
    assert sampled is not None and sorted(sampled.spans) == ["s0", "s1", "s2", "s4"]
    assert sorted(p.temperature for p in computed) == [0.8, 1.3]
    read = SampledReads(sampled).get()
    for b, (step, tree, law) in enumerate(zip(steps, trees, laws)):
        if law is None:
            continue
        nodes = step.tree.num_nodes if isinstance(step.tree, PendingTree) else tree.num_nodes
        device_tree = step.tree.on_device if isinstance(step.tree, PendingTree) else None
        parents = device_tree.parents[:nodes] if device_tree is not None else tree.parents
        tokens = device_tree.tokens[:nodes] if device_tree is not None else tree.tokens
        depths = device_tree.depths[:nodes] if device_tree is not None else tree.depths()
        uniforms = TokenUniforms(LAWS[law].generator()).window(step.tree.max_depth + 1)
        probs = target_probs(ran.logits[offsets[b] : offsets[b] + nodes], LAWS[law])
        alone = sampling_outcomes(tokens, parents, probs, uniforms[depths])
        assert torch.equal(sampled.of(f"s{b}").accepted, alone.accepted), b
        assert torch.equal(sampled.of(f"s{b}").bonus, alone.bonus), b
        assert torch.equal(read[f"s{b}"].accepted, alone.accepted) and torch.equal(read[f"s{b}"].bonus, alone.bonus)


def test_no_sampled_session_computes_and_reads_nothing():
    ran = _ran([0], 8, CASES[:1])
    steps = [VerifyStep("s0", DraftTree.chain(CASES[0].tree))]
    sessions = [TargetSession([0], SamplingParams(), None, True, 1, 3, FORWARD_LAYERS)]
    assert sampling_outcomes_of(steps, sessions, ran) is None
    assert SampledReads(None).get() == {}
