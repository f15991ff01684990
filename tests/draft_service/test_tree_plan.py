"""The online tree planner per session: counterfactual acceptance of contained dynamic trees, the choice within
the batch's bound, the probe, and a simulated convergence with the batch's choice of bound and its probes."""

from __future__ import annotations

import random

import pytest
import torch

from diffspec.tree import DraftTree
from draft_service.batch_plan import BatchCost, BatchPlanner, SessionOutlook
from draft_service.hazard import HazardProfile, StepCostModel, expected_tokens, tree_size
from draft_service import tree_plan
from draft_service.tree_budget import TreeBudget
from draft_service.tree_plan import (
    DYNAMIC,
    AcceptanceTracker,
    SessionAcceptance,
    RECHECK_EVERY,
    SHAPED,
    Bound,
    Calibration,
    Candidate,
    SharedMeasurements,
    TreePlanner,
    counterfactual_accepted,
)
from tests.draft_service.synthetic_trees import World, grow, verify

B = TreeBudget.parse

# root -> A (0.6), B (0.3); A -> C (0.5), D (0.4); B -> E (0.9). Cumulative: A .6, B .3, C .3, D .24, E .27.
SMALL_TREE = DraftTree(torch.arange(6), torch.tensor([-1, 0, 0, 1, 1, 2]), torch.tensor([1, 0.6, 0.3, 0.5, 0.4, 0.9]))


@pytest.mark.parametrize(
    ("config", "accepted"),
    [
        ("3:0.0:2", 1),  # A and B (B ties C at .3 and is the earlier node): D is out
        ("5:0.0:2", 1),  # A, B, C, E: D (.24) is the least likely
        ("6:0.0:2", 2),  # every node: the path A -> D is inside
        ("6:0.0:1", 1),  # depth 1 only
        ("6:0.25:2", 1),  # D under the threshold
        ("2:0.0:2", 1),  # A alone
    ],
)
def test_counterfactual_accepted_on_a_small_tree(config, accepted):
    assert counterfactual_accepted(SMALL_TREE, [0, 1], [B(config)]) == [accepted]


@pytest.mark.parametrize("seed", range(40))
def test_counterfactual_equals_growing_the_smaller_tree(seed):
    """At the verified tree's depth the counterfactual is exactly what the smaller tree, grown and verified on
    the same step, accepts; at a smaller depth it never says more."""
    same_depth = [B("16:0.0:8"), B("32:0.0:8"), B("48:0.05:8"), B("64:0.0:8")]
    shallower = [B("16:0.0:4"), B("32:0.0:6"), B("48:0.0:7")]
    big = Candidate.dynamic(B("64:0.0:8"))
    world = World(random.Random(seed))
    tree, paths = grow(world, list(big.plan), big.budget)
    ranks, _ = verify(world, tree, paths)
    counterfactual = counterfactual_accepted(tree, ranks, same_depth + shallower)
    direct = []
    for budget in same_depth + shallower:
        small = Candidate.dynamic(budget)
        direct.append(len(verify(world, *grow(world, list(small.plan), small.budget))[0]))
    assert counterfactual[: len(same_depth)] == direct[: len(same_depth)]
    assert all(c <= d for c, d in zip(counterfactual[len(same_depth) :], direct[len(same_depth) :]))


MEANS = {"16:0.0:4": 2.0, "32:0.0:6": 2.6, "48:0.0:8": 3.0, "64:0.0:8": 3.2, "96:0.0:10": 3.4}  # accepted drafts


def planner_with(start: str, means: dict[str, float], shaped_ratio: float = 1.0) -> TreePlanner:
    """A planner whose dynamic candidates measured ``means`` (every step the same), whose shaped trees realised
    ``shaped_ratio`` of the rank model's prediction."""
    planner = TreePlanner.start(B(start), SharedMeasurements())
    measured = {B(config): drafts for config, drafts in means.items()}
    measured[planner.accepted.base] = measured.get(planner.accepted.base, 0)
    for _ in range(200):
        planner.accepted.observe(measured)
    planner.calibration = Calibration(1.0)
    planner.calibration.observe(shaped_ratio * 1000.0, 1000.0)
    return planner


@pytest.mark.parametrize("bound", [Bound(16, 4), Bound(40, 6), Bound(64, 8), Bound(96, 10), Bound(12, 3)])
@pytest.mark.parametrize("shaped_ratio", [0.3, 1.0])
def test_the_choice_within_a_bound_fits_it_and_expects_the_most(bound, shaped_ratio):
    planner = planner_with("64:0.0:8", MEANS, shaped_ratio)
    hazard = HazardProfile(16, 0.9)
    chosen, expected = planner.choose(hazard, bound)
    assert bound.fits(chosen) and planner.current == chosen
    assert tree_size(planner.shaped.widths) <= bound.tokens and len(planner.shaped.widths) <= bound.depth
    expectations = planner.expectations(hazard)
    assert expected == pytest.approx(expectations[chosen])
    assert all(expected >= e for c, e in expectations.items() if bound.fits(c))


