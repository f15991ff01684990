"""The batch's bound for online sessions: chosen by predicted tokens per second over the padded verify, worth at
least every fixed configuration, shrinking as the batch grows on a compute-bound verify, with hysteresis and a
margin for a dearer step, a start from the own budgets, and probes only where the batch can afford them, backing
off while the bound stays."""

from __future__ import annotations

import pytest

from draft_service.batch_plan import (
    MOVE_RISK,
    PLAN_HYSTERESIS,
    PROBE_EVERY,
    PROBE_EVERY_MAX,
    REPLAN_EVERY,
    START_STEPS,
    BatchCost,
    BatchPlanner,
    BoundPrediction,
    SessionOutlook,
)
from draft_service.hazard import HazardProfile, StepCostModel
from draft_service.tree_budget import TreeBudget
from draft_service.tree_plan import CANDIDATE_GRID, Bound, Candidate
from tests.draft_service.test_tree_plan import MEANS, planner_with

GRID_BOUNDS = [Bound(b.total_tokens, b.depth) for b in CANDIDATE_GRID]


def measured(points: dict[int, float], draft_seconds_per_depth: float = 0.0002) -> StepCostModel:
    """A cost model that measured ``points`` (padded rows -> verify seconds)."""
    cost = StepCostModel(draft_seconds_per_depth=draft_seconds_per_depth, draft_measured=True)
    for rows, seconds in points.items():
        cost.observe_verify(rows, seconds)
    return cost


# Flat while the weights' read dominates, then about 17 us per row (as an 8B target's verify on an H200).
KNEE = measured({1: 0.0062, 64: 0.0064, 256: 0.0068, 1024: 0.0200, 2048: 0.0375})
FLAT = measured({1: 0.0062, 4096: 0.0063})


def outlooks(sessions: int, means: dict[str, float] = MEANS) -> list[SessionOutlook]:
    """``sessions`` like online sessions that measured ``means``; their shaped trees realise half the model's E."""
    expectations = planner_with("64:0.0:8", means, shaped_ratio=0.5).expectations(HazardProfile(16, 0.9))
    return [SessionOutlook(expectations, False)] * sessions


def expected(bound: Bound, looks: list[SessionOutlook]) -> float:
    """The batch's tokens per step within ``bound``, online sessions alone: the sum of their E_s."""
    return sum(max((e for c, e in o.expectations.items() if bound.fits(c)), default=1.0) for o in looks)


def value(bound: Bound, looks: list[SessionOutlook], cost: BatchCost) -> float:
    """The module's V(T, D) for online sessions alone, written out."""
    return expected(bound, looks) / cost.step_seconds(bound).total


@pytest.mark.parametrize("cost", [KNEE, FLAT], ids=["knee", "flat"])
@pytest.mark.parametrize("sessions", [1, 4, 16])
def test_the_bound_is_worth_at_least_every_fixed_configuration(cost, sessions):
    looks, batch = outlooks(sessions), BatchCost(cost, sessions, 2048)
    chosen = BatchPlanner().choose(GRID_BOUNDS, looks, batch)
    assert all(value(chosen, looks, batch) >= value(b, looks, batch) for b in GRID_BOUNDS)


def test_sixteen_sessions_on_a_compute_bound_verify_get_a_smaller_bound_than_one():
    alone = BatchPlanner().choose(GRID_BOUNDS, outlooks(1), BatchCost(KNEE, 1, 2048))
    sixteen = BatchPlanner().choose(GRID_BOUNDS, outlooks(16), BatchCost(KNEE, 16, 2048))
    on_flat = BatchPlanner().choose(GRID_BOUNDS, outlooks(16), BatchCost(FLAT, 16, 2048))
    assert alone.tokens >= 64 and on_flat.tokens >= 64
    assert sixteen == Bound(16, 4)


def test_a_fixed_sessions_tree_pads_the_batch_so_online_trees_fill_up_to_it():
    """Beside a fixed 64-token tree every bound up to 64 costs the same verify: the online sessions take what
    expects most within it rather than shrinking for nothing."""
    fixed = Candidate.dynamic(TreeBudget.parse("64:0.0:8"))
    looks = [*outlooks(15), SessionOutlook({fixed: 4.0}, True)]
    chosen = BatchPlanner().choose(GRID_BOUNDS, looks, BatchCost(KNEE, 16, 2048))
    assert chosen == Bound(64, 8)


def test_hysteresis_keeps_a_near_equal_bound_and_yields_to_a_clear_gain():
    looks, planner = outlooks(1, {**MEANS, "96:0.0:10": 3.25}), BatchPlanner()  # E 4.25 against 4.2
    flat = BatchCost(measured({1: 0.0062}, draft_seconds_per_depth=0.0), 1, 2048)  # value ~ E
    planner.bound = Bound(64, 8)
    assert value(Bound(96, 10), looks, flat) > value(Bound(64, 8), looks, flat)  # better, by under 3%
    assert value(Bound(96, 10), looks, flat) < value(Bound(64, 8), looks, flat) * (1 + PLAN_HYSTERESIS)
    assert planner.choose(GRID_BOUNDS, looks, flat) == Bound(64, 8)
    assert planner.choice is not None  # the call was close: the best other bound was the one not taken
    assert planner.choice.runner_up_tokens_per_second == value(Bound(96, 10), looks, flat)
    knee = BatchCost(KNEE, 16, 2048)
    assert planner.choose(GRID_BOUNDS, outlooks(16), knee) == Bound(16, 4)


