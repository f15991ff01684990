"""What the batch planner predicted for each bound it chose, beside what the steps within that bound delivered.

Why. ``batch_plan`` takes the bound with the most predicted tokens per second; when a chosen bound then does
badly, the question is which part of its prediction was off: the tokens per step (the hazard and the
acceptance means behind each session's E_s), the draft seconds or the verify seconds. Per bound the audit
sums the prediction in force at each proposal (``BoundChoice``) and what was measured of the same steps, so
each pair of means it reports compares like with like:

- tokens per step are per session: predicted, the choice's sum of E_s over its batch; realised, what each
  verified session-step emitted (accepted drafts + the bonus token);
- seconds are per step, by part (``StepSeconds``): predicted, the choice's; measured, the runtime's own
  measurements of the step (``StepCostModel.observe_step``: the wall time between proposing calls, the
  proposal's device span, the verify's seconds), the overhead being the rest of that wall time. Until the
  cost model has measured anything, a prediction is in its default units (``StepCostModel``), not seconds.

A probe past the bound holds a tree outside it and pads the verify beyond it: its proposal counts, but neither the
probing session's tokens nor that step's seconds are measured against the bound.

Host cost: a dictionary look-up and a few additions per proposal, per verified session and per measured
step; no device work.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass

from draft_service.batch_plan import BoundChoice, StepSeconds
from draft_service.tree_plan import Bound


@dataclass(frozen=True)
class BoundReport:
    """One bound's audit: predictions averaged over the proposals made within it, measurements over its steps."""

    proposals: int  # batch proposals made while it was the bound
    choices: int  # times the planner chose or kept it (its start counts)
    batch: float  # sessions per step, as its choices saw them
    context_tokens: float  # committed tokens per session, as its choices saw them
    predicted_tokens_per_step: float  # per session
    realised_tokens_per_step: float | None  # per verified session-step; None before one was verified
    predicted_tokens_per_second: float  # the batch's
    runner_up_tokens_per_second: float | None  # the best other bound's, at the choices that scored one
    predicted_seconds: StepSeconds  # a step's, by part
    measured_seconds: StepSeconds | None  # a measured step's, by part; None before one was measured
    measured_steps: int  # steps measured (not one with a probe past the bound)


@dataclass
class BoundTally:
    """One bound's running sums (predictions summed over proposals); a ``BoundReport`` divides them."""

    proposals: int = 0
    choices: int = 0
    batch: int = 0  # sessions
    context_tokens: int = 0  # mean committed tokens per session
    predicted_tokens: float = 0.0  # tokens per session per step
    predicted_rate: float = 0.0  # tokens/s
    runner_up_rate: float = 0.0  # tokens/s, over the proposals whose choice scored another bound
    runner_up_proposals: int = 0
    predicted_overhead: float = 0.0  # s
    predicted_draft: float = 0.0  # s
    predicted_verify: float = 0.0  # s
    session_steps: int = 0  # verified session-steps
    emitted_tokens: int = 0  # tokens those steps emitted
    measured_steps: int = 0
    measured_overhead: float = 0.0  # s
    measured_draft: float = 0.0  # s
    measured_verify: float = 0.0  # s

    def since(self, earlier: BoundTally) -> BoundTally:
        """What was added after ``earlier`` (a copy of this tally)."""
        fields = dataclasses.fields(self)
        return BoundTally(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields})

    def report(self) -> BoundReport:
        """The means; only for a tally with proposals."""
        n, steps = self.proposals, self.measured_steps
        measured = (
            StepSeconds(self.measured_overhead / steps, self.measured_draft / steps, self.measured_verify / steps)
            if steps else None
        )  # fmt: skip
        return BoundReport(
            proposals=n,
            choices=self.choices,
            batch=self.batch / n,
            context_tokens=self.context_tokens / n,
            predicted_tokens_per_step=self.predicted_tokens / n,
            realised_tokens_per_step=self.emitted_tokens / self.session_steps if self.session_steps else None,
            predicted_tokens_per_second=self.predicted_rate / n,
            runner_up_tokens_per_second=(
                self.runner_up_rate / self.runner_up_proposals if self.runner_up_proposals else None
            ),
            predicted_seconds=StepSeconds(
                self.predicted_overhead / n, self.predicted_draft / n, self.predicted_verify / n
            ),
            measured_seconds=measured,
            measured_steps=steps,
        )


