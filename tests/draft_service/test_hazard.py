"""Hazard estimates on synthetic stop-depth streams, and the tree budget they imply."""

from __future__ import annotations

import random

import pytest

from draft_service.hazard import (
    EPS,
    HazardProfile,
    StepCostModel,
    climb,
    expected_tokens,
    tree_size,
    widths_to_plan,
)
from draft_service.batch_plan import PLAN_HYSTERESIS, BatchCost
from draft_service.tree_plan import Bound


def simulate_step(rng: random.Random, rank_probs: list[list[float]], widths: list[int]) -> tuple[list[int], int]:
    """(ranks passed per depth, children at the stop) for a path drawn from true rank distributions."""
    ranks = []
    for depth, width in enumerate(widths):
        probs = rank_probs[min(depth, len(rank_probs) - 1)]
        draw, rank = rng.random(), None
        for r, p in enumerate(probs):
            draw -= p
            if draw < 0:
                rank = r
                break
        if rank is None or rank >= width:
            return ranks, width
        ranks.append(rank)
    return ranks, 0


EASY = [0.9, 0.05, 0.02]  # top-1 almost always right
HARD = [0.35, 0.2, 0.15, 0.1, 0.08]  # top-1 often wrong, lower ranks rescue the path


def shaped_value(profile, cost, batch=1):
    """Tokens per second of a static tree of widths w proposed by each of ``batch`` like sessions, verified
    together (batch x tree tokens rows)."""
    passes, verify = profile.pass_table(8), cost.verify_curve(0)

    def value(widths):
        seconds = len(widths) * cost.draft_seconds_per_depth + verify(batch * tree_size(widths))
        return batch * expected_tokens(passes, widths) / seconds

    return value


def settle(profile, cost, batch=1, widths=(1,)):
    """Climb from ``widths`` until no move helps."""
    return climb(shaped_value(profile, cost, batch), list(widths), max_tokens=64, max_depth=8, moves=1000)


def run_stream(profile, cost, rank_probs, steps, seed=0, history=None):
    """A session re-planning every step as the online planner does: a few climbing moves from the last
    climb, proposed once it beats the proposed plan by the hysteresis."""
    rng = random.Random(seed)
    climbed = proposed = [1]
    for _ in range(steps):
        value = shaped_value(profile, cost)
        climbed = climb(value, climbed, max_tokens=64, max_depth=8)
        if value(climbed) > value(proposed) * (1 + PLAN_HYSTERESIS):
            proposed = climbed
        if history is not None:
            history.append(proposed)
        profile.observe(*simulate_step(rng, rank_probs, proposed))
    return proposed


def test_width_moves_to_the_hard_depth_and_converges():
    profile = HazardProfile(max_depth=16, decay=0.97, prior=HazardProfile(16, 0.999))
    history: list[list[int]] = []
    widths = run_stream(profile, StepCostModel(), [EASY, HARD, EASY, EASY, EASY], 600, history=history)
    assert len(widths) >= 3
    assert widths[1] > widths[0] and widths[1] > widths[2], widths
    assert all(h == history[-1] for h in history[-40:]), "the plan keeps changing under a stationary stream"
    top1_hazard = profile.hazard([1, 1, 1])  # the estimate found the hard depth...
    assert top1_hazard[1] == max(top1_hazard) and top1_hazard[1] > 0.5
    assert profile.hazard(widths)[1] < top1_hazard[1] - 0.3  # ...and the wide fan there rescues the path


def test_depth_stops_where_survival_no_longer_pays():
    cost = StepCostModel(default_intercept=1.0, default_slope=0.05, draft_seconds_per_depth=0.2)
    profile = HazardProfile(max_depth=16, decay=0.97)
    cliff = [EASY, EASY, [0.05, 0.02]]  # past depth 2, drafts are almost never accepted
    widths = run_stream(profile, cost, cliff, 400)
    assert len(widths) <= 3, widths