def test_a_tight_bound_leaves_the_shaped_tree_and_a_loose_one_the_largest_dynamic_tree():
    hazard = HazardProfile(16, 0.9)
    tight, _ = planner_with("64:0.0:8", MEANS, 1.0).choose(hazard, Bound(12, 3))  # no dynamic candidate fits
    loose, _ = planner_with("64:0.0:8", MEANS, 0.3).choose(hazard, Bound(96, 10))
    assert tight.kind == SHAPED
    assert (loose.kind, loose.budget) == (DYNAMIC, B("96:0.0:10"))


def test_a_session_on_shaped_trees_rechecks_its_largest_dynamic_tree_within_the_bound():
    hazard = HazardProfile(16, 0.9)
    shaped = planner_with("64:0.0:8", MEANS, shaped_ratio=3.0)  # its shaped trees realised 3x the model's E
    chosen, _ = shaped.choose(hazard, Bound(64, 8))
    proposals = [shaped.proposal(Bound(64, 8)) for _ in range(2 * RECHECK_EVERY)]
    recheck = Candidate.dynamic(B("64:0.0:8"))  # the largest of the grid's dynamic trees within (64, 8)
    assert chosen.kind == SHAPED
    assert proposals == ([chosen] * (RECHECK_EVERY - 1) + [recheck]) * 2
    assert {shaped.proposal(Bound(12, 3)) for _ in range(2 * RECHECK_EVERY)} == {chosen}  # no dynamic tree fits
    dynamic = planner_with("64:0.0:8", MEANS, shaped_ratio=0.3)
    chosen, _ = dynamic.choose(hazard, Bound(64, 8))
    assert chosen.kind == DYNAMIC and {dynamic.proposal(Bound(64, 8)) for _ in range(2 * RECHECK_EVERY)} == {chosen}


def test_a_dynamic_budget_nobody_measured_is_expected_to_accept_as_the_best_static_tree_within_it():
    planner = TreePlanner.start(B("32:0.0:10"), SharedMeasurements())
    hazard = HazardProfile(16, 0.9)
    for ranks in ([0, 0, 1, 0, 2, 0], [0, 1, 0, 0], [1, 0, 0, 0, 0, 0, 0, 1]):  # paths that pass at rank 1 and 2
        hazard.observe(ranks, stop_width=1)
    planner.choose(hazard, Bound(32, 10))
    passes, expectations = hazard.pass_table(planner.max_depth), planner.expectations(hazard)
    shaped = planner.shaped
    assert shaped.widths != [1] * len(shaped.widths)  # the climb left the chain, the uniform tree of 32:0.0:10
    for candidate, expected in expectations.items():
        if candidate.kind == DYNAMIC and candidate.tokens >= shaped.tokens and candidate.depth >= shaped.depth:
            assert expected >= expectations[shaped] - 1e-9
    deep = Candidate.dynamic(B("32:0.0:10"))
    assert expectations[deep] > expected_tokens(passes, [1] * 10)  # more than the chain's E


def test_a_session_whose_paths_stop_early_borrows_the_global_gain_of_a_larger_tree_in_proportion():
    small, large = B("16:0.0:4"), B("64:0.0:8")
    shared = AcceptanceTracker(decay=1.0)
    for _ in range(50):  # other requests' text: 4 drafts a step from the small tree, 6 from the large one
        shared.observe({small: 4, large: 6}, small)
    guess = {small: 4.0, large: 6.0}.__getitem__
    hard, easy = (SessionAcceptance(small, 1.0, shared) for _ in range(2))
    for _ in range(30):
        hard.observe({small: 1})  # its text: paths stop early
    for _ in range(30):
        easy.observe({small: 4})
    global_gain = shared.difference(large, 2.0)
    hard_gain = hard.mean(large, guess) - hard.mean(small, guess)
    assert hard_gain == pytest.approx(global_gain * hard.mean(small, guess) / shared.mean(small, 4.0))
    assert 0 < hard_gain < 0.5 * global_gain
    assert easy.mean(large, guess) - easy.mean(small, guess) > 2 * hard_gain


def test_a_larger_tree_measured_on_short_paths_is_not_expected_below_the_base_once_paths_lengthen():
    """At temperature 0 a dynamic tree that contains the base accepts at least what the base does on the same
    step; its old measurements, on text whose paths were short, must not put it under the base's new mean."""
    small, large = B("16:0.0:4"), B("64:0.0:8")
    shared = AcceptanceTracker(decay=0.995)
    session = SessionAcceptance(small, 0.97, shared)
    guess = {small: 1.0, large: 1.5}.__getitem__
    for _ in range(10):  # short paths: both trees accept one draft
        session.observe({small: 1, large: 1})
    for _ in range(40):  # then every path reaches the small tree's last depth; the large tree is not proposed
        session.observe({small: 4})
    assert shared.mean(large, 1.5) < shared.mean(small, 1.0) - 2  # its absolute mean is of the old text
    assert shared.difference(large, 0.5) == pytest.approx(0.5 * 3 / (sum(0.995**k for k in range(10)) + 3))
    assert session.mean(large, guess) >= session.mean(small, guess)
    session.observe({small: 4, large: 7})  # a probe: the large tree takes three drafts more
    assert session.mean(large, guess) > session.mean(small, guess) + 0.2


