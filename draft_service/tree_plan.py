"""The ``online`` policy per session: its candidate trees, what it measured of them, and its choice within
the batch's bound.

Candidates. A session's candidates are
- *dynamic* trees, EAGLE-2's as ``full`` grows them (every depth expands the ``FULL_TOP_K`` best
  frontier nodes by cumulative draft log-prob into ``FULL_TOP_K`` children each; the best
  ``total_tokens`` nodes are kept), one per budget of ``CANDIDATE_GRID`` (the reproduce grid) and
  the request's own budget: exactly the fixed configurations a tuning pass compares;
- one *shaped* tree (``hazard.climb``): widths per depth from the hazard, wider where paths stop.
A candidate is a plan (``DepthPlan`` per depth) and a ``TreeBudget``: the proposal's own facts,
so choosing one changes no device shape rule.

Prediction. A candidate's tokens per step E (accepted drafts + the bonus):
- dynamic: measured. Every verified dynamic tree says what each smaller dynamic candidate
  (total_tokens, depth no larger, threshold no lower) would have accepted in that step: both grow
  the same frontier up to the smaller depth, so the smaller tree is the best total_tokens - 1 of the
  verified tree's nodes within its depth and threshold, and it accepts the longest prefix of the
  accepted path inside it (exact at temperature 0 at equal depths; at a smaller depth it may miss
  nodes the verified tree's deeper ones crowded out, so it errs low). A *base* budget lies inside
  every candidate, so every dynamic step measures it; a candidate's E is the base's decayed mean
  plus the candidate's mean difference from the base over the steps that measured both (paired on
  the same text, the difference varies far less than an accepted length). Now and then one online
  session, in turn, may propose a *probe*, a dynamic tree past the batch's bound that contains every
  candidate of its size or smaller, so candidates larger than the current trees stay measured (for
  that session, and through the global estimates for all); the batch sets how often (less often
  while probes leave its bound as it was) and which probe: the largest whose padded verify costs
  little more (``batch_plan``). The probes are nested, one per candidate size, so where the largest
  costs too much (a compute-bound verify at long context) the next size up is still measured, and
  the bound can grow one size at a time on text that accepts long paths. A session on shaped trees
  measures no dynamic tree, so one step in ``RECHECK_EVERY`` it proposes the largest dynamic candidate
  within the bound instead (a *recheck*: the same verify bucket and depths, so the same cost): a dynamic
  tree its estimates once undersold is measured again. Each estimate is smoothed toward the global one
  (all requests' sessions), and where nothing is measured toward the calibrated rank model's E (below)
  of the best static tree the planner knows of the same size and depth (the uniform one, or the current
  shaped tree where it fits): EAGLE-2's tree keeps the most probable nodes, so it is expected to accept
  no less than a static tree does.
- shaped: the rank model's E(w) (``hazard.expected_tokens``) times the ratio shaped trees realised
  of it (the model takes the path's node to be expanded at every depth, which a static tree's
  best-w rule does not guarantee).

Choice. How large and deep the trees may be is the batch's choice (``draft_service.batch_plan``): a
verify pads every tree of its batch to the widest, and a batched proposal runs as many head passes as
the deepest plan, so one session's larger tree costs every session. Within the batch's ``Bound`` a
session proposes what it expects to emit most from: its best dynamic candidate that fits, or its
hazard-shaped tree, grown by ``hazard.climb`` within the bound (wider where paths stop). A re-plan
scores each dynamic candidate once and climbs the shaped tree a few moves from where it was, so it
costs a bounded number of evaluations, never a search. Between re-plans a session proposes its
current candidate unchanged (or the probe, or the recheck). Learning from a verified tree costs one pass over its
nodes and one sort of them; the runtime hands a step's trees to a few sessions' planners in turn
(``runtime.OBSERVED_PER_STEP``), so a large batch's host time stays bounded.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from draft_service.hazard import (
    MAX_WIDTH,
    PRIOR_WEIGHT,
    HazardProfile,
    climb,
    expected_tokens,
    tree_size,
    widths_to_plan,
)
from draft_service.tree_budget import FULL_TOP_K, DepthPlan, TreeBudget, TreePolicy

if TYPE_CHECKING:
    from diffspec.tree import DraftTree  # torch: the tuning presets read the grid without it

# every tree the protocol's tunings have chosen is here (16:0.0:6 at 16K and 64K, 64:0.0:8 at 4K, 32:0.0:10 at 64K):
# an online session can take any of them, whatever its own budget
CANDIDATE_GRID = tuple(
    TreeBudget.parse(config)
    for config in ("16:0.0:4", "16:0.0:6", "32:0.0:6", "32:0.0:10", "48:0.0:8", "64:0.0:8", "96:0.0:10")
)
SESSION_ACCEPT_DECAY = 0.97  # a request's acceptance means follow its text over ~30 steps
GLOBAL_ACCEPT_DECAY = 0.995  # the global means, every request's prior, move slowly
CALIBRATION_PRIOR_TOKENS = 10.0  # predicted tokens a calibration prior (the global one, or 1) is worth
RECHECK_EVERY = 4  # a session on shaped trees proposes its largest dynamic tree within the bound one step in this many
DYNAMIC, SHAPED, FIXED = "dynamic", "shaped", "fixed"


@dataclass(frozen=True)
class Candidate:
    """One tree a session may propose: how each depth grows and the budget that trims it."""

    kind: str  # dynamic, shaped, or fixed (chain and uniform<K> sessions)
    plan: tuple[DepthPlan, ...]  # per depth: frontier nodes expanded, children each
    budget: TreeBudget  # total_tokens kept by the final rerank, threshold, depth

    @staticmethod
    def dynamic(budget: TreeBudget) -> Candidate:
        """EAGLE-2's tree at ``budget``, as the ``full`` policy grows it."""
        return Candidate(DYNAMIC, (DepthPlan(FULL_TOP_K, FULL_TOP_K),) * budget.depth, budget)

    @staticmethod
    def shaped(widths: list[int], threshold: float) -> Candidate:
        """The static tree of ``widths``; its budget keeps every node it grows."""
        return Candidate(SHAPED, tuple(widths_to_plan(widths)), TreeBudget(tree_size(widths), threshold, len(widths)))

    @property
    def label(self) -> str:
        """``full T:t:D`` for a dynamic or fixed tree, ``shaped w1,w2,...`` for a static one (reports, logs)."""
        return f"shaped {','.join(map(str, self.widths))}" if self.kind == SHAPED else f"full {self.budget.config}"

    @functools.cached_property
    def widths(self) -> list[int]:
        """Children per expanded node, per depth: what the rank model scores."""
        return [step.children for step in self.plan]

    @functools.cached_property
    def depth(self) -> int:
        return min(len(self.plan), self.budget.depth)

    @functools.cached_property
    def tokens(self) -> int:
        """Tree tokens the verify holds (root included): the budget, or fewer when the plan grows fewer."""
        grown, nodes = 1, 1
        for d, step in enumerate(self.plan[: self.budget.depth]):
            nodes = (1 if d == 0 else min(step.expand, nodes)) * step.children
            grown += nodes
        return min(self.budget.total_tokens, grown)


