"""The hazard profile: where accepted paths stop, and the tree budget that follows from it.

Terms. Per verification step the *stop depth* s is the number of accepted draft tokens. A
path *reaches* depth d (1-based draft depth) when s >= d - 1; it *passes* d when the target
accepts one of the node's children there. The hazard h(d) = P(stop at d | reached d) and the
survival S(d) = prod_{k<d} (1 - h(k)) = P(reach d). A step whose path ran off the end of the
tree is censored at the tree's depth (it did not stop; the tree ended).

Estimates. Children are proposed best-first, so at a node the target tries sibling rank 0,
then 1, ... For every depth and rank r we count, with exponential decay (so estimates follow
the text when it changes regime), how often rank r was tried and how often it failed too; the
failure rate f_r is smoothed toward a prior (the global profile, which every request feeds, and
before any data a fixed guess) worth a few pseudo-observations, and clamped to [EPS, 1 - EPS],
so it never reaches 0 or 1 and one noisy step moves it little. Then
    P(pass d | width w) = 1 - prod_{r<w} f_r(d),     h(d) = 1 - P(pass d | w_d).
A rank never tried keeps its prior, so a wider fan is predicted to help in proportion to the
top-1 hazard, and the prediction is corrected once wider trees are verified.

Budget rule. A plan gives each depth d a width w_d (children per expanded node; the best
w_{d-1} nodes of depth d-1 are expanded). The expected tokens per step are
    E(w) = 1 + sum_d prod_{j<=d} P(pass j | w_j)        (the 1 is the bonus token)
and a step costs  T(w) = D * t_draft + c(N(w)),  N(w) = 1 + w_1 + sum_{d>=2} w_{d-1} w_d,
with c(N) the verification cost measured as a function of the tokens a verify batch holds (a
running least-squares line) and t_draft the measured draft time per depth. In a batch, one
session's tree shares the verify with the others' trees: its plan maximises the batch's
tokens per second, (E(w) + E_others) / (max(D, D_others) * t_draft + c(N(w) + N_others)), the others' trees
taken as they were at the last step. A large batch at a compute-bound verify so gets
smaller trees, and a lone session keeps the tree that pays for itself alone. For every depth D the plan starts as a
chain of D tokens and greedily takes whichever single extra child (at any depth) raises E/T
most, until none does or the token budget is spent; the best of these plans wins. Widths
therefore grow where the hazard is high (a wider fan there saves the path most often), and the
depth stops where S(d) is too small for another level to pay for itself; trying every D keeps
one hard depth from hiding profitable depths behind it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from draft_service.tree_budget import DepthPlan

EPS = 0.02
MAX_WIDTH = 10
PRIOR_TOP1_FAIL = 0.25  # before any data: P(the best child is rejected); optimistic, so unseen depths get explored
PRIOR_NEXT_FAIL = 0.7  # before any data: P(the next sibling is rejected too)
PRIOR_WEIGHT = 3.0  # pseudo-observations a prior is worth
RESCALE_BELOW = 1e-200  # the decay scale folded into the counts before it underflows


@dataclass
class DepthCounts:
    tried: list[float] = field(default_factory=lambda: [0.0] * MAX_WIDTH)  # decayed tries per sibling rank
    failed: list[float] = field(default_factory=lambda: [0.0] * MAX_WIDTH)  # decayed failures per sibling rank


class HazardProfile:
    """Decayed per-depth, per-rank counts; ``prior`` (another profile) smooths this one's estimates."""

    def __init__(self, max_depth: int, decay: float, prior: HazardProfile | None = None) -> None:
        self.max_depth = max_depth
        self.decay = decay
        self.prior = prior
        self.depths = [DepthCounts() for _ in range(max_depth)]
        # A count is its stored value times ``_scale``: a step decays every count by shrinking the scale
        # and adds its own counts divided by it, so it touches only the depths it observed.
        self._scale = 1.0

    def observe(self, passed_ranks: list[int], stop_width: int) -> None:
        """One verification step.

        ``passed_ranks[d-1]`` is the sibling rank of the accepted child at depth d; at the next
        depth the path stopped after all ``stop_width`` children failed (0: the path reached a
        leaf, so the step is censored there).
        """
        self._scale *= self.decay
        if self._scale < RESCALE_BELOW:
            self._fold_scale()
        one = 1.0 / self._scale
        outcomes = [(rank, True) for rank in passed_ranks] + [(stop_width, False)]
        for counts, (rank, passed) in zip(self.depths, outcomes):
            for r in range(min(rank + 1 if passed else rank, MAX_WIDTH)):
                counts.tried[r] += one
                counts.failed[r] += 0 if passed and r == rank else one
        if self.prior is not None:
            self.prior.observe(passed_ranks, stop_width)

    def _fold_scale(self) -> None:
        """Move the scale into the stored counts before it underflows."""
        for counts in self.depths:
            counts.tried = [c * self._scale for c in counts.tried]
            counts.failed = [c * self._scale for c in counts.failed]
        self._scale = 1.0

    def fail_rate(self, depth: int, rank: int) -> float:
        """f_r(d): P(sibling ``rank`` is rejected | all better siblings were), depth 1-based."""
        if self.prior is not None:
            prior = self.prior.fail_rate(depth, rank)
        else:
            prior = PRIOR_TOP1_FAIL if rank == 0 else PRIOR_NEXT_FAIL
        if depth > self.max_depth or rank >= MAX_WIDTH:
            return prior
        counts = self.depths[depth - 1]
        failed, tried = counts.failed[rank] * self._scale, counts.tried[rank] * self._scale
        estimate = (failed + PRIOR_WEIGHT * prior) / (tried + PRIOR_WEIGHT)
        return max(EPS, min(1.0 - EPS, estimate))

    def pass_probability(self, depth: int, width: int) -> float:
        """P(the path passes ``depth`` | it reached it with ``width`` children proposed)."""
        return self._passes(depth)[min(width, MAX_WIDTH)]

    def pass_table(self, max_depth: int) -> list[list[float]]:
        """Row d - 1, column w: P(pass d | w children), for d = 1..max_depth and w = 0..MAX_WIDTH.

        A planner scores thousands of candidate widths per step; each reads this table instead of
        walking the counts (and the prior's) again.
        """
        return [self._passes(depth) for depth in range(1, max_depth + 1)]

    def _passes(self, depth: int) -> list[float]:
        """P(pass ``depth`` | w children) for w = 0..MAX_WIDTH; width 0 counts as 1 (the best child is always tried)."""
        all_fail, row = 1.0, []
        for rank in range(MAX_WIDTH):
            all_fail *= self.fail_rate(depth, rank)
            row.append(1.0 - all_fail)
        return [row[0], *row]

    def hazard(self, widths: list[int]) -> list[float]:
        """h(d) for d = 1..len(widths) at the given widths."""
        return [1.0 - self.pass_probability(d, w) for d, w in enumerate(widths, start=1)]

    def survival(self, widths: list[int]) -> list[float]:
        """S(d) = P(reach d) for d = 1..len(widths) + 1."""
        alive, out = 1.0, []
        for d, w in enumerate(widths, start=1):
            out.append(alive)
            alive *= self.pass_probability(d, w)
        return [*out, alive]


