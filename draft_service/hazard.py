"""The hazard profile: where accepted paths stop, and the hazard-shaped tree that follows from it.

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

Shaped trees. A plan gives each depth d a width w_d (children per expanded node; the best
w_{d-1} nodes of depth d-1 are expanded). The expected tokens per step are
    E(w) = 1 + sum_d prod_{j<=d} P(pass j | w_j)        (the 1 is the bonus token)
and the tree holds N(w) = 1 + w_1 + sum_{d>=2} w_{d-1} w_d tokens. ``climb`` improves a plan by
hill climbing on whatever value the caller scores plans with (``draft_service.tree_plan``: the
expected tokens within the batch's bound): each move takes the best neighbour, one child more or fewer
at one depth or one depth more or fewer, while it raises the value. Widths so grow where the
hazard is high (a wider fan there saves the path most often), and the depth stops where S(d) is
too small for another level to pay for itself. A few moves per re-plan, from the last plan: the
plan follows the hazard and the costs step by step, and no re-plan searches from scratch.

Costs. ``StepCostModel`` measures a step: draft seconds per depth, and verify seconds against the
batch's padded rows (sessions x the widest tree), one table per context bucket (verify attention
over a long context turns compute-bound with far fewer tree tokens than over a short one).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable

from diffspec.cuda_graphs import graph_bucket
from draft_service.tree_budget import DepthPlan

EPS = 0.02
MAX_RATE = 1.0 - EPS
MAX_WIDTH = 10
PRIOR_TOP1_FAIL = 0.25  # before any data: P(the best child is rejected); optimistic, so unseen depths get explored
PRIOR_NEXT_FAIL = 0.7  # before any data: P(the next sibling is rejected too)
PRIOR_WEIGHT = 3.0  # pseudo-observations a prior is worth
DEFAULT_FAIL_RATES = [PRIOR_TOP1_FAIL] + [PRIOR_NEXT_FAIL] * (MAX_WIDTH - 1)
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
        self.steps = 0  # steps observed
        self.last_passed_ranks: list[int] = []  # the latest step's: a planner pairs them with the tree it proposed
        # The estimates move only when a step is observed (here or in a prior): until then each depth's failure
        # rates, and the planner's pass table, are computed once (a shared prior serves every session's plan).
        self._fail_rates: dict[int, list[float]] = {}  # depth -> f_r(d)
        self._fail_rates_key: tuple[int, ...] = ()  # the ``_version`` they were computed at
        self._pass_table: list[list[float]] = []
        self._pass_table_key: tuple[tuple[int, ...], int] | None = None  # (``_version``, depths) it was made at

    def observe(self, passed_ranks: list[int], stop_width: int) -> None:
        """One verification step.

        ``passed_ranks[d-1]`` is the sibling rank of the accepted child at depth d; at the next
        depth the path stopped after all ``stop_width`` children failed (0: the path reached a
        leaf, so the step is censored there).
        """
        self.steps += 1
        self.last_passed_ranks = passed_ranks
        self._scale *= self.decay
        if self._scale < RESCALE_BELOW:
            self._fold_scale()
        one = 1.0 / self._scale
        # at a passed depth every better sibling was tried and failed, then the passed one was tried; at the
        # stop depth all stop_width children were tried and failed
        outcomes = [*passed_ranks, stop_width]
        for depth, (counts, rank) in enumerate(zip(self.depths, outcomes)):
            tried, failed = counts.tried, counts.failed
            for r in range(min(rank, MAX_WIDTH)):
                tried[r] += one
                failed[r] += one
            if depth < len(passed_ranks) and rank < MAX_WIDTH:
                tried[rank] += one
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
        if rank >= MAX_WIDTH:
            return self.prior.fail_rate(depth, rank) if self.prior is not None else PRIOR_NEXT_FAIL
        return self.fail_rates(depth)[rank]

    def fail_rates(self, depth: int) -> list[float]:
        """f_r(d) for r = 0..MAX_WIDTH - 1 (one pass over the depth's counts and the prior's, once per observed
        step; the list is shared, not to be modified)."""
        version = self._version()
        if self._fail_rates_key != version:
            self._fail_rates, self._fail_rates_key = {}, version
        rates = self._fail_rates.get(depth)
        if rates is None:
            rates = self._fail_rates[depth] = self._compute_fail_rates(depth)
        return rates

    def _version(self) -> tuple[int, ...]:
        """Steps observed by this profile and by each prior below it: the estimates change only with them."""
        return (self.steps, *self.prior._version()) if self.prior is not None else (self.steps,)

    def _compute_fail_rates(self, depth: int) -> list[float]:
        prior = self.prior.fail_rates(depth) if self.prior is not None else DEFAULT_FAIL_RATES
        if depth > self.max_depth:
            return prior
        counts, scale, rates = self.depths[depth - 1], self._scale, []
        for failed, tried, p in zip(counts.failed, counts.tried, prior):
            rate = (failed * scale + PRIOR_WEIGHT * p) / (tried * scale + PRIOR_WEIGHT)
            rates.append(EPS if rate < EPS else MAX_RATE if rate > MAX_RATE else rate)  # not min/max: host time
        return rates

    def pass_probability(self, depth: int, width: int) -> float:
        """P(the path passes ``depth`` | it reached it with ``width`` children proposed)."""
        return self._passes(depth)[min(width, MAX_WIDTH)]

    def pass_table(self, max_depth: int) -> list[list[float]]:
        """Row d - 1, column w: P(pass d | w children), for d = 1..max_depth and w = 0..MAX_WIDTH.

        A planner scores thousands of candidate widths per step; each reads this table instead of
        walking the counts (and the prior's) again.
        """
        key = (self._version(), max_depth)
        if self._pass_table_key != key:
            self._pass_table = [self._passes(depth) for depth in range(1, max_depth + 1)]
            self._pass_table_key = key
        return self._pass_table

    def _passes(self, depth: int) -> list[float]:
        """P(pass ``depth`` | w children) for w = 0..MAX_WIDTH; width 0 counts as 1 (the best child is always tried)."""
        all_fail, row = 1.0, []
        for fail in self.fail_rates(depth):
            all_fail *= fail
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


CONTEXT_BUCKETS = 24  # context buckets [2^(k-1), 2^k) tokens, k = bit length: up to 8M tokens


@dataclass
class VerifyTable:
    """Verify seconds against padded rows at one context bucket: a decayed mean per rows value measured.

    A batch's trees are padded to its widest, so a verify computes batch x widest rows; its cost is flat
    while the weights' read dominates and steep once the attention and matmuls turn compute-bound. A
    table keeps each size it measured (a size decays only when measured again), so a batch that stays
    at one size for long still knows what the others cost.

    A *seed* (the target's graphs timed at warm-up, with no context) gives the curve's shape, the
    measurements its level: the estimate is the seed plus the measured excess over it, exact at each
    measured size, linear between them and flat past them. A size never measured then costs what the
    seed says it adds, not what a context-free timing says it costs.
    """

    cells: dict[int, tuple[float, float]] = field(default_factory=dict)  # rows -> (decayed steps, decayed seconds)
    seed: dict[int, float] = field(default_factory=dict)  # rows -> seconds timed before serving

    def observe(self, rows: int, seconds: float, decay: float) -> None:
        steps, total = self.cells.get(rows, (0.0, 0.0))
        self.cells[rows] = (steps * decay + 1.0, total * decay + seconds)

    @property
    def measured(self) -> bool:
        return bool(self.cells)

    def curve(self) -> Callable[[int], float]:
        """Seconds at any rows: the seed (0 without one) plus the measured excess over it, linear between the
        measured sizes around it and flat past the smallest and the largest (without a seed, a larger batch
        looks no dearer than the largest measured until one is measured, so the planner tries it once)."""
        seed = _piecewise_linear(sorted(self.seed.items())) if self.seed else lambda rows: 0.0
        excess = [(rows, total / steps - seed(rows)) for rows, (steps, total) in sorted(self.cells.items())]
        measured = _piecewise_linear(excess) if excess else lambda rows: 0.0
        return lambda rows: seed(rows) + measured(rows)


def _piecewise_linear(points: list[tuple[int, float]]) -> Callable[[int], float]:
    """Through ``points`` (ascending x): linear between them, flat past the first and the last."""
    sizes = [x for x, _ in points]

    def at(x: int) -> float:
        above = bisect.bisect_left(sizes, x)
        if above == len(points):
            return points[-1][1]
        if above == 0 or sizes[above] == x:
            return points[above][1]
        (x0, y0), (x1, y1) = points[above - 1], points[above]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    return at


@dataclass
class StepCostModel:
    """Verify seconds per (context bucket, padded rows), a proposal's seconds by depth (a fixed part and a part
    per depth, ``draft_seconds``), and a step's time outside both.

    Seconds are as measured by whoever feeds it; before any measurement the defaults make a
    verification of N rows cost like N/100 extra decode steps and a draft depth 5% of one. A
    verify measurement is filed under the context of the batch proposed just before it
    (``note_batch``): the verify that follows a proposal verifies that proposal's trees.

    The overhead is the rest of a whole step (``observe_step``): the accept, the host work around the
    proposal and the verify, the engine loop, transfers. Every tree pays it alike, so it changes no cost
    difference between trees, but it is part of what each step's tokens are weighed against: left out,
    a tree that emits more for a costlier verify looks worse than it is (on an H200 with an 8B-shaped
    target the overhead is 2-4 ms of a 12-20 ms step).
    """

    decay: float = 0.9
    tables: list[VerifyTable] = field(default_factory=lambda: [VerifyTable() for _ in range(CONTEXT_BUCKETS)])
    draft_seconds_per_depth: float = 0.05  # replaced by the first measurement, then a running average
    # (batch bucket, attended bucket): the batch's bit length and its sessions' mean attended tokens' (``_bucket``)
    # -> depth -> a proposal's seconds, running average
    draft_seconds_by_shape: dict[tuple[int, int], dict[int, float]] = field(default_factory=dict)
    default_intercept: float = 1.0
    default_slope: float = 0.01
    draft_measured: bool = False
    step_overhead_seconds: float = 0.0  # a step's time outside its proposal and its verify, a running average
    overhead_measured: bool = False
    batch_context: int = 0  # mean committed tokens per session of the batch last proposed for
    graph_batch_sizes: tuple[int, ...] = ()  # the target's step graph buckets, from the seed (none: unpadded)
    graph_tree_sizes: tuple[int, ...] = ()

    def note_batch(self, context_tokens: int) -> None:
        """The mean context per session of the batch whose trees the next verify measures."""
        self.batch_context = context_tokens

    def seed_verify(self, costs: dict[tuple[int, int], float]) -> None:
        """Seconds per step graph bucket (batch, tree tokens) timed before serving (the target's warm-up, at no
        context): every context bucket's curve takes its shape by the bucket's rows (buckets of equal rows
        averaged), so a size the batch has not met is predicted from what it adds in that timing, at the
        level the bucket's measurements set (``VerifyTable``); and a verify is priced at the rows of the
        bucket it runs in (``computed_rows``)."""
        by_rows: dict[int, list[float]] = {}
        for (batch, tree), seconds in costs.items():
            by_rows.setdefault(batch * tree, []).append(seconds)
        for table in self.tables:
            table.seed = {rows: sum(times) / len(times) for rows, times in sorted(by_rows.items())}
        self.graph_batch_sizes = tuple(sorted({batch for batch, _ in costs}))
        self.graph_tree_sizes = tuple(sorted({tree for _, tree in costs}))

    def computed_rows(self, batch: int, tokens: int) -> int:
        """Rows a verify of ``batch`` trees of at most ``tokens`` nodes computes: the whole step graph bucket it
        runs in, as the target measures it (three 96-node trees run a (4, 128) graph: 512 rows, not 288), else
        the trees padded to the widest."""
        bucket = graph_bucket(batch, tokens, self.graph_batch_sizes, self.graph_tree_sizes)
        return bucket[0] * bucket[1] if bucket is not None else batch * tokens

    def observe_verify(self, rows: int, seconds: float) -> None:
        """One verify of ``rows`` padded rows (sessions x the widest tree's tokens)."""
        self.tables[_bucket(self.batch_context)].observe(rows, seconds, self.decay)

    def observe_draft(self, depths: int, seconds: float, batch: int = 1, attended_tokens: int = 0) -> None:
        """One proposal ``depths`` deep for ``batch`` sessions, each attending to ``attended_tokens`` entries on
        average (a working set's, or the whole context's), that took ``seconds`` on the device."""
        if depths <= 0:
            return
        if not self.draft_measured:  # the default is in relative units: never average it with seconds
            self.draft_seconds_per_depth, self.draft_measured = seconds / depths, True
        else:
            self.draft_seconds_per_depth = 0.9 * self.draft_seconds_per_depth + 0.1 * seconds / depths
        points = self.draft_seconds_by_shape.setdefault((batch.bit_length(), _bucket(attended_tokens)), {})
        last = points.get(depths)
        points[depths] = seconds if last is None else 0.9 * last + 0.1 * seconds

    def draft_seconds(self, depth: int, batch: int = 1, attended_tokens: int = 0) -> float:
        """A proposal ``depth`` deep for ``batch`` sessions attending to ``attended_tokens`` entries each: on the
        line through the depths measured so far at the nearest (attended bucket, batch bucket) measured (the
        attended context's first, then the batch's; powers of two; the larger on a tie), least squares.

        A proposal has a part that does not grow with depth (the final rerank, the tree's mask, staging);
        priced per depth alone, that part makes the depths being proposed look dearer per depth than they
        are at any other depth, and a planner proposing shallow trees would price deep ones too high and
        stay shallow. Batches apart: on an H200 an 8B-shaped head's 8-depth proposal takes 1.8 ms for one
        session and 2.5 ms for 16, and a line through depths measured at different batches would tilt with
        whichever batch each depth met. Attended contexts apart, for the same reason: each depth attends to
        every entry a session attends to, so at 64K a whole-context session's depth costs far more than a
        working set's (an H100, the 8B-shaped head: 1.51 against 0.99 ms for 6 depths), and one runtime serving
        both would price a working set's depths at a mix (and its deep trees too dear). With fewer than two
        depths measured there is no line: per depth, as averaged over every proposal."""
        tables = self.draft_seconds_by_shape
        home = (batch.bit_length(), _bucket(attended_tokens))

        def distance(key: tuple[int, int]) -> tuple[int, int, int, int]:
            return abs(key[1] - home[1]), abs(key[0] - home[0]), -key[1], -key[0]

        points = tables[min(tables, key=distance)] if tables else {}
        if len(points) < 2:
            return depth * self.draft_seconds_per_depth
        depths, seconds = list(points), list(points.values())
        mean_depth, mean_seconds = sum(depths) / len(depths), sum(seconds) / len(seconds)
        spread = sum((d - mean_depth) ** 2 for d in depths)
        slope = sum((d - mean_depth) * (t - mean_seconds) for d, t in zip(depths, seconds)) / spread
        slope = max(slope, 0.0)  # a deeper proposal never costs less: noise at close depths can say otherwise
        intercept = mean_seconds - slope * mean_depth
        if intercept < 0:  # through the origin: cost per depth alone, fitted to every point
            intercept, slope = 0.0, sum(d * t for d, t in zip(depths, seconds)) / sum(d * d for d in depths)
        return intercept + slope * depth

    def observe_step(self, step_seconds: float, proposal_seconds: float, verify_seconds: float) -> None:
        """One whole step (wall time from one proposing draft call to the next) whose proposal took
        ``proposal_seconds`` and whose verify ``verify_seconds`` on the device. A step far longer than the
        average (a request's start ingesting its prompt, say) moves it by at most twice the average. The first
        step has no average to bound it and is the likeliest to hold a one-off start (a lazy capture or compile
        on the target, hundreds of milliseconds): its overhead counts at most its device time, else a 0.9 decay
        would carry that start into the next fifty steps' plans."""
        overhead = max(0.0, step_seconds - proposal_seconds - verify_seconds)
        if not self.overhead_measured:
            self.step_overhead_seconds = min(overhead, proposal_seconds + verify_seconds)
            self.overhead_measured = True
        else:
            overhead = min(overhead, 2 * self.step_overhead_seconds)
            self.step_overhead_seconds = 0.9 * self.step_overhead_seconds + 0.1 * overhead

    def verify_seconds(self, rows: int, context_tokens: int = 0) -> float:
        return self.verify_curve(context_tokens)(rows)

    def verify_curve(self, context_tokens: int) -> Callable[[int], float]:
        """Verify seconds against padded rows at ``context_tokens``: the table of the context's bucket, else of
        the nearest measured bucket (the longer on a tie), else the seed alone, else the defaults. Read now,
        once for the many batches a plan scores: measurements made later do not move it."""
        home = _bucket(context_tokens)
        measured = [k for k, table in enumerate(self.tables) if table.measured]
        if measured:
            return self.tables[min(measured, key=lambda k: (abs(k - home), -k))].curve()
        if self.tables[home].seed:
            return self.tables[home].curve()
        intercept, slope = self.default_intercept, self.default_slope
        return lambda rows: intercept + slope * rows


def _bucket(context_tokens: int) -> int:
    return min(max(context_tokens, 0).bit_length(), CONTEXT_BUCKETS - 1)


def tree_size(widths: list[int]) -> int:
    """Nodes of a tree whose depth d expands the best w_{d-1} nodes into w_d children each."""
    total, expanded = 1, 1
    for w in widths:
        total += expanded * w
        expanded = w
    return total


def expected_tokens(passes: list[list[float]], widths: list[int]) -> float:
    """E(w): the bonus token plus, per depth, the probability that the path passes it."""
    expected, alive = 1.0, 1.0
    for depth, width in enumerate(widths):
        alive *= passes[depth][width]
        expected += alive
    return expected


CLIMB_MOVES = 3  # hill-climbing moves per re-plan: a plan follows a moving hazard within a few re-plans


def climb(
    value: Callable[[list[int]], float], widths: list[int], max_tokens: int, max_depth: int, moves: int = CLIMB_MOVES
) -> list[int]:
    """Up to ``moves`` moves from ``widths``, each to the best neighbour (one child more or fewer at one
    depth, one depth of width 1 more, the last depth fewer) that raises ``value``; each move scores at
    most 2 * depth + 2 plans. Neighbours stay within ``max_tokens`` nodes and ``max_depth`` depths."""
    best = value(widths)
    for _ in range(moves):
        options = [widths[:d] + [w + step] + widths[d + 1 :]
                   for d, w in enumerate(widths) for step in (1, -1) if 1 <= w + step <= MAX_WIDTH]  # fmt: skip
        if len(widths) < max_depth:
            options.append([*widths, 1])
        if len(widths) > 1:
            options.append(widths[:-1])
        scored = [(value(o), o) for o in options if tree_size(o) <= max_tokens]
        if not scored or max(scored)[0] <= best * (1 + 1e-4):
            break
        best, widths = max(scored)
    return widths


def widths_to_plan(widths: list[int]) -> list[DepthPlan]:
    """Depth d expands the best w_{d-1} nodes (the root at depth 1) into w_d children each."""
    return [DepthPlan(expand=widths[d - 1] if d else 1, children=w) for d, w in enumerate(widths)]
