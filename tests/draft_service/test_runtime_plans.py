"""The draft runtime's plans for a batch of online sessions on the bundled head (CPU): the trees it asks the
device proposal for, how often it re-plans, probes and hands verified trees to the planners, and its audit of the
bounds."""

from __future__ import annotations

import collections
import time
from typing import Callable, Iterator

import pytest
import torch

from diffspec.tree import DraftTree, PendingTree

from draft_service.backend import DraftAccept, DraftBatch, DraftStart, VerifyCost
from draft_service.options import DraftOptions
from draft_service.batch_plan import PROBE_EVERY, REPLAN_EVERY, START_STEPS
from draft_service.runtime import OBSERVED_PER_STEP, DraftRuntime
from draft_service.tree_budget import TreeBudget
from draft_service.tree_plan import CANDIDATE_GRID, DYNAMIC, Bound, Candidate, TreePlanner
from tests.draft_service.test_drafter import load_head

SESSIONS, STEPS = 6, 2 * PROBE_EVERY
FLAT_VERIFY_SECONDS = 0.01  # one size measured: every size costs the same
DRAFT_SECONDS_PER_DEPTH = 0.001


@pytest.fixture
def planning_runtime(monkeypatch) -> DraftRuntime:
    """A runtime over the bundled head whose planner prices a step alike on any machine: a proposal costs
    ``DRAFT_SECONDS_PER_DEPTH`` per depth and a step nothing besides its proposal and its verify (priced by
    measured wall times, the bounds chosen would hang on the machine's load)."""
    runtime = DraftRuntime(load_head(torch.device("cpu"), torch.float32), cuda_graphs=False)
    observe_draft = runtime.step_cost.observe_draft
    fixed = lambda depths, seconds, batch, attended: observe_draft(  # noqa: E731
        depths, DRAFT_SECONDS_PER_DEPTH * depths, batch, attended)
    monkeypatch.setattr(runtime.step_cost, "observe_draft", fixed)
    monkeypatch.setattr(runtime.step_cost, "observe_step", lambda *measured: None)
    return runtime


def first_children(tree: DraftTree | PendingTree, drafts: int) -> list[int]:
    """The tokens of the path from the root through each node's first child, ``drafts`` deep or to a leaf."""
    tree = DraftTree.of(tree)
    children, tokens, node, path = tree.children(), tree.token_list(), 0, []
    while len(path) < drafts and children[node]:
        node = children[node][0]
        path.append(tokens[node])
    return path


def stepped_online_batch(
    runtime: DraftRuntime, steps: int, drafts_accepted: Callable[[int, int], int] = lambda step, session: 1
) -> Iterator[list[DraftAccept]]:
    """Start ``SESSIONS`` online sessions (own budget 24:0.0:5, prompts of 20, 30, ... tokens) proposing together,
    then step them ``steps`` times; yields after each step what it accepted (nothing at the start). At step k the
    target accepts ``drafts_accepted(k, i)`` drafts of session i's tree through first children (as many as it
    holds), then a bonus token, and its verify costs ``FLAT_VERIFY_SECONDS``."""
    c = runtime.head.config
    generator = torch.Generator().manual_seed(0)
    features = lambda rows: torch.randn(rows, 3 * c.target_hidden_size, generator=generator)  # noqa: E731
    ids = [f"s{i}" for i in range(SESSIONS)]
    starts = []
    for i, sid in enumerate(ids):
        prompt = torch.randint(0, c.vocab_size, (20 + 10 * i,), generator=generator).tolist()
        starts.append(DraftStart(sid, prompt, features(len(prompt)), 1, DraftOptions("online", "24:0.0:5")))
    trees = runtime.step(DraftBatch(starts=starts, proposes=ids)).trees
    yield []
    for step in range(1, steps + 1):
        emitted = [[*first_children(trees[sid], drafts_accepted(step, i)), 2] for i, sid in enumerate(ids)]
        accepts = [DraftAccept(sid, tokens, features(len(tokens))) for sid, tokens in zip(ids, emitted)]
        flat = VerifyCost(rows=SESSIONS * 24, seconds=FLAT_VERIFY_SECONDS)
        trees = runtime.step(DraftBatch(accepts=accepts, proposes=ids, verify_cost=flat)).trees
        yield accepts