@dataclass
class StepCostModel:
    """Running least-squares line c(N) = a + b N for verification, plus draft time per depth.

    Seconds are as measured by whoever feeds it; before any measurement the defaults make a
    verification of N tokens cost like N/100 extra decode steps and a draft depth 5% of one.
    """

    decay: float = 0.98
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # decayed n, sum N, sum N^2, sum c, sum N c
    draft_seconds_per_depth: float = 0.05  # replaced by the first measurement, then a running average
    default_intercept: float = 1.0
    default_slope: float = 0.01
    draft_measured: bool = False

    def observe_verify(self, tree_tokens: int, seconds: float) -> None:
        self.sums = [s * self.decay for s in self.sums]
        for i, value in enumerate((1.0, tree_tokens, tree_tokens**2, seconds, tree_tokens * seconds)):
            self.sums[i] += value

    def observe_draft(self, depths: int, seconds: float) -> None:
        if depths <= 0:
            return
        if not self.draft_measured:  # the default is in relative units: never average it with seconds
            self.draft_seconds_per_depth, self.draft_measured = seconds / depths, True
        else:
            self.draft_seconds_per_depth = 0.9 * self.draft_seconds_per_depth + 0.1 * seconds / depths

    def verify_seconds(self, tree_tokens: int) -> float:
        n, sx, sxx, sy, sxy = self.sums
        if n < 1.0:
            return self.default_intercept + self.default_slope * tree_tokens
        spread = n * sxx - sx * sx
        slope = (n * sxy - sx * sy) / spread if spread > 1e-9 * max(1.0, n * sxx) else 0.0
        slope = max(slope, 0.0)
        intercept = max((sy - slope * sx) / n, 1e-9)
        return intercept + slope * tree_tokens


