"""The ``online`` policy's batch bound: how large and how deep every tree of a verify batch may be.

Why the batch chooses. A verify pads every tree of its batch to the widest, so it costs what
B x widest rows cost, however little the other trees hold; and a batched proposal runs as many head
passes as the deepest plan. A session that chose alone would either grow a tree that every other
session pays for, or shrink its own while the widest stays, saving nothing. So the size and the
depth are one choice for the batch, and the hazard shapes each tree within it.

Rule. Among the bounds (tokens, depth) of the online sessions' dynamic candidates (the grid's and
their own budgets) the batch takes the one with the most predicted tokens per second,

    V(T, D) = sum_s E_s(T, D) / (max(D, D_fixed) * t_draft + c_verify(B * max(T, T_fixed), context))

with E_s(T, D) the tokens per step session s expects from its best candidate within the bound (a
dynamic tree that fits, or its hazard-shaped tree), sessions of fixed policies adding their own E
and widening the bound to their trees, t_draft the measured draft seconds per depth and c_verify the
measured verify seconds of the padded rows (``hazard.StepCostModel``). Every fixed ``full``
configuration of the grid is such a bound with that configuration's tree for every session, so the
choice's predicted value is at least each one's, by construction (up to the margin a move must clear).

Margin. A new bound replaces the current one when its predicted value beats the current one's by
``PLAN_HYSTERESIS`` plus ``MOVE_RISK`` times how much dearer its step is predicted to be. The seconds of
a value are measured; its tokens are predicted, a larger tree's from probes and the global differences
other requests' text left, and a move to a step 40% dearer is right only if 40% more tokens are real:
the prediction's error grows with the gain the move needs. A move to a cheaper step needs the hysteresis
alone. Under the H200's costs along the target's text at 16K (``bench.online_replay``) sessions left the
tuned 16:0.0:6 four steps into a request for 32:0.0:10 and 96:0.0:10 on gains repetitive prompts had
measured, and emitted 2-5% more tokens a step at 23-44% more cost (margins of 15% and 25% for those
moves); at 4K the move from 64:0.0:8 to 96:0.0:10 is 10% dearer a step, so it clears 8%.

Cadence. The bound is chosen again every ``REPLAN_EVERY`` proposals, and at once when the batch size
crosses a power of two (the verify cost moves with it). A new online batch (the runtime's first, or the
first after every online session of the last one ended: each request of a client at batch 1) starts from the
largest of its sessions' own budgets (where a tuned profile starts them) and keeps it ``START_STEPS``
proposals, so the own budgets are measured first on the new text rather than the last request's bound kept.

Probes. One online session in turn proposes a probe (``tree_plan.TreePlanner.probes``) in one proposal
of every ``PROBE_EVERY``, so candidates larger than the bound stay measured. A probe pads the whole
batch's verify, so probes that change nothing back off (``ProbeSchedule``): the first choice after a
probe that keeps the bound doubles the interval, up to ``PROBE_EVERY_MAX``; a new bound, a batch size
that crosses a power of two, or a new batch returns it to ``PROBE_EVERY`` at once. The probe is the largest
of the session's nested probes past the bound whose padded verify is predicted to cost at most
``PROBE_OVERHEAD`` more than the bound's; where none does, the turn passes without one.

Record. Each choice keeps what it predicted for the bound it chose, by part, and the best other bound's
value (``BoundChoice``): ``draft_service.bound_audit`` sets it beside what the steps within the bound delivered.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from draft_service.hazard import StepCostModel
from draft_service.tree_plan import Bound, Candidate

REPLAN_EVERY = 4  # proposals between the batch's choices: a hazard and a cost move slowly
START_STEPS = 4  # proposals a new batch keeps the largest own budget of its sessions
PLAN_HYSTERESIS = 0.03  # a new bound must beat the current one by 3% to replace it
MOVE_RISK = 0.5  # and by this share of how much dearer its step is (the module's margin)
PROBE_OVERHEAD = 0.25  # a probe may make the batch's verify at most this much dearer
PROBE_EVERY = 8  # proposals between probe turns at first, and again once the bound moves
PROBE_EVERY_MAX = 64  # proposals between probe turns at most, however long probes leave the bound as it was
LOGGED_SESSIONS = 4  # online sessions whose expectations a choice keeps for the bound audit's log


@dataclass(frozen=True)
class SessionOutlook:
    """What one session expects per step: an online session per candidate, a fixed one from its own tree."""

    expectations: dict[Candidate, float]  # online: E per candidate; fixed: its one candidate
    fixed: bool


@dataclass(frozen=True)
class StepSeconds:
    """A step's seconds by part: what ``BatchCost`` predicts for a bound, or what the runtime measured of one."""

    overhead: float  # s: the rest of the step (the accept, host work, the engine loop)
    draft: float  # s: the proposal on the device
    verify: float  # s: the target's verify of the padded trees

    @property
    def total(self) -> float:
        return self.overhead + self.draft + self.verify