def test_estimates_adapt_to_a_regime_change():
    profile = HazardProfile(max_depth=16, decay=0.95)
    run_stream(profile, StepCostModel(), [EASY], 300, seed=1)
    easy_hazard = profile.hazard([1])[0]
    run_stream(profile, StepCostModel(), [HARD], 100, seed=2)
    assert profile.hazard([1])[0] > easy_hazard + 0.3


@pytest.mark.parametrize("outcome", ["always-pass", "always-stop"])
def test_estimates_never_reach_zero_or_one(outcome):
    profile = HazardProfile(max_depth=4, decay=0.99)
    for _ in range(2000):
        profile.observe(*(([0, 0, 0, 0], 0) if outcome == "always-pass" else ([], 3)))
    for d in range(1, 6):
        assert EPS <= profile.pass_probability(d, 1) <= 1 - EPS


def test_prior_weighs_in_until_the_request_has_evidence():
    prior = HazardProfile(max_depth=8, decay=1.0)
    for _ in range(500):
        prior.observe([], stop_width=1)  # the global stream: depth 1 always fails
    fresh = HazardProfile(max_depth=8, decay=0.9, prior=prior)
    assert fresh.hazard([1])[0] > 0.9
    for _ in range(60):
        fresh.observe([0, 0], stop_width=0)  # this request: depth 1 always passes
    assert fresh.hazard([1])[0] < 0.3


@pytest.mark.parametrize("observer", ["none", "request", "prior", "both"])
def test_estimates_read_once_follow_every_later_step(observer):
    """The rates and the pass table are kept between steps (every session's plan reads the shared prior's); a
    step observed by the request or by its prior alone must give exactly what a profile never read gives."""
    steps = [([0, 1], 2), ([], 3), ([2, 0, 0], 0), ([0], 1)]

    def profiles() -> tuple[HazardProfile, HazardProfile]:
        prior = HazardProfile(max_depth=6, decay=0.99)
        request = HazardProfile(max_depth=6, decay=0.9, prior=prior)
        for ranks, stop_width in steps:
            request.observe(ranks, stop_width)
        return prior, request

    read_prior, read = profiles()
    read.pass_table(8)  # depths past max_depth come from the prior
    fresh_prior, fresh = profiles()
    for prior, request in ((read_prior, read), (fresh_prior, fresh)):
        if observer in ("request", "both"):
            request.observe([1, 0], 3)
        if observer in ("prior", "both"):
            prior.observe([], 1)  # another request's step
    assert read.pass_table(8) == fresh.pass_table(8)
    assert [read.fail_rates(d) for d in range(1, 9)] == [fresh.fail_rates(d) for d in range(1, 9)]
    assert read_prior.fail_rates(1) == fresh_prior.fail_rates(1)


def test_censored_steps_do_not_count_as_stops():
    profile = HazardProfile(max_depth=4, decay=1.0)
    for _ in range(100):
        profile.observe([0, 0], stop_width=0)  # ran off the end of a depth-2 tree
    assert sum(profile.depths[2].tried) == 0 and profile.depths[1].failed[0] == 0


def test_a_compute_bound_batch_gets_smaller_trees():
    """Like sessions verified together: at a cost where 100 rows double a step, the plan that pays for itself
    alone is too big for a batch."""
    profile = HazardProfile(max_depth=16, decay=0.97, prior=HazardProfile(16, 0.999))
    run_stream(profile, StepCostModel(), [EASY, HARD, EASY], 300)
    cost = StepCostModel(default_intercept=1.0, default_slope=0.01, draft_seconds_per_depth=0.02)
    alone = settle(profile, cost)
    sizes = [tree_size(alone)]
    for batch in (2, 4, 8, 16):
        sizes.append(tree_size(settle(profile, cost, batch, alone)))
    assert sizes == sorted(sizes, reverse=True), sizes  # more tokens beside it, never a larger tree
    assert sizes[0] >= 16 and sizes[-1] < sizes[0], sizes


def test_a_climb_scores_a_bounded_number_of_plans():
    profile = HazardProfile(max_depth=16, decay=0.97)
    passes, scored = profile.pass_table(8), []
    widths = climb(lambda w: scored.append(w) or expected_tokens(passes, w), [1] * 8, 64, 8, moves=3)
    assert widths != [1] * 8  # value = E: every move widens
    assert len(scored) <= 1 + 3 * (2 * 8 + 2)


