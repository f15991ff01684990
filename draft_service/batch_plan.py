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
choice's predicted value is at least each one's, by construction (up to the hysteresis while the
current bound is kept).

Cadence. The bound is chosen again every ``REPLAN_EVERY`` proposals, and at once when the batch size
crosses a power of two (the verify cost moves with it). The runtime's first online batch starts from
the largest of its sessions' own budgets (where a tuned profile starts them) and keeps it
``START_STEPS`` proposals, so the own budgets are measured first. A probe (``tree_plan.prober``) goes ahead only when its padded
verify is predicted to cost at most ``PROBE_OVERHEAD`` more than the bound's.
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
PROBE_OVERHEAD = 0.25  # a probe may make the batch's verify at most this much dearer


@dataclass(frozen=True)
class SessionOutlook:
    """What one session expects per step: an online session per candidate, a fixed one from its own tree."""

    expectations: dict[Candidate, float]  # online: E per candidate; fixed: its one candidate
    fixed: bool


@dataclass(frozen=True)
class BatchCost:
    """The measured costs a bound is scored with, read once per choice."""

    cost: StepCostModel
    batch: int  # sessions verified together
    context_tokens: int  # mean committed tokens per session

    @functools.cached_property
    def _verify(self) -> Callable[[int], float]:
        """The verify curve at the batch's context, read once for every bound a choice scores."""
        return self.cost.verify_curve(self.context_tokens)

    def verify_seconds(self, tokens: int) -> float:
        """A verify of every session's tree padded to ``tokens``."""
        return self._verify(self.batch * tokens)

    def step_seconds(self, bound: Bound) -> float:
        """A whole step within ``bound``: its depths' proposal, the padded verify, and what every step costs
        besides (``StepCostModel.observe_step``)."""
        proposal = self.cost.draft_seconds(bound.depth)
        return self.cost.step_overhead_seconds + proposal + self.verify_seconds(bound.tokens)


class BatchPlanner:
    """The bound the online sessions of one draft runtime's batch propose within."""

    def __init__(self) -> None:
        self.bound: Bound | None = None
        self.proposals_to_choice = 0  # proposals left before the bound is chosen again
        self.batch_scale = 0  # the batch size's power of two when the bound was chosen

    def due(self, batch: int) -> bool:
        """Whether this proposal chooses the bound again."""
        return self.bound is None or self.proposals_to_choice <= 0 or batch.bit_length() != self.batch_scale

    def start(self, own_budgets: list[Bound], batch: int) -> Bound:
        """A new batch's bound: the largest of its sessions' own budgets, kept ``START_STEPS`` proposals."""
        self.bound = Bound(max(b.tokens for b in own_budgets), max(b.depth for b in own_budgets))
        self.proposals_to_choice, self.batch_scale = START_STEPS, batch.bit_length()
        return self.bound

    def choose(self, bounds: list[Bound], outlooks: list[SessionOutlook], cost: BatchCost) -> Bound:
        """The bound of ``bounds`` with the most predicted tokens per second for the batch (see the module)."""
        fixed = [next(iter(o.expectations)) for o in outlooks if o.fixed]
        widest = Bound(max((c.tokens for c in fixed), default=1), max((c.depth for c in fixed), default=0))

        def value(bound: Bound) -> float:
            expected = 0.0
            for outlook in outlooks:
                fitting = [e for c, e in outlook.expectations.items() if outlook.fixed or bound.fits(c)]
                expected += max(fitting, default=1.0)  # no fitting candidate: the bonus token alone
            padded = Bound(max(bound.tokens, widest.tokens), max(bound.depth, widest.depth))
            return expected / cost.step_seconds(padded)

        scored = [(value(b), b) for b in dict.fromkeys(bounds)]
        best_value, best = max(scored, key=lambda pair: pair[0])  # the first listed wins a tie
        kept = self.bound if self.bound is not None else best
        if best_value > value(kept) * (1 + PLAN_HYSTERESIS):
            kept = best
        self.bound, self.proposals_to_choice, self.batch_scale = kept, REPLAN_EVERY, cost.batch.bit_length()
        return kept

    def step(self) -> None:
        self.proposals_to_choice -= 1

    def allows_probe(self, probe: Candidate, cost: BatchCost) -> bool:
        """Whether one session's probe, padding the whole batch to it, keeps the verify within the overhead."""
        assert self.bound is not None
        return cost.verify_seconds(probe.tokens) <= (1 + PROBE_OVERHEAD) * cost.verify_seconds(self.bound.tokens)