# A verify that costs 25% more for 96 tree tokens than for 64 or fewer; no draft cost.
STEEP = BatchCost(measured({1: 0.0040, 64: 0.0040, 128: 0.0060}, draft_seconds_per_depth=0.0), 1, 2048)


@pytest.mark.parametrize(("drafts_96", "moves"), [(4.6, False), (5.4, True)])
def test_a_move_to_a_dearer_step_clears_a_margin_that_grows_with_how_much_dearer_it_is(drafts_96, moves):
    looks, planner = outlooks(1, {**MEANS, "96:0.0:10": drafts_96}), BatchPlanner()
    planner.bound = Bound(64, 8)
    dearer = STEEP.step_seconds(Bound(96, 10)).total / STEEP.step_seconds(Bound(64, 8)).total - 1
    gain = value(Bound(96, 10), looks, STEEP) / value(Bound(64, 8), looks, STEEP) - 1
    assert dearer == pytest.approx(0.25) and gain > PLAN_HYSTERESIS  # past the hysteresis alone either way
    assert (gain > PLAN_HYSTERESIS + MOVE_RISK * dearer) == moves
    assert planner.choose(GRID_BOUNDS, looks, STEEP) == (Bound(96, 10) if moves else Bound(64, 8))


def test_a_move_to_a_cheaper_step_needs_the_hysteresis_alone():
    looks, planner = outlooks(1, {**MEANS, "96:0.0:10": 3.8}), BatchPlanner()  # 64:0.0:8 worth 9% more
    planner.bound = Bound(96, 10)
    assert planner.choose(GRID_BOUNDS, looks, STEEP) == Bound(64, 8)


def test_the_best_move_that_clears_its_margin_is_taken_where_the_most_valuable_one_does_not():
    looks, planner = outlooks(1, {**MEANS, "96:0.0:10": 4.6}), BatchPlanner()
    planner.bound = Bound(48, 8)  # 64:0.0:8 is 5% more at the same cost; 96:0.0:10 12% more at a 25% dearer step
    assert max(GRID_BOUNDS, key=lambda bound: value(bound, looks, STEEP)) == Bound(96, 10)
    assert planner.choose(GRID_BOUNDS, looks, STEEP) == Bound(64, 8)


@pytest.mark.parametrize("sessions", [1, 16])
def test_a_choice_keeps_what_it_predicted_for_its_bound_and_the_best_other_bounds_value(sessions):
    looks, batch, planner = outlooks(sessions), BatchCost(KNEE, sessions, 2048), BatchPlanner()
    chosen = planner.choose(GRID_BOUNDS, looks, batch)
    assert planner.choice is not None
    predicted = BoundPrediction(expected(chosen, looks), batch.step_seconds(chosen), sessions, 2048)
    assert planner.choice.predicted == predicted
    assert planner.choice.predicted.tokens_per_second == value(chosen, looks, batch)
    others = [value(b, looks, batch) for b in GRID_BOUNDS if b != chosen]
    assert planner.choice.runner_up_tokens_per_second == max(others)


def test_a_start_predicts_for_its_bound_and_scores_no_other():
    looks, batch, planner = outlooks(3), BatchCost(KNEE, 3, 2048), BatchPlanner()
    start = planner.start([Bound(24, 5), Bound(64, 8)], looks, batch)
    assert planner.choice is not None and planner.choice.runner_up_tokens_per_second is None
    assert planner.choice.predicted == BoundPrediction(expected(start, looks), batch.step_seconds(start), 3, 2048)


def test_a_batch_starts_from_the_largest_own_budget_and_chooses_again_when_due():
    planner = BatchPlanner()
    assert planner.due(3)
    own_budgets = [Bound(24, 5), Bound(64, 8), Bound(48, 10)]
    assert planner.start(own_budgets, outlooks(3), BatchCost(KNEE, 3, 2048)) == Bound(64, 10)
    for _ in range(START_STEPS):
        assert not planner.due(3)
        planner.step()
    assert planner.due(3)
    planner.choose(GRID_BOUNDS, outlooks(3), BatchCost(KNEE, 3, 2048))
    assert not planner.due(2)  # 2 and 3 share a power of two
    assert planner.due(4)  # the batch crossed one: the verify cost moved
    for _ in range(REPLAN_EVERY):
        planner.step()
    assert planner.due(3)


PROBES = tuple(Candidate.dynamic(budget) for budget in CANDIDATE_GRID)  # nested, as a planner's of the grid