def test_a_batch_of_online_sessions_plans_from_the_grid_and_bounds_its_host_work(planning_runtime, monkeypatch):
    runtime = planning_runtime
    requests, chooses = [], []
    propose = runtime.drafter.propose_pending
    monkeypatch.setattr(runtime.drafter, "propose_pending", lambda batch: requests.append(batch) or propose(batch))
    choose = TreePlanner.choose
    monkeypatch.setattr(TreePlanner, "choose", lambda self, *a: chooses.append(self) or choose(self, *a))
    plans_per_step, observed, bounds, grown_as = [], [], [], []
    for _ in stepped_online_batch(runtime, STEPS):  # the target accepts each tree's first child, then a bonus token
        grown_as.append(collections.Counter(s.last_candidate.budget for s in runtime.sessions.values()))
        assert grown_as[-1] == collections.Counter(r.budget for r in requests[-1])  # each tree's own, a probe's too
        plans_per_step.append(len(chooses) - sum(plans_per_step))
        observed.append(sum(s.planner.observed_steps for s in runtime.sessions.values()))
        bounds.append(runtime.batch_plan.bound)
    observed_per_step = [after - before for before, after in zip(observed, observed[1:])]
    allowed = {TreeBudget.parse("24:0.0:5"), *CANDIDATE_GRID, TreeBudget.parse("96:0.0:10")}
    for batch in requests:
        assert {r.budget for r in batch if r.plan[0].children == 10} <= allowed  # dynamic trees: the grid's or own
    assert sum(runtime.bounds_proposed.values()) == len(requests)  # one bound counted per proposal
    assert runtime.bounds_proposed[Bound(24, 5)] >= START_STEPS
    # the batch starts from its own budget, then its bound is chosen every REPLAN_EVERY proposals
    assert bounds[: START_STEPS] == [Bound(24, 5)] * START_STEPS
    # sessions started together re-plan in turn, about a quarter of the batch a step, except that a new bound
    # re-plans at once every session whose tree it no longer holds
    assert sum(plans_per_step[: REPLAN_EVERY]) == SESSIONS
    for step, plans in enumerate(plans_per_step[1:], 1):
        if bounds[step] == bounds[step - 1]:
            assert plans <= -(-SESSIONS // REPLAN_EVERY)
    probe = TreeBudget.parse("96:0.0:10")
    for batch, bound in zip(requests, bounds):  # every tree within the bound, but a probe
        assert all(bound.fits(Candidate(DYNAMIC, tuple(r.plan), r.budget)) for r in batch if r.budget != probe)
    # a probe in the PROBE_EVERY-th proposal, by one session (on a flat verify the batch affords it); the next
    # choice keeps the bound, so the next probe backs off past these steps
    probes = [sum(r.budget == probe for r in batch) for batch in requests]
    assert [i for i, n in enumerate(probes) if n] == [PROBE_EVERY - 1]
    assert max(probes) == 1
    assert sum(grown[probe] for grown in grown_as) == 1  # the session that probed says it grew the probe
    # a step hands at most OBSERVED_PER_STEP sessions' trees to their planners (and the probe's)
    assert observed_per_step[1:] and max(observed_per_step) <= OBSERVED_PER_STEP + 1 and min(observed_per_step[1:]) > 0


def test_once_every_online_session_ended_the_next_starts_a_new_batch_from_its_own_budget(planning_runtime):
    """A client at batch 1 sends one request after another: each starts from its own (tuned) budget, as the
    runtime's first did, not from the bound the last request's text chose."""
    runtime = planning_runtime
    list(stepped_online_batch(runtime, STEPS))
    left = runtime.batch_plan.bound
    runtime.step(DraftBatch(releases=[f"s{i}" for i in range(SESSIONS - 1)]))
    assert runtime.batch_plan.bound == left  # an online session still runs: its batch goes on
    runtime.step(DraftBatch(releases=[f"s{SESSIONS - 1}"]))
    features = torch.zeros(24, 3 * runtime.head.config.target_hidden_size)
    start = DraftStart("next", [3] * 24, features, 1, DraftOptions("online", "32:0.0:10"))
    assert "next" in runtime.step(DraftBatch(starts=[start], proposes=["next"])).trees
    assert left != Bound(32, 10) and runtime.batch_plan.bound == Bound(32, 10)
    assert runtime.batch_plan.proposals_to_choice == START_STEPS - 1  # kept for START_STEPS proposals


def test_probes_back_off_while_the_batchs_bound_stays(planning_runtime):
    """Past the start, the batch is planned without proposing (200 proposals of the bundled head take minutes on a
    CPU), so its planners learn nothing and its first chosen bound stays: every probe leaves it as it was, and the
    interval doubles from PROBE_EVERY up to PROBE_EVERY_MAX, the sessions probing in turn."""
    runtime = planning_runtime
    list(stepped_online_batch(runtime, 1))  # the sessions start, and a flat verify lets the batch afford a probe
    sessions, probes, bounds, made = list(runtime.sessions.values()), [], [], runtime.proposals
    while runtime.proposals < 200:
        proposal, chosen = runtime.proposals, runtime._plan_batch(sessions)
        bound = runtime.batch_plan.bound
        probes += [(proposal, i) for i, (s, c) in enumerate(zip(sessions, chosen)) if not bound.fits(c)]
        bounds.append(bound)
    started = START_STEPS - made  # the start's proposals left: the own budget, then one chosen bound
    assert bounds[:started] == [Bound(24, 5)] * started and len(set(bounds[started:])) == 1
    assert probes == [(7, 0), (23, 1), (55, 2), (119, 3), (183, 4)]  # 16, 32, 64, 64 apart
    assert len(probes) < 200 // PROBE_EVERY


def test_a_verified_step_is_observed_once_the_next_proposal_is_queued(planning_runtime, monkeypatch):
    """The hazard profiles and the planners learn from each verified tree in the draft call that accepts it, but
    after that call's proposal is queued (host work the device's proposal hides): a call plans from the steps
    before its own."""
    runtime = planning_runtime
    planned_after = []  # per call: the steps each session's hazard profile had observed when the call planned
    plan = runtime._plan_batch
    record = lambda sessions: planned_after.append([s.hazard.steps for s in sessions]) or plan(sessions)  # noqa: E731
    monkeypatch.setattr(runtime, "_plan_batch", record)
    observed_after = [[s.hazard.steps for s in runtime.sessions.values()] for _ in stepped_online_batch(runtime, 3)]
    assert planned_after == [[k] * SESSIONS for k in (0, 0, 1, 2)]
    assert observed_after == [[k] * SESSIONS for k in (0, 1, 2, 3)]
    assert all(s.planner.observed_steps > 0 for s in runtime.sessions.values())


def start_full_session(runtime: DraftRuntime) -> DraftTree | PendingTree:
    """Start session "s" (``full`` 8:0.0:3 over a 29-token prompt) with its first proposal; that tree."""
    prompt = list(range(1, 30))
    start = DraftStart("s", prompt, zero_features(runtime, len(prompt)), 1, DraftOptions("full", "8:0.0:3"))
    return runtime.step(DraftBatch(starts=[start], proposes=["s"])).trees["s"]


def accept_first_child(runtime: DraftRuntime, tree: DraftTree | PendingTree) -> DraftAccept:
    """Session "s"'s accept of ``tree``'s first child and a bonus token."""
    return DraftAccept("s", [int(DraftTree.of(tree).tokens[1]), 2], zero_features(runtime, 2))


def zero_features(runtime: DraftRuntime, rows: int) -> torch.Tensor:
    return torch.zeros(rows, 3 * runtime.head.config.target_hidden_size)


def test_the_runtime_measures_a_steps_overhead_between_proposing_calls():
    """From one proposing draft call to the next is one whole engine step: what its proposal and its verify
    do not account for is the overhead. A step after one that did not propose, or without a verify's cost
    (a prompt chunk shared the target call), measures nothing."""
    runtime = DraftRuntime(load_head(torch.device("cpu"), torch.float32), cuda_graphs=False)
    tree = start_full_session(runtime)
    time.sleep(0.02)  # the target's call and the loop, as the engine would spend them
    accepts = [accept_first_child(runtime, tree)]
    proposing = time.perf_counter()
    tree = runtime.step(DraftBatch(accepts=accepts, proposes=["s"])).trees["s"]  # no verify cost: none
    assert not runtime.step_cost.overhead_measured
    time.sleep(0.03)
    verify = VerifyCost(rows=8, seconds=0.012)
    accepts = [accept_first_child(runtime, tree)]
    runtime.step(DraftBatch(accepts=accepts, verify_cost=verify))  # measures; proposes nothing
    step = time.perf_counter() - proposing
    assert runtime.step_cost.overhead_measured
    # the step's wall time (30 ms of sleep and the calls) less the 12 ms verify and the proposal's span (its wall
    # time on a CPU, which a loaded machine stretches): more than nothing, less than the whole step
    assert 0.0 < runtime.step_cost.step_overhead_seconds < step - 0.012
    measured = runtime.step_cost.step_overhead_seconds
    runtime.step(DraftBatch(proposes=["s"], verify_cost=verify))  # the step before proposed nothing
    assert runtime.step_cost.step_overhead_seconds == measured


def test_a_proposal_of_a_shape_met_for_the_first_time_is_not_measured():
    """A shape's first proposal records its graph (on a GPU) inside its span, and its step holds the recording's
    host time: measured, one recording would outweigh a hundred replays in the running averages, and a depth
    first met late (a probe's) would stay priced many times what it costs. Its next proposal measures both."""
    runtime = DraftRuntime(load_head(torch.device("cpu"), torch.float32), cuda_graphs=False)
    tree = start_full_session(runtime)
    verify = VerifyCost(rows=8, seconds=0.005)
    shapes = len(runtime.drafter.proposer.shapes_met)
    accepts = [accept_first_child(runtime, tree)]
    tree = runtime.step(DraftBatch(accepts=accepts, proposes=["s"], verify_cost=verify)).trees["s"]
    assert len(runtime.drafter.proposer.shapes_met) == shapes  # the second proposal met the first's shape
    assert not runtime.step_cost.draft_measured and not runtime.step_cost.overhead_measured
    runtime.step(DraftBatch(accepts=[accept_first_child(runtime, tree)], proposes=["s"], verify_cost=verify))
    assert runtime.step_cost.draft_measured and runtime.step_cost.overhead_measured
    [((batch_bucket, _), points)] = runtime.step_cost.draft_seconds_by_shape.items()
    assert batch_bucket == 1 and list(points) == [3]  # the second proposal, one session, 3 depths deep


def test_the_bound_audit_counts_every_proposal_within_its_bound_and_what_the_steps_delivered(
    planning_runtime, monkeypatch
):
    """Per bound: as many proposals as were made within it; each verified tree's tokens (drafts through first
    children, 0 to 3 deep, then the bonus) and each verified step's seconds, but a probe's past the bound and
    those of a shape's first proposal."""
    runtime = planning_runtime
    requests, first_of_shape = [], []
    propose = runtime.drafter.propose_pending

    def proposing(batch: list) -> list:
        shapes = len(runtime.drafter.proposer.shapes_met)
        trees = propose(batch)
        requests.append(batch)
        first_of_shape.append(len(runtime.drafter.proposer.shapes_met) > shapes)
        return trees

    monkeypatch.setattr(runtime.drafter, "propose_pending", proposing)
    bounds, accepted = [], []
    for accepts in stepped_online_batch(runtime, STEPS, lambda step, i: (step + i) % 4):
        bounds.append(runtime.batch_plan.bound)
        accepted.append(accepts)
    reports = runtime.bound_audit.reports()
    assert {bound: report.proposals for bound, report in reports.items()} == runtime.bounds_proposed
    assert runtime.bounds_proposed == collections.Counter(bounds)  # one per proposal, to the bound it kept within
    assert sum(r.choices for r in reports.values()) == 1 + len(range(START_STEPS, STEPS + 1, REPLAN_EVERY))
    # each step verifies the trees proposed at the step before, within its bound but a probe
    session_steps, emitted, measured_steps = collections.Counter(), collections.Counter(), collections.Counter()
    for batch, first, bound, accepts in zip(requests, first_of_shape, bounds, accepted[1:]):
        within = [bound.fits(Candidate(DYNAMIC, tuple(r.plan), r.budget)) for r in batch]
        session_steps[bound] += sum(within)
        emitted[bound] += sum(len(a.emitted_tokens) for a, w in zip(accepts, within) if w)
        measured_steps[bound] += all(within) and not first
    assert sum(measured_steps.values()) < STEPS  # a probe went past its bound
    assert 0 < sum(first_of_shape) < STEPS
    for bound, report in reports.items():
        tally = runtime.bound_audit.tallies[bound]
        assert (tally.session_steps, tally.emitted_tokens) == (session_steps[bound], emitted[bound])
        assert report.measured_steps == measured_steps[bound]
        if session_steps[bound]:
            assert report.realised_tokens_per_step == emitted[bound] / session_steps[bound]
            assert 1 <= report.realised_tokens_per_step <= bound.depth + 1
        if report.measured_seconds is not None:
            assert report.measured_seconds.verify == pytest.approx(FLAT_VERIFY_SECONDS)