@dataclass(frozen=True)
class BatchCost:
    """The measured costs a bound is scored with, read once per choice."""

    cost: StepCostModel
    batch: int  # sessions verified together
    context_tokens: int  # mean committed tokens per session
    attended_tokens: int = 0  # mean entries a session's proposal attends to: its working set, or its context

    @functools.cached_property
    def _verify(self) -> Callable[[int], float]:
        """The verify curve at the batch's context, read once for every bound a choice scores."""
        return self.cost.verify_curve(self.context_tokens)

    def verify_seconds(self, tokens: int) -> float:
        """A verify of every session's tree padded to ``tokens``, at the rows it computes (``computed_rows``)."""
        return self._verify(self.cost.computed_rows(self.batch, tokens))

    def step_seconds(self, bound: Bound) -> StepSeconds:
        """A whole step within ``bound``: its depths' proposal, the padded verify, and what every step costs
        besides (``StepCostModel.observe_step``)."""
        return StepSeconds(
            self.cost.step_overhead_seconds, self.cost.draft_seconds(bound.depth, self.batch, self.attended_tokens),
            self.verify_seconds(bound.tokens),
        )


@dataclass(frozen=True)
class BoundPrediction:
    """What a choice predicts for one bound over its batch: the V(T, D) of the module, by part."""

    tokens_per_step: float  # tokens the whole batch emits per step: the sum of its sessions' E_s
    seconds: StepSeconds  # the step at the bound (padded to the fixed sessions' trees)
    batch: int  # sessions verified together
    context_tokens: int  # mean committed tokens per session

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.seconds.total


@dataclass(frozen=True)
class BoundChoice:
    """What the planner predicted at its last choice for the bound it chose, and how close the call was."""

    predicted: BoundPrediction  # for the bound chosen (or kept): ``scored``'s entry where the choice scored it
    scored: dict[Bound, BoundPrediction]  # every bound the choice scored (the start: its own alone)
    # the first ``LOGGED_SESSIONS`` online sessions' E per candidate, as the choice read them (references, no copy)
    expectations: tuple[dict[Candidate, float], ...] = ()

    @property
    def runner_up_tokens_per_second(self) -> float | None:
        """The best other bound scored; None where none was (the start)."""
        others = [p.tokens_per_second for p in self.scored.values() if p is not self.predicted]
        return max(others, default=None)


def _predictor(outlooks: list[SessionOutlook], cost: BatchCost) -> Callable[[Bound], BoundPrediction]:
    """What the batch of ``outlooks`` is predicted to emit and spend per step within a bound."""
    fixed = [next(iter(o.expectations)) for o in outlooks if o.fixed]
    widest = Bound(max((c.tokens for c in fixed), default=1), max((c.depth for c in fixed), default=0))

    def predict(bound: Bound) -> BoundPrediction:
        expected = 0.0
        for outlook in outlooks:
            fitting = [e for c, e in outlook.expectations.items() if outlook.fixed or bound.fits(c)]
            expected += max(fitting, default=1.0)  # no fitting candidate: the bonus token alone
        padded = Bound(max(bound.tokens, widest.tokens), max(bound.depth, widest.depth))
        return BoundPrediction(expected, cost.step_seconds(padded), cost.batch, cost.context_tokens)

    return predict


def _logged(outlooks: list[SessionOutlook]) -> tuple[dict[Candidate, float], ...]:
    """The expectations of the first ``LOGGED_SESSIONS`` online sessions (``BoundChoice.expectations``)."""
    return tuple(o.expectations for o in outlooks if not o.fixed)[:LOGGED_SESSIONS]