def fixed_candidate(policy: TreePolicy, budget: TreeBudget) -> Candidate:
    """What the fixed policies propose: ``chain``, ``uniform<K>``, ``full`` (a dynamic tree)."""
    if policy.name == "chain":
        return Candidate(FIXED, (DepthPlan(expand=1, children=1),) * min(budget.depth, budget.total_tokens - 1), budget)
    if policy.name == "uniform":
        # every kept node may branch; no more parents than the budget can hold children of
        expand = math.ceil((budget.total_tokens - 1) / policy.branching)
        return Candidate(FIXED, (DepthPlan(expand=expand, children=policy.branching),) * budget.depth, budget)
    return Candidate.dynamic(budget)


@functools.lru_cache(maxsize=1024)
def uniform_widths(budget: TreeBudget) -> tuple[int, ...]:
    """The widest uniform static tree of the budget's depth within its tokens (a chain when none fits)."""
    if budget.depth + 1 > budget.total_tokens:
        return (1,) * (budget.total_tokens - 1)
    k = max(w for w in range(1, MAX_WIDTH + 1) if w == 1 or tree_size([w] * budget.depth) <= budget.total_tokens)
    return (k,) * budget.depth


def contains(outer: TreeBudget, inner: TreeBudget) -> bool:
    """Whether the dynamic tree at ``inner`` is the best of the nodes of the one at ``outer``."""
    smaller = inner.total_tokens <= outer.total_tokens and inner.depth <= outer.depth
    return smaller and inner.threshold >= outer.threshold