def test_verify_cost_interpolates_between_measured_rows_and_is_flat_past_them():
    cost = StepCostModel(decay=0.5)
    for rows, seconds in ((16, 0.010), (256, 0.012), (1024, 0.030)):
        cost.observe_verify(rows, seconds)
    assert cost.verify_seconds(256) == pytest.approx(0.012)
    assert cost.verify_seconds(640) == pytest.approx(0.021)  # halfway from 256 to 1024
    assert cost.verify_seconds(4) == pytest.approx(0.010) and cost.verify_seconds(4096) == pytest.approx(0.030)
    cost.observe_verify(1024, 0.040)  # a size's mean decays only when that size is measured again
    assert cost.verify_seconds(1024) == pytest.approx((0.5 * 0.030 + 0.040) / 1.5)
    assert cost.verify_seconds(16) == pytest.approx(0.010)


def test_plan_shapes():
    assert tree_size([1, 1, 1]) == 4
    assert tree_size([4, 2]) == 1 + 4 + 8
    plan = widths_to_plan([4, 2, 1])
    assert [(p.expand, p.children) for p in plan] == [(1, 4), (4, 2), (2, 1)]


@pytest.mark.parametrize("decay", [0.9, 0.01])  # 0.01 folds the decay scale into the counts every 100 steps
def test_decay_by_scale_equals_decaying_every_count(decay):
    """A step decays every count; the profile does it by shrinking one scale, which must give the same
    rates as multiplying each count, also across the fold that keeps the scale from underflowing."""
    rng = random.Random(7)
    lazy = HazardProfile(6, decay)
    tried = [[0.0] * 10 for _ in range(6)]
    failed = [[0.0] * 10 for _ in range(6)]
    for _ in range(250):
        ranks, stop_width = simulate_step(rng, [HARD], [4, 3, 2, 2, 1, 1])
        lazy.observe(ranks, stop_width)
        tried = [[c * decay for c in row] for row in tried]
        failed = [[c * decay for c in row] for row in failed]
        for depth, (rank, passed) in enumerate(([(r, True) for r in ranks] + [(stop_width, False)])[:6]):
            for r in range(min(rank + 1 if passed else rank, 10)):
                tried[depth][r] += 1
                failed[depth][r] += 0 if passed and r == rank else 1
    for depth in range(1, 7):
        for rank in range(4):
            prior = 0.25 if rank == 0 else 0.7
            want = (failed[depth - 1][rank] + 3.0 * prior) / (tried[depth - 1][rank] + 3.0)
            assert lazy.fail_rate(depth, rank) == pytest.approx(max(EPS, min(1 - EPS, want)), rel=1e-9, abs=1e-12)


def test_verify_cost_is_fitted_per_context_bucket():
    """Each verify is filed under the context of the batch proposed before it; a context never measured
    takes the nearest measured bucket's table."""
    cost = StepCostModel(decay=1.0)
    for context, slope in ((4096, 0.00002), (65536, 0.0001)):
        cost.note_batch(context)
        for n in (16, 32, 64):
            cost.observe_verify(n, 0.008 + slope * n)
    assert cost.verify_seconds(64, 4096) == pytest.approx(0.008 + 0.00002 * 64, rel=1e-9)
    assert cost.verify_seconds(64, 65536) == pytest.approx(0.008 + 0.0001 * 64, rel=1e-9)
    assert cost.verify_seconds(64, 5000) == cost.verify_seconds(64, 4096)  # the same bucket [4096, 8192)
    assert cost.verify_seconds(64, 100_000) == cost.verify_seconds(64, 65536)  # nearest measured
    assert cost.verify_seconds(64, 16384) == cost.verify_seconds(64, 65536)  # equally near: the longer