AuditSnapshot = dict[Bound, BoundTally]  # copies of the tallies at one moment (``BoundAudit.snapshot``)
CHOICES_KEPT = 1024  # the last choices the log keeps: a server's audit lives as long as it does


@dataclass(frozen=True)
class ChoiceRecord:
    """One choice of the bound, with every bound it scored: why the batch took the trees it took."""

    index: int  # choices made before it
    bound: Bound  # chosen or kept
    choice: BoundChoice  # what each bound was predicted to emit and spend, and a few sessions' E per candidate


class BoundAudit:
    """Per bound, what its choices predicted and what its steps delivered, and the last choices one by one;
    ``DraftRuntime`` feeds it."""

    def __init__(self) -> None:
        self.tallies: dict[Bound, BoundTally] = {}
        self.choices: collections.deque[ChoiceRecord] = collections.deque(maxlen=CHOICES_KEPT)
        self.choices_made = 0

    def chose(self, bound: Bound, choice: BoundChoice) -> None:
        """The planner chose (or kept) ``bound``, scoring ``choice.scored``."""
        self._tally(bound).choices += 1
        self.choices.append(ChoiceRecord(self.choices_made, bound, choice))
        self.choices_made += 1

    def choices_since(self, made: int) -> list[ChoiceRecord]:
        """The choices after the first ``made`` (``choices_made`` at some moment) that the log still keeps."""
        return [record for record in self.choices if record.index >= made]

    def proposed(self, bound: Bound, choice: BoundChoice) -> None:
        """One batch proposal within ``bound``, under the prediction of the choice in force."""
        tally, predicted = self._tally(bound), choice.predicted
        tally.proposals += 1
        tally.batch += predicted.batch
        tally.context_tokens += predicted.context_tokens
        tally.predicted_tokens += predicted.tokens_per_step / predicted.batch
        tally.predicted_rate += predicted.tokens_per_second
        if choice.runner_up_tokens_per_second is not None:
            tally.runner_up_rate += choice.runner_up_tokens_per_second
            tally.runner_up_proposals += 1
        tally.predicted_overhead += predicted.seconds.overhead
        tally.predicted_draft += predicted.seconds.draft
        tally.predicted_verify += predicted.seconds.verify

    def emitted(self, bound: Bound, tokens: int) -> None:
        """One session's verified step of a tree proposed within ``bound``: ``tokens`` accepted drafts + bonus."""
        tally = self._tally(bound)
        tally.session_steps += 1
        tally.emitted_tokens += tokens

    def measured(self, bound: Bound, seconds: StepSeconds) -> None:
        """One step proposed within ``bound``, as measured."""
        tally = self._tally(bound)
        tally.measured_steps += 1
        tally.measured_overhead += seconds.overhead
        tally.measured_draft += seconds.draft
        tally.measured_verify += seconds.verify

    def snapshot(self) -> AuditSnapshot:
        """The tallies as they are now, for ``reports(since=...)``: a benchmark's run alone."""
        return {bound: dataclasses.replace(tally) for bound, tally in self.tallies.items()}

    def reports(self, since: AuditSnapshot | None = None) -> dict[Bound, BoundReport]:
        """Per bound proposed within after ``since`` (from the start without one), the most proposed first."""
        earlier = since or {}
        tallies = [(b, t.since(earlier[b]) if b in earlier else t) for b, t in self.tallies.items()]
        return {b: t.report() for b, t in sorted(tallies, key=lambda pair: -pair[1].proposals) if t.proposals}

    def _tally(self, bound: Bound) -> BoundTally:
        tally = self.tallies.get(bound)
        if tally is None:
            tally = self.tallies[bound] = BoundTally()
        return tally