@dataclass
class ProbeSchedule:
    """When an online session proposes its probe, and whose turn it is; the interval backs off while probes leave
    the bound as it was (see the module)."""

    interval: int = PROBE_EVERY  # proposals from one probe turn to the next
    since_turn: int = 0  # proposals since the last probe turn (or the batch's start)
    turns: int = 0  # probe turns so far: the online sessions take them in order
    unjudged: bool = False  # a probe went ahead that no choice of the bound has judged yet

    def turn(self, online_sessions: int) -> int | None:
        """One proposal of a batch with ``online_sessions`` online sessions: whose turn it is to probe, if anyone's."""
        if online_sessions == 0:
            return None
        self.since_turn += 1
        if self.since_turn < self.interval:
            return None
        self.since_turn, self.turns = 0, self.turns + 1
        return (self.turns - 1) % online_sessions

    def probed(self) -> None:
        """The probe of this turn went ahead: the next choice of the bound judges it."""
        self.unjudged = True

    def judge(self, moved: bool) -> None:
        """A choice of the bound: one that ``moved`` it (or a batch size past a power of two) starts the interval
        over; the first to keep it after a probe doubles it. That choice may come before the probe's step is learnt
        from; should the next one move the bound, the interval starts over before another probe is due."""
        if moved:
            self.interval, self.unjudged = PROBE_EVERY, False
        elif self.unjudged:
            self.interval, self.unjudged = min(2 * self.interval, PROBE_EVERY_MAX), False


class BatchPlanner:
    """The bound the online sessions of one draft runtime's batch propose within, and when one of them probes."""

    def __init__(self) -> None:
        self.bound: Bound | None = None
        self.choice: BoundChoice | None = None  # what was predicted when the bound was last chosen
        self.proposals_to_choice = 0  # proposals left before the bound is chosen again
        self.batch_scale = 0  # the batch size's power of two when the bound was chosen
        self.probes = ProbeSchedule()  # when an online session probes: each choice of the bound judges the last probe

    def due(self, batch: int) -> bool:
        """Whether this proposal chooses the bound again."""
        return self.bound is None or self.proposals_to_choice <= 0 or batch.bit_length() != self.batch_scale

    def start(self, own_budgets: list[Bound], outlooks: list[SessionOutlook], cost: BatchCost) -> Bound:
        """A new batch's bound: the largest of its sessions' own budgets, kept ``START_STEPS`` proposals."""
        bound = Bound(max(b.tokens for b in own_budgets), max(b.depth for b in own_budgets))
        predicted = _predictor(outlooks, cost)(bound)
        self.bound, self.choice = bound, BoundChoice(predicted, {bound: predicted}, _logged(outlooks))
        self.proposals_to_choice, self.batch_scale = START_STEPS, cost.batch.bit_length()
        self.probes = ProbeSchedule()
        return bound

    def choose(self, bounds: list[Bound], outlooks: list[SessionOutlook], cost: BatchCost) -> Bound:
        """The bound of ``bounds`` with the most predicted tokens per second for the batch among the one kept and
        the moves that clear the margin over it (see the module)."""
        predict = _predictor(outlooks, cost)
        scored = {bound: predict(bound) for bound in dict.fromkeys(bounds)}
        kept = self.bound
        if kept is None:  # the first choice: the most valuable bound
            kept = max(scored, key=lambda bound: scored[bound].tokens_per_second)
        predicted = scored[kept] if kept in scored else predict(kept)

        def clears_margin(bound: Bound) -> bool:  # the module's margin over the bound kept
            dearer = max(0.0, scored[bound].seconds.total / predicted.seconds.total - 1.0)
            return scored[bound].tokens_per_second > predicted.tokens_per_second * (
                1 + PLAN_HYSTERESIS + MOVE_RISK * dearer
            )

        moves = [bound for bound in scored if bound != kept and clears_margin(bound)]
        if moves:
            kept = max(moves, key=lambda bound: scored[bound].tokens_per_second)  # the first listed wins a tie
            predicted = scored[kept]
        self.probes.judge(moved=kept != self.bound or cost.batch.bit_length() != self.batch_scale)
        self.bound, self.choice = kept, BoundChoice(predicted, scored, _logged(outlooks))
        self.proposals_to_choice, self.batch_scale = REPLAN_EVERY, cost.batch.bit_length()
        return kept

    def step(self) -> None:
        self.proposals_to_choice -= 1

    def prober(self, online_sessions: int) -> int | None:
        """Which of the batch's ``online_sessions`` online sessions may probe at this proposal, if any."""
        return self.probes.turn(online_sessions)

    def affordable_probe(self, probes: tuple[Candidate, ...], cost: BatchCost) -> Candidate | None:
        """The prober's probe: the largest of its ``probes`` (ascending) past the bound that keeps the whole batch's
        verify, padded to it, within the overhead; None where none does. One that goes ahead is noted for the next
        choice of the bound to judge."""
        assert self.bound is not None
        most = (1 + PROBE_OVERHEAD) * cost.verify_seconds(self.bound.tokens)
        past = [p for p in probes if not self.bound.fits(p) and cost.verify_seconds(p.tokens) <= most]
        if not past:
            return None
        self.probes.probed()
        return past[-1]