def test_seeded_verify_costs_shape_the_curve_and_measurements_set_its_level():
    cost = StepCostModel(decay=0.5)
    cost.seed_verify({(1, 64): 0.006, (16, 64): 0.020})  # step graph buckets (batch, tree): 64 and 1024 rows
    assert cost.verify_seconds(544, 65536) == pytest.approx(0.013)  # the seed, linear between its sizes
    cost.note_batch(65536)
    cost.observe_verify(64, 0.016)  # a long context's verify is dearer by 10 ms at 64 rows...
    assert cost.verify_seconds(64, 65536) == pytest.approx(0.016)
    assert cost.verify_seconds(1024, 65536) == pytest.approx(0.030)  # ...and a size never measured by as much
    cost.observe_verify(1024, 0.060)
    assert cost.verify_seconds(1024, 65536) == pytest.approx(0.060)
    assert cost.verify_seconds(544, 65536) == pytest.approx(0.013 + (0.010 + 0.040) / 2)  # excess interpolated
    assert cost.verify_seconds(1024, 100) == pytest.approx(0.060)  # no bucket nearer: the 64K bucket's level
    fresh = StepCostModel()
    fresh.seed_verify({(1, 64): 0.006, (16, 64): 0.020})
    assert fresh.verify_seconds(1024, 100) == pytest.approx(0.020)  # nothing measured: the seed alone


def test_a_seed_averages_buckets_of_equal_rows_and_prices_a_verify_at_its_buckets_rows():
    cost = StepCostModel()
    assert cost.computed_rows(3, 96) == 288  # no graphs known: the trees padded to the widest
    cost.seed_verify({(1, 128): 0.010, (2, 64): 0.014, (4, 128): 0.030, (4, 64): 0.020, (1, 64): 0.008})
    assert cost.tables[0].seed == {64: 0.008, 128: 0.012, 256: 0.020, 512: 0.030}  # 128 rows: two buckets
    assert (cost.graph_batch_sizes, cost.graph_tree_sizes) == ((1, 2, 4), (64, 128))
    assert cost.computed_rows(3, 96) == 512  # three 96-node trees run the (4, 128) graph
    assert cost.computed_rows(2, 64) == 128 and cost.computed_rows(1, 1) == 64
    assert cost.computed_rows(5, 64) == 320  # past the largest batch bucket: no graph, unpadded


def test_step_overhead_is_the_rest_of_a_step_averaged_with_long_steps_bounded():
    cost = StepCostModel()
    assert cost.step_overhead_seconds == 0.0 and not cost.overhead_measured
    cost.observe_step(0.0130, proposal_seconds=0.0020, verify_seconds=0.0080)  # 3 ms besides
    assert cost.overhead_measured and cost.step_overhead_seconds == pytest.approx(0.0030)
    cost.observe_step(0.0120, proposal_seconds=0.0020, verify_seconds=0.0080)  # 2 ms: a tenth of the way
    assert cost.step_overhead_seconds == pytest.approx(0.9 * 0.0030 + 0.1 * 0.0020)
    before = cost.step_overhead_seconds
    cost.observe_step(0.5, proposal_seconds=0.0020, verify_seconds=0.0080)  # a prompt ingested: at most 2x
    assert cost.step_overhead_seconds == pytest.approx(0.9 * before + 0.1 * 2 * before)
    before = cost.step_overhead_seconds
    cost.observe_step(0.0050, proposal_seconds=0.0020, verify_seconds=0.0080)  # overlapping spans: none
    assert cost.step_overhead_seconds == pytest.approx(0.9 * before)
    started = StepCostModel()
    started.observe_step(0.4, proposal_seconds=0.0020, verify_seconds=0.0080)  # a first step with a capture in it
    assert started.overhead_measured and started.step_overhead_seconds == pytest.approx(0.0100)  # its device time