def counterfactual_accepted(tree: DraftTree, passed_ranks: list[int], budgets: list[TreeBudget]) -> list[int]:
    """Drafts each dynamic tree of ``budgets`` (each contained in ``tree``'s) would have had accepted.

    ``tree`` is listed as the proposal lists it: a node's children are consecutive nodes, best first.

    ``passed_ranks[d-1]`` is the accepted child's place among its parent's children at depth d. A
    budget's tree is ``tree``'s best total_tokens - 1 nodes of depth <= its depth and cumulative draft
    probability >= its threshold, ranked as the device ranks them (cumulative log-prob descending, ties
    to the earlier node); it accepts the longest prefix of the accepted path inside it.
    """
    parents = tree.parents.tolist()
    own = [math.log(p) if p > 0 else -1e30 for p in tree.draft_probs.tolist()]
    log_prob, depth = [0.0] * len(parents), [0] * len(parents)
    for node in range(1, len(parents)):
        parent = parents[node]
        log_prob[node] = log_prob[parent] + own[node]
        depth[node] = depth[parent] + 1
    path, node = [], 0
    for rank in passed_ranks:  # a node's children are consecutive nodes, best first
        node = parents.index(node, node + 1) + rank
        path.append(node)
    # Walk the ranking; at each path node note how many nodes of each depth ranked ahead of it. A path
    # node's log-prob never exceeds its parent's, so the ranking meets the path in path order.
    ahead_by_depth, ahead = [0] * (max(depth) + 1), []
    next_on_path = path[0] if path else -1
    for node in sorted(range(1, len(parents)), key=log_prob.__getitem__, reverse=True) if path else ():
        if node == next_on_path:
            ahead.append(ahead_by_depth.copy())
            if len(ahead) == len(path):
                break
            next_on_path = path[len(ahead)]
        ahead_by_depth[depth[node]] += 1
    accepted = []
    for budget in budgets:
        floor = math.log(budget.threshold) if budget.threshold > 0 else -math.inf
        count = 0
        while count < min(len(path), budget.depth) and log_prob[path[count]] >= floor:
            if sum(ahead[count][: budget.depth + 1]) >= budget.total_tokens - 1:
                break
            count += 1
        accepted.append(count)
    return accepted


class AcceptanceTracker:
    """Decayed mean accepted drafts per dynamic budget, smoothed toward ``prior`` (another tracker), and each
    budget's mean difference from the observing session's base on the same steps.

    A budget's counts decay only when it is observed: one measured long ago (the session has grown a
    smaller tree since) keeps its measurement until it is measured again. So its mean is of the text it
    was measured on, and only a difference paired on the same steps compares it with a base measured on
    today's: a larger tree's old mean against the base's new one would say it accepts less than the base
    it contains once the text's paths lengthen (``bench.online_replay`` at 16K on the H200's costs: a
    session held 16:0.0:4 on 66% of its steps, its paths reaching depth 4 on half of them, while 64:0.0:8's
    old mean put it a draft under 16:0.0:4).
    """

    def __init__(self, decay: float, prior: AcceptanceTracker | None = None) -> None:
        self.decay = decay
        self.prior = prior
        self.counts: dict[TreeBudget, tuple[float, float]] = {}  # budget -> (decayed steps, decayed accepted drafts)
        # budget -> (decayed steps, decayed accepted drafts less the observing session's base's on the same steps)
        self.paired: dict[TreeBudget, tuple[float, float]] = {}

    def observe(self, accepted: dict[TreeBudget, int], base: TreeBudget) -> None:
        """One step's accepted drafts per budget, and each budget's difference from ``base`` (one of them)."""
        for budget, drafts in accepted.items():
            steps, total = self.counts.get(budget, (0.0, 0.0))
            self.counts[budget] = (steps * self.decay + 1.0, total * self.decay + drafts)
            steps, total = self.paired.get(budget, (0.0, 0.0))
            self.paired[budget] = (steps * self.decay + 1.0, total * self.decay + drafts - accepted[base])
        if self.prior is not None:
            self.prior.observe(accepted, base)

    def difference(self, budget: TreeBudget, guess: float) -> float:
        """Accepted drafts per step at ``budget`` less the base's on the same steps; ``guess`` stands in where
        nothing was measured."""
        steps, total = self.paired.get(budget, (0.0, 0.0))
        return (total + PRIOR_WEIGHT * guess) / (steps + PRIOR_WEIGHT)

    def mean(self, budget: TreeBudget, guess: float) -> float:
        """Accepted drafts per step at ``budget``; ``guess`` stands in where nothing was measured."""
        prior = self.prior.mean(budget, guess) if self.prior is not None else guess
        steps, total = self.counts.get(budget, (0.0, 0.0))
        return (total + PRIOR_WEIGHT * prior) / (steps + PRIOR_WEIGHT)