@pytest.mark.parametrize(
    ("cost", "batch", "bound", "probe"),
    [
        # 512 rows for the next size up already cost 1.6x the bound's 256; the deeper 16-token tree's cost the same
        (KNEE, 16, Bound(16, 4), "16:0.0:6"),
        (KNEE, 16, Bound(16, 6), None),
        (KNEE, 4, Bound(16, 4), "64:0.0:8"),  # 256 rows: the weights' read; 96's 384 rows cost 1.4x
        (KNEE, 1, Bound(16, 4), "96:0.0:10"),  # 96 rows: still the weights' read
        (FLAT, 16, Bound(16, 4), "96:0.0:10"),
        (FLAT, 16, Bound(64, 8), "96:0.0:10"),
        (FLAT, 16, Bound(96, 10), None),  # nothing past the bound
    ],
)
def test_the_probe_is_the_largest_past_the_bound_whose_padded_verify_stays_cheap(cost, batch, bound, probe):
    planner = BatchPlanner()
    planner.bound = bound
    chosen = planner.affordable_probe(PROBES, BatchCost(cost, batch, 2048))
    assert (chosen.budget.config if chosen else None) == probe
    assert planner.probes.unjudged == (probe is not None)  # one that did not go ahead leaves nothing to judge


def probes_made(
    planner: BatchPlanner, proposals: range, bound: Bound, batch: int = 1, start: bool = False
) -> list[tuple[int, int]]:
    """(proposal, prober) of each probe that goes ahead over ``proposals``, the calls in the runtime's order: a
    batch of ``batch`` online sessions starts from ``bound`` (its first proposal, or the range's first with
    ``start``) and is offered ``bound`` alone at each choice after; the verify is flat, so every probe goes ahead."""
    made = []
    for proposal in proposals:
        cost = BatchCost(FLAT, batch, 2048)
        if planner.bound is None or (start and proposal == proposals.start):
            planner.start([bound], outlooks(batch), cost)
        elif planner.due(batch):
            planner.choose([bound], outlooks(batch), cost)
        planner.step()
        prober = planner.prober(batch)
        if prober is not None and planner.affordable_probe(PROBES, cost) is not None:
            made.append((proposal, prober))
    return made


@pytest.mark.parametrize(
    ("then", "probes"),
    [
        ({"bound": Bound(16, 4)}, [(247, 0)]),  # 64 after the last: the cap
        ({"bound": Bound(64, 8)}, [(200, 0), (216, 0), (248, 0)]),  # 17 since the last: due at once, then 16, 32
        ({"bound": Bound(16, 4), "batch": 2}, [(200, 1), (216, 0), (248, 1)]),  # the two sessions in turn
        ({"bound": Bound(16, 4), "start": True}, [(207, 0), (223, 0), (255, 0)]),  # counted from the start
    ],
    ids=["the bound stays", "a new bound", "the batch crosses a power of two", "a new batch"],
)
def test_probes_back_off_while_the_bound_stays_and_start_over_when_it_moves(then, probes):
    planner = BatchPlanner()
    # a probe in the 8th proposal, then each choice after a probe keeps the bound: 16, 32, 64, 64 apart
    assert probes_made(planner, range(200), Bound(16, 4)) == [(7, 0), (23, 0), (55, 0), (119, 0), (183, 0)]
    assert planner.probes.interval == PROBE_EVERY_MAX
    assert probes_made(planner, range(200, 300), **then) == probes
    assert planner.bound == then["bound"]


def test_a_proposal_without_online_sessions_is_no_probe_turn():
    planner = BatchPlanner()
    assert [planner.prober(0) for _ in range(2 * PROBE_EVERY)] == [None] * (2 * PROBE_EVERY)
    assert [planner.prober(3) for _ in range(PROBE_EVERY)] == [None] * (PROBE_EVERY - 1) + [0]


def test_what_every_step_costs_besides_weighs_a_larger_tree_fairly():
    """A step's overhead (the accept, host work, the loop) is paid by every tree alike; counted, a larger tree's
    dearer verify is weighed against the whole step, and a single session then takes a larger bound."""
    chosen = []
    for overhead in (0.0, 0.008):
        cost = measured({1: 0.0062, 16: 0.0066, 64: 0.0090, 256: 0.0150}, draft_seconds_per_depth=0.00025)
        cost.step_overhead_seconds = overhead
        batch = BatchCost(cost, 1, 32768)
        assert batch.step_seconds(Bound(64, 8)).total == pytest.approx(overhead + 8 * 0.00025 + 0.0090)
        chosen.append(BatchPlanner().choose(GRID_BOUNDS, outlooks(1), batch))
    assert chosen == [Bound(32, 6), Bound(64, 8)]


def test_a_bound_is_priced_at_the_rows_of_the_step_graph_its_verify_runs_in():
    cost = StepCostModel()
    cost.seed_verify({(b, t): 0.001 * b * t / 64 for b in (1, 2, 4) for t in (16, 64, 128)})
    three = BatchCost(cost, 3, 2048)
    assert three.verify_seconds(96) == pytest.approx(0.001 * 512 / 64)  # the (4, 128) graph, not 288 rows
    assert three.verify_seconds(16) == pytest.approx(0.001 * 64 / 64)  # the (4, 16) graph
    assert three.verify_seconds(96) == three.verify_seconds(128)  # one bucket: one price