@pytest.mark.parametrize(
    ("observed", "depth", "expected"),
    [
        ({}, 8, 8 * 0.05),  # nothing measured: the default per depth
        ({4: 0.0011}, 8, 8 * 0.0011 / 4),  # one depth: per depth alone, as measured there
        ({4: 0.0011, 8: 0.0019}, 6, 0.0015),  # a fixed 0.3 ms and 0.2 ms a depth
        ({4: 0.0011, 8: 0.0019}, 10, 0.0023),
        ({4: 0.0011, 6: 0.0015, 8: 0.0019}, 2, 0.0007),
        ({4: 0.0012, 8: 0.0011}, 10, 0.00115),  # noise says deeper is cheaper: flat at the mean instead
        ({4: 0.0004, 8: 0.0016}, 2, 2 * (4 * 0.0004 + 8 * 0.0016) / 80),  # would cross zero: per depth, fitted
    ],
)
def test_a_proposals_cost_is_a_fixed_part_plus_a_part_per_depth(observed, depth, expected):
    cost = StepCostModel()
    for depths, seconds in observed.items():
        cost.observe_draft(depths, seconds)
    assert cost.draft_seconds(depth) == pytest.approx(expected)


def test_a_proposals_cost_is_fitted_per_batch_bucket_and_read_at_the_nearest_one_measured():
    """Depth 4 measured at 16 sessions and depth 8 at one: mixed, their line would say depth 8 costs less
    than depth 4; kept apart, each batch's line is its own, and an unmeasured batch reads the nearest."""
    cost = StepCostModel()
    for depths, seconds, batch in ((4, 0.0011, 1), (8, 0.0019, 1), (4, 0.0020, 16), (8, 0.0026, 16)):
        cost.observe_draft(depths, seconds, batch)
    assert sorted(cost.draft_seconds_by_shape) == [(1, 0), (5, 0)]  # bit lengths of 1 and 16, no context
    assert cost.draft_seconds(6, 1) == pytest.approx(0.0015)
    assert cost.draft_seconds(6, 16) == pytest.approx(0.0023)
    assert cost.draft_seconds(6, 12) == cost.draft_seconds(6, 16)  # bucket 4 is nearer 5 than 1
    assert cost.draft_seconds(6, 2) == cost.draft_seconds(6, 1)
    assert cost.draft_seconds(6, 4) == cost.draft_seconds(6, 16)  # bucket 3: as near 1 as 5, the larger taken
    assert BatchCost(cost, 16, 4096).step_seconds(Bound(64, 8)).draft == pytest.approx(0.0026)


def test_a_proposals_cost_is_fitted_per_attended_context_and_read_at_the_nearest_one_measured():
    """A working set's sessions (2,048 entries) and whole-context ones (65,536) on one runtime: each depth of the
    second costs more; mixed, a working set's deep tree would be priced at the whole context's depths."""
    cost = StepCostModel()
    for depths, seconds, attended in ((4, 0.0008, 2048), (8, 0.0012, 2048), (4, 0.0011, 65536), (8, 0.0019, 65536)):
        cost.observe_draft(depths, seconds, 1, attended)
    assert sorted(cost.draft_seconds_by_shape) == [(1, 12), (1, 17)]
    assert cost.draft_seconds(8, 1, 2048) == pytest.approx(0.0012)
    assert cost.draft_seconds(8, 1, 65536) == pytest.approx(0.0019)
    assert cost.draft_seconds(6, 1, 1900) == pytest.approx(0.0010)  # the working set's bucket: [1024, 2048)
    assert cost.draft_seconds(6, 16, 40000) == pytest.approx(0.0015)  # the nearest context first, then batch
    working_set = BatchCost(cost, 1, 65536, attended_tokens=2048).step_seconds(Bound(16, 8))
    assert working_set.draft == pytest.approx(0.0012)


def test_shallow_proposals_do_not_price_deep_ones_by_their_own_per_depth_cost():
    """Mostly depth-4 proposals with a few depth-8 probes: depth 8 costs what it was measured at, not twice
    depth 4's cost (the per-depth average, dominated by the shallow proposals, says about that)."""
    cost = StepCostModel()
    for _ in range(30):
        cost.observe_draft(4, 0.0011)
    cost.observe_draft(8, 0.0019)
    assert cost.draft_seconds_per_depth * 8 > 0.0021  # what pricing per depth alone predicts
    assert cost.draft_seconds(8) == pytest.approx(0.0019)
    assert BatchCost(cost, 1, 4096).step_seconds(Bound(64, 8)).total == pytest.approx(
        cost.step_overhead_seconds + 0.0019 + cost.verify_seconds(64, 4096))