def tree_size(widths: list[int]) -> int:
    """Nodes of a tree whose depth d expands the best w_{d-1} nodes into w_d children each."""
    total, expanded = 1, 1
    for w in widths:
        total += expanded * w
        expanded = w
    return total


@dataclass(frozen=True)
class BatchLoad:
    """What the rest of a verify batch brings: the other sessions' trees at the last step."""

    tree_tokens: int = 0  # tokens of the other sessions' trees
    expected_tokens: float = 0.0  # tokens the other sessions expect to emit per step
    depth: int = 0  # the deepest of their trees: a batched proposal runs that many head passes anyway


PLAN_HYSTERESIS = 0.03  # a new plan must beat the current one by 3% to replace it


def expected_tokens(passes: list[list[float]], widths: list[int]) -> float:
    """E(w): the bonus token plus, per depth, the probability that the path passes it."""
    expected, alive = 1.0, 1.0
    for depth, width in enumerate(widths):
        alive *= passes[depth][width]
        expected += alive
    return expected


def plan_tree(
    profile: HazardProfile,
    cost: StepCostModel,
    max_tokens: int,
    max_depth: int,
    current: list[int] | None = None,
    batch: BatchLoad = BatchLoad(),
) -> list[int]:
    """Widths per depth maximising expected tokens per second (the module docstring's rule).

    The ``current`` plan is kept unless the new one is clearly better, so estimation noise
    does not flip the tree shape back and forth between near-equal plans.
    """

    passes = profile.pass_table(max(max_depth, len(current or [])))

    def value(widths: list[int]) -> float:
        tokens = batch.tree_tokens + tree_size(widths)
        seconds = max(len(widths), batch.depth) * cost.draft_seconds_per_depth + cost.verify_seconds(tokens)
        return (batch.expected_tokens + expected_tokens(passes, widths)) / seconds

    def widen(widths: list[int]) -> list[int]:
        """Greedily add the one child (at any depth) that raises the value most, until none does."""
        best = value(widths)
        while True:
            options = [widths[:d] + [w + 1] + widths[d + 1 :] for d, w in enumerate(widths) if w < MAX_WIDTH]
            scored = [(value(o), o) for o in options if tree_size(o) <= max_tokens]
            if not scored or max(scored)[0] <= best * (1 + 1e-4):
                return widths
            best, widths = max(scored)

    # Every depth is tried as a chain then widened: a hard depth can hide a profitable one after it.
    candidates = [widen([1] * depth) for depth in range(1, max_depth + 1) if depth + 1 <= max_tokens]
    widths = max(candidates, key=value)
    best = value(widths)
    fits = current and len(current) <= max_depth and tree_size(current) <= max_tokens
    return current if fits and value(current) * (1 + PLAN_HYSTERESIS) >= best else widths


def widths_to_plan(widths: list[int]) -> list[DepthPlan]:
    """Depth d expands the best w_{d-1} nodes (the root at depth 1) into w_d children each."""
    return [DepthPlan(expand=widths[d - 1] if d else 1, children=w) for d, w in enumerate(widths)]