class SessionAcceptance:
    """A session's accepted drafts per dynamic budget, each measured against ``base`` on the same steps.

    ``base`` is inside every dynamic tree the session proposes, so every dynamic step measures it; a
    budget measured on fewer steps (one larger than the current tree, measured at probes) is estimated
    as the base's mean over all steps plus its mean difference from the base on the steps that
    measured both: a paired difference varies far less than an accepted length does. Each is smoothed
    toward ``prior`` (the global tracker) worth ``PRIOR_WEIGHT`` steps, the difference toward the global
    one (``AcceptanceTracker.difference``, paired too) in proportion to the session's base over the global
    one: a larger tree's gain grows with how far the text's paths run, so on text whose paths stop early the
    other requests' gains (measured on easier text, or on a shorter context) are not lent at full size (on
    the H100 at 16K, a session accepting 1-2 drafts a step grew its trees to 64 and 96 tokens on them and
    decoded 13% slower than the 16-token tree it started from).
    """

    def __init__(self, base: TreeBudget, decay: float, prior: AcceptanceTracker) -> None:
        self.base = base
        self.decay = decay
        self.prior = prior
        self.base_counts = (0.0, 0.0)  # (decayed steps, decayed accepted drafts) of the base
        self.differences: dict[TreeBudget, tuple[float, float]] = {}  # (decayed steps, decayed accepted - base's)

    def observe(self, accepted: dict[TreeBudget, int]) -> None:
        """One dynamic step's accepted drafts per budget inside its tree, the base's among them."""
        base = accepted[self.base]
        steps, total = self.base_counts
        self.base_counts = (steps * self.decay + 1.0, total * self.decay + base)
        for budget, drafts in accepted.items():
            steps, total = self.differences.get(budget, (0.0, 0.0))
            self.differences[budget] = (steps * self.decay + 1.0, total * self.decay + drafts - base)
        self.prior.observe(accepted, self.base)

    def mean(self, budget: TreeBudget, guess: Callable[[TreeBudget], float]) -> float:
        """Accepted drafts per step at ``budget``; ``guess`` stands in for budgets nobody measured."""
        prior_base = self.prior.mean(self.base, guess(self.base))
        steps, total = self.base_counts
        base = (total + PRIOR_WEIGHT * prior_base) / (steps + PRIOR_WEIGHT)
        steps, total = self.differences.get(budget, (0.0, 0.0))
        proportion = base / prior_base if prior_base > 0 else 1.0
        prior_difference = self.prior.difference(budget, guess(budget) - guess(self.base)) * proportion
        return base + (total + PRIOR_WEIGHT * prior_difference) / (steps + PRIOR_WEIGHT)