def test_the_probes_are_nested_and_the_last_contains_every_candidate():
    planner = TreePlanner.start(B("24:0.05:11"), SharedMeasurements())
    expected = ["16:0.0:6", "24:0.0:11", "32:0.0:11", "48:0.0:11", "64:0.0:11", "96:0.0:11"]
    assert planner.probes == tuple(Candidate.dynamic(B(config)) for config in expected)
    for probe in planner.probes:  # each measures every candidate no larger than it (counterfactual_accepted)
        inside = [c for c in planner.dynamic if c.budget.total_tokens <= probe.budget.total_tokens]
        assert all(c.depth <= probe.depth and c.budget.threshold >= probe.budget.threshold for c in inside)


def simulate(cost: StepCostModel, start: str, sessions: int, steps: int, seed: int) -> list[Candidate]:
    """Sessions one after another on one runtime's shared measurements, each a batch of one: the batch chooses
    its bound and the session its tree within it every 4 steps, and the batch says when the session probes (the
    session itself when it rechecks); the candidate each ends with."""
    shared, global_hazard, rng = SharedMeasurements(), HazardProfile(32, 0.995), random.Random(seed)
    batch_plan, batch, ends = BatchPlanner(), BatchCost(cost, batch=1, context_tokens=0), []
    for _ in range(sessions):
        planner, hazard = TreePlanner.start(B(start), shared), HazardProfile(32, 0.9, prior=global_hazard)
        for step in range(steps):
            if step % 4 == 0:
                outlook = SessionOutlook(planner.expectations(hazard), fixed=False)
                planner.choose(hazard, batch_plan.choose(planner.bounds(), [outlook], batch))
            world = World(random.Random(rng.random()))
            probe = batch_plan.affordable_probe(planner.probes, batch) if batch_plan.prober(1) is not None else None
            proposed = probe or planner.proposal(batch_plan.bound)
            tree, paths = grow(world, list(proposed.plan), proposed.budget)
            ranks, stop_width = verify(world, tree, paths)
            hazard.observe(ranks, stop_width)
            planner.observe(tree, proposed, ranks)
        ends.append(planner.current)
    return ends


@pytest.mark.parametrize(
    ("cost", "start", "best"),
    [
        # In this world the draft's confidence varies from node to node, so EAGLE-2's dynamic tree beats every
        # static shape of its size. Measured over 2,000 steps, tokens per second: flat verify, 96:0.0:10 4.41
        # (64:0.0:8 4.25); steep verify, 16:0.0:4 2.34 (32:0.0:6 2.24, the best shaped tree <= 2.0).
        (StepCostModel(default_slope=0.0, draft_seconds_per_depth=0.01), "16:0.0:4", "96:0.0:10"),
        (StepCostModel(default_slope=0.02, draft_seconds_per_depth=0.03), "64:0.0:8", "16:0.0:4"),
    ],
    ids=["flat-verify", "steep-verify"],
)
def test_online_converges_to_the_best_full_tree(cost, start, best):
    ends = simulate(cost, start, sessions=8, steps=64, seed=3)
    assert all(c.kind == DYNAMIC for c in ends), [c.budget for c in ends]
    # on the steep verify the next size up (4% slower) is probed, so one session's noise may end there
    assert sum(c.budget == B(best) for c in ends[2:]) >= 5, [c.budget for c in ends]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("recheck_every", [RECHECK_EVERY, 10**9], ids=["rechecks", "never"])
def test_rechecks_bring_a_session_back_to_the_dynamic_tree_it_once_undersold(recheck_every, seed, monkeypatch):
    """In the synthetic world EAGLE-2's tree beats every static shape of its size (see the convergence test). A
    session whose first dynamic steps accepted nothing takes shaped trees; rechecking the dynamic tree within the
    bound brings it back, and without rechecks it never measures that tree again."""
    monkeypatch.setattr(tree_plan, "RECHECK_EVERY", recheck_every)
    planner, hazard = TreePlanner.start(B("32:0.0:10"), SharedMeasurements()), HazardProfile(32, 0.9)
    bound = Bound(32, 10)
    for _ in range(4):  # an unlucky start
        planner.accepted.observe({b: 0 for b in [planner.accepted.base, *(c.budget for c in planner.dynamic)]})
    rng, kinds = random.Random(seed), []
    for step in range(160):
        if step % 4 == 0:
            kinds.append(planner.choose(hazard, bound)[0].kind)
        proposed = planner.proposal(bound)
        tree, paths = grow(world := World(random.Random(rng.random())), list(proposed.plan), proposed.budget)
        ranks, stop_width = verify(world, tree, paths)
        hazard.observe(ranks, stop_width)
        planner.observe(tree, proposed, ranks)
    assert kinds[0] == SHAPED
    assert kinds[-4:] == ([DYNAMIC] * 4 if recheck_every == RECHECK_EVERY else [SHAPED] * 4), kinds
