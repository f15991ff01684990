"""The bound audit's means: predictions averaged over the proposals made within a bound, realised tokens over
its verified session-steps, measured seconds over its measured steps; and reports since a snapshot."""

from __future__ import annotations

from typing import Callable

import pytest

from draft_service.batch_plan import BoundChoice, BoundPrediction, StepSeconds
from draft_service import bound_audit
from draft_service.bound_audit import BoundAudit, BoundReport, ChoiceRecord
from draft_service.tree_plan import Bound

WIDE, NARROW = Bound(96, 10), Bound(16, 4)
# 8 tokens a step over 4 sessions in 2 s: 2 tokens per session, 4 tokens/s; a start scores no other bound
START_PREDICTION = BoundPrediction(8.0, StepSeconds(0.25, 0.75, 1.0), batch=4, context_tokens=1000)
START = BoundChoice(START_PREDICTION, {WIDE: START_PREDICTION})
# 12 tokens a step over 4 sessions in 1 s: 3 tokens per session, 12 tokens/s; the best other bound 10 tokens/s
LATER_PREDICTION = BoundPrediction(12.0, StepSeconds(0.25, 0.25, 0.5), batch=4, context_tokens=2000)
RUNNER_UP = BoundPrediction(10.0, StepSeconds(0.25, 0.25, 0.5), batch=4, context_tokens=2000)
LATER = BoundChoice(LATER_PREDICTION, {NARROW: LATER_PREDICTION, WIDE: RUNNER_UP})

Event = Callable[[BoundAudit], None]
CASES: dict[str, tuple[list[Event], dict[Bound, BoundReport]]] = {
    "a proposal, nothing verified or measured": (
        [lambda a: a.chose(WIDE, START), lambda a: a.proposed(WIDE, START)],
        {WIDE: BoundReport(1, 1, 4.0, 1000.0, 2.0, None, 4.0, None, StepSeconds(0.25, 0.75, 1.0), None, 0)},
    ),
    "a start kept, then chosen again: the runner-up over the proposals of the choice that scored one": (
        [lambda a: a.chose(WIDE, START), lambda a: a.proposed(WIDE, START), lambda a: a.proposed(WIDE, START),
         lambda a: a.chose(WIDE, LATER), lambda a: a.proposed(WIDE, LATER), lambda a: a.proposed(WIDE, LATER)],
        {WIDE: BoundReport(4, 2, 4.0, 1500.0, 2.5, None, 8.0, 10.0, StepSeconds(0.25, 0.5, 0.75), None, 0)},
    ),
    "verified sessions and measured steps": (
        [lambda a: a.chose(WIDE, LATER), lambda a: a.proposed(WIDE, LATER), lambda a: a.proposed(WIDE, LATER),
         lambda a: a.emitted(WIDE, 1), lambda a: a.emitted(WIDE, 3), lambda a: a.emitted(WIDE, 5),
         lambda a: a.measured(WIDE, StepSeconds(0.5, 1.0, 2.0)),
         lambda a: a.measured(WIDE, StepSeconds(1.5, 2.0, 4.0))],
        {WIDE: BoundReport(2, 1, 4.0, 2000.0, 3.0, 3.0, 12.0, 10.0, StepSeconds(0.25, 0.25, 0.5),
                           StepSeconds(1.0, 1.5, 3.0), 2)},
    ),
    "two bounds, each its own, the most proposed first": (
        [lambda a: a.chose(WIDE, START), lambda a: a.proposed(WIDE, START), lambda a: a.emitted(WIDE, 11),
         lambda a: a.chose(NARROW, LATER), lambda a: a.proposed(NARROW, LATER), lambda a: a.proposed(NARROW, LATER),
         lambda a: a.emitted(NARROW, 2), lambda a: a.measured(NARROW, StepSeconds(0.5, 0.5, 1.0))],
        {NARROW: BoundReport(2, 1, 4.0, 2000.0, 3.0, 2.0, 12.0, 10.0, StepSeconds(0.25, 0.25, 0.5),
                             StepSeconds(0.5, 0.5, 1.0), 1),
         WIDE: BoundReport(1, 1, 4.0, 1000.0, 2.0, 11.0, 4.0, None, StepSeconds(0.25, 0.75, 1.0), None, 0)},
    ),
}  # fmt: skip


@pytest.mark.parametrize("events, expected", CASES.values(), ids=CASES.keys())
def test_the_audit_averages_each_bounds_predictions_and_measurements(events, expected):
    audit = BoundAudit()
    for event in events:
        event(audit)
    assert list(audit.reports().items()) == list(expected.items())


def test_reports_since_a_snapshot_count_only_what_came_after_it():
    """A bound proposed within only before the snapshot is left out, even if a step of it is measured after."""
    audit = BoundAudit()
    audit.chose(WIDE, START)
    audit.proposed(WIDE, START)
    audit.emitted(WIDE, 7)
    audit.chose(NARROW, START)
    audit.proposed(NARROW, START)
    snapshot = audit.snapshot()
    audit.measured(NARROW, StepSeconds(0.5, 0.5, 1.0))
    audit.proposed(WIDE, LATER)
    audit.emitted(WIDE, 3)
    assert audit.reports(since=snapshot) == {
        WIDE: BoundReport(1, 0, 4.0, 2000.0, 3.0, 3.0, 12.0, 10.0, StepSeconds(0.25, 0.25, 0.5), None, 0)
    }
    assert audit.reports()[WIDE] == BoundReport(
        2, 1, 4.0, 1500.0, 2.5, 5.0, 8.0, 10.0, StepSeconds(0.25, 0.5, 0.75), None, 0
    )


def test_the_choice_log_keeps_every_bound_each_choice_scored_and_the_last_choices_only(monkeypatch):
    monkeypatch.setattr(bound_audit, "CHOICES_KEPT", 3)
    audit = BoundAudit()
    audit.chose(WIDE, START)
    made = audit.choices_made
    audit.chose(NARROW, LATER)
    assert audit.choices_since(made) == [ChoiceRecord(1, NARROW, LATER)]
    assert audit.choices_since(made)[0].choice.scored == {NARROW: LATER_PREDICTION, WIDE: RUNNER_UP}
    assert [r.bound for r in audit.choices_since(0)] == [WIDE, NARROW]
    for _ in range(3):
        audit.chose(WIDE, START)
    assert audit.choices_made == 5 and [r.index for r in audit.choices_since(0)] == [2, 3, 4]  # the last three