class Calibration:
    """Decayed ratio of the tokens shaped trees emitted to what the rank model predicted for them.

    The rank model takes the accepted path's node to be expanded at every depth; a shaped tree
    expands only the best few nodes, and a path that reaches one left unexpanded ends there (a leaf,
    censored for the hazard estimates). The ratio scales the model's E(w) by what such trees realised.
    """

    def __init__(self, decay: float, prior: Calibration | None = None) -> None:
        self.decay = decay
        self.prior = prior
        self.realised = 0.0  # decayed tokens emitted per step, summed
        self.predicted = 0.0  # decayed E(w) of the same steps, summed

    def observe(self, realised: float, predicted: float) -> None:
        self.realised = self.realised * self.decay + realised
        self.predicted = self.predicted * self.decay + predicted
        if self.prior is not None:
            self.prior.observe(realised, predicted)

    @property
    def ratio(self) -> float:
        prior = self.prior.ratio if self.prior is not None else 1.0
        return (self.realised + CALIBRATION_PRIOR_TOKENS * prior) / (self.predicted + CALIBRATION_PRIOR_TOKENS)


def nested_probes(budgets: list[TreeBudget]) -> tuple[Candidate, ...]:
    """One dynamic tree per size of ``budgets``, ascending, at their lowest threshold and as deep as any budget
    of its size or smaller: each probe measures every candidate it is as large as, and the last every candidate."""
    threshold, depth, probes = min(b.threshold for b in budgets), 0, []
    for tokens in sorted({b.total_tokens for b in budgets}):
        depth = max(depth, *(b.depth for b in budgets if b.total_tokens == tokens))
        probes.append(Candidate.dynamic(TreeBudget(tokens, threshold, depth)))
    return tuple(probes)


@dataclass(frozen=True)
class Bound:
    """What every tree of a verify batch may hold: the batch pads its trees to the widest, and proposes
    as deep as the deepest."""

    tokens: int  # tree tokens per session, root included
    depth: int  # draft depths

    def fits(self, candidate: Candidate) -> bool:
        return candidate.tokens <= self.tokens and candidate.depth <= self.depth


@dataclass
class SharedMeasurements:
    """What all online sessions of a runtime measure together: the prior of each session's own."""

    accepted: AcceptanceTracker = field(default_factory=lambda: AcceptanceTracker(GLOBAL_ACCEPT_DECAY))
    calibration: Calibration = field(default_factory=lambda: Calibration(GLOBAL_ACCEPT_DECAY))


@dataclass(eq=False)
class TreePlanner:
    """One ``online`` session's candidates, what it measured of them, and the one it proposes now."""

    dynamic: list[Candidate]  # the request's own budget first, then the grid's
    shaped: Candidate  # the hazard-shaped tree, climbed at every re-plan
    accepted: SessionAcceptance  # dynamic trees' accepted drafts
    calibration: Calibration  # shaped trees' realised over predicted tokens
    current: Candidate = field(init=False)  # the candidate proposed until the next re-plan
    probes: tuple[Candidate, ...] = field(init=False)  # nested dynamic trees, ascending (``nested_probes``)
    current_model_tokens: float = field(init=False, default=0.0)  # the rank model's E of ``current`` when chosen
    observed_steps: int = field(init=False, default=0)
    shaped_proposals: int = field(init=False, default=0)  # shaped trees proposed since the last dynamic one

    def __post_init__(self) -> None:
        self.current = self.dynamic[0]  # a request starts from its own budget (a tuned profile's, say)
        self.probes = nested_probes([c.budget for c in self.dynamic])

    @property
    def max_tokens(self) -> int:
        return max(c.budget.total_tokens for c in self.dynamic)

    @property
    def max_depth(self) -> int:
        return max(c.budget.depth for c in self.dynamic)

    @staticmethod
    def start(
        budget: TreeBudget, shared: SharedMeasurements, grid: tuple[TreeBudget, ...] = CANDIDATE_GRID
    ) -> TreePlanner:
        dynamic = [Candidate.dynamic(b) for b in dict.fromkeys([budget, *grid])]
        shaped = Candidate.shaped(list(uniform_widths(budget)), budget.threshold)
        budgets = [c.budget for c in dynamic]
        base = TreeBudget(
            min(b.total_tokens for b in budgets), max(b.threshold for b in budgets), min(b.depth for b in budgets)
        )  # fmt: skip
        accepted = SessionAcceptance(base, SESSION_ACCEPT_DECAY, shared.accepted)
        return TreePlanner(dynamic, shaped, accepted, Calibration(SESSION_ACCEPT_DECAY, shared.calibration))

    def observe(self, tree: DraftTree, proposed: Candidate, passed_ranks: list[int]) -> None:
        """One verified step of ``proposed``: a dynamic tree measures every dynamic candidate inside it, a
        shaped one the rank model's calibration."""
        self.observed_steps += 1
        if proposed.kind == SHAPED and proposed == self.current:
            self.calibration.observe(1.0 + len(passed_ranks), self.current_model_tokens)
        elif proposed.kind == DYNAMIC:
            inside = [self.accepted.base, *(c.budget for c in self.dynamic if contains(proposed.budget, c.budget))]
            self.accepted.observe(dict(zip(inside, counterfactual_accepted(tree, passed_ranks, inside))))

    def expected(self, candidate: Candidate, passes: list[list[float]]) -> float:
        """E(c): tokens per step, measured for dynamic trees, the calibrated rank model for shaped ones."""
        if candidate.kind == DYNAMIC:
            shaped, ratio = self.shaped, self.calibration.ratio

            def guess(budget: TreeBudget) -> float:  # drafts of the best static tree known of its size and depth
                known = [uniform_widths(budget)]
                if Bound(budget.total_tokens, budget.depth).fits(shaped):
                    known.append(tuple(shaped.widths))
                return ratio * max(expected_tokens(passes, widths) for widths in known) - 1.0

            return 1.0 + self.accepted.mean(candidate.budget, guess)
        return self.calibration.ratio * expected_tokens(passes, candidate.widths)

    def expectations(self, hazard: HazardProfile) -> dict[Candidate, float]:
        """E of each candidate (dynamic ones and the current shaped tree) from the measurements so far."""
        passes = hazard.pass_table(self.max_depth)
        return {c: self.expected(c, passes) for c in [*self.dynamic, self.shaped]}

    def bounds(self) -> list[Bound]:
        """The bounds of its dynamic candidates: what a batch may choose among for it."""
        return [Bound(c.tokens, c.depth) for c in self.dynamic]

    @staticmethod
    def best_within(bound: Bound, expectations: dict[Candidate, float]) -> tuple[Candidate, float] | None:
        """The candidate expected to emit most within ``bound`` (the fewer tokens on a tie), if any fits."""
        fitting = [(e, -c.tokens, i, c) for i, (c, e) in enumerate(expectations.items()) if bound.fits(c)]
        if not fitting:
            return None
        expected, _, _, best = max(fitting)
        return best, expected

    def choose(self, hazard: HazardProfile, bound: Bound) -> tuple[Candidate, float]:
        """Re-plan within ``bound``: climb the shaped tree a few moves toward the most expected tokens, then
        take the best candidate that fits; with the tokens per step it expects."""
        passes, ratio = hazard.pass_table(self.max_depth), self.calibration.ratio
        start = self.shaped.widths
        if not bound.fits(self.shaped):
            start = list(uniform_widths(TreeBudget(bound.tokens, 0.0, bound.depth)))
        widths = climb(lambda w: ratio * expected_tokens(passes, w), start, bound.tokens, bound.depth)
        self.shaped = Candidate.shaped(widths, self.shaped.budget.threshold)
        best = self.best_within(bound, {c: self.expected(c, passes) for c in [*self.dynamic, self.shaped]})
        assert best is not None  # the shaped tree fits
        self.current = best[0]
        self.current_model_tokens = expected_tokens(passes, self.current.widths)
        return best

    def proposal(self, bound: Bound) -> Candidate:
        """The tree to propose this step: ``current``, or, one step in ``RECHECK_EVERY`` of a run of shaped
        trees, the largest dynamic candidate within ``bound`` (the recheck of the module)."""
        fitting = [c for c in self.dynamic if bound.fits(c)]
        if self.current.kind != SHAPED or not fitting:
            self.shaped_proposals = 0
            return self.current
        self.shaped_proposals += 1
        if self.shaped_proposals < RECHECK_EVERY:
            return self.current
        self.shaped_proposals = 0
        return max(fitting, key=lambda c: (c.tokens, c.depth))
