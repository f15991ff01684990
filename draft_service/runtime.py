"""The draft runtime: the EAGLE-3 head, its sessions, and the tree plan each policy asks for.

One ``step`` per engine iteration: release finished sessions (their stats go back, their entries stay in
the prefix cache), look queued prompts up in that cache, start new ones over the target's prompt features
(after the cached entries), extend running ones with what the target committed,
then grow every requested session's tree together, one head pass per depth for the batch. What
the verified trees teach (the hazard profiles, the online planners, the bound audit) is learnt
last, while the device runs the proposal: between a verify's results and the next proposal's
launch the host does only what that proposal needs. A step whose trees were queued ahead (below) has
no proposal to hide it behind: its steps are learnt at the next verify's write, behind that forward.

Ahead. In one process with the target, the accepted entries are written from the device's
acceptance while the verify runs (``accept_on_device``). When every session that goes on past the
verify is written so, their next proposal is planned and queued right then, behind the write
(``propose_ahead``): the GPU goes from the verify to the proposal while the host reads the results, and
the next ``step`` takes the trees of the sessions whose accepts keep the entries they grew from (the
trees of sessions that ended meanwhile are dropped). The step's other sessions (ones that joined, or
whose entries the host did not keep) propose beside it, each tree within the batch's online bound. The
plan is the one the step would make: it is made from the steps observed before the verify either way.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch.profiler import record_function

from diffspec.device_accept import DeviceAccept
from diffspec.devices import DeviceTimer
from diffspec.errors import DiffSpecError, InvalidRequest
from diffspec.tree import DraftTree, PendingTree
from draft_service.backend import DraftAccept, DraftBatch, DraftBatchResult, DraftStart, DraftStats, PrefixLookup
from draft_service.drafter import (
    KV_ONLY_MIN_ROWS,
    DeviceExtension,
    Drafter,
    DraftSession,
    Extension,
    ProposalRequest,
)
from draft_service.eagle3_head import Eagle3Head
from draft_service.batch_plan import REPLAN_EVERY, BatchCost, BatchPlanner, SessionOutlook, StepSeconds
from draft_service.bound_audit import BoundAudit
from draft_service.hazard import HazardProfile, StepCostModel, expected_tokens
from draft_service.serving_weights import Quantization
from draft_service.options import validate_options
from draft_service.prefix_cache import PREFIX_BLOCK_TOKENS, DraftPrefixCache
from draft_service.tree_budget import MAX_DEPTH
from draft_service.tree_plan import (
    CANDIDATE_GRID,
    Bound,
    Candidate,
    SharedMeasurements,
    TreePlanner,
    fixed_candidate,
)
from draft_service.working_set import WorkingSetConfig

log = logging.getLogger(__name__)

OBSERVED_PER_STEP = 4  # online sessions whose verified tree a step hands their planner (host time per step)
REQUEST_DECAY = 0.9  # a request's hazard forgets old steps fast: it follows the text
GLOBAL_DECAY = 0.995  # the global prior moves slowly


@dataclass(frozen=True)
class _TimedProposal:
    """The last batch proposal, read at the next step: it returned before the device ran it."""

    depth: int  # draft depths of its deepest plan
    batch: int  # sessions it proposed for
    attended_tokens: int  # entries a session attended to, mean over them
    timer: DeviceTimer  # its span on the device
    bound: Bound | None  # the online bound every tree kept within; None without one, or with a probe past it
    first_of_shape: bool  # its shape was new: its span holds a graph's recording (or kernels' compiles) too
    beside: bool = False  # a second proposal ran in its step (``_propose``): the step's span is not its alone


def _attended_tokens(sessions: list[_SessionState]) -> int:
    """Entries a proposal for ``sessions`` attends to per session, on average: what its depths' cost grows with."""
    return sum(s.drafter_state.context.attended_tokens for s in sessions) // len(sessions)


@dataclass(frozen=True)
class _VerifiedStep:
    """A session's verified tree and what the target accepted of it, observed once the next proposal is queued."""

    session: _SessionState
    tree: DraftTree | PendingTree  # the tree the target verified
    accepted: list[int]  # the drafts it accepted (the emitted tokens but the bonus)
    bound: Bound | None  # the online bound the tree kept within, if the step measured one
    candidate: Candidate | None  # the tree's candidate when an online session's planner learns from the step


@dataclass(frozen=True)
class _Launched:
    """A batch proposal queued on the device; its sessions record it as their last proposal when they take it."""

    session_ids: tuple[str, ...]
    chosen: tuple[Candidate, ...]  # each session's tree
    trees: tuple[DraftTree | PendingTree, ...]
    within: tuple[Bound | None, ...]  # the online bound each tree kept within (``_within_bound``)
    observed: frozenset[str]  # the sessions whose planners learn from this step (``_observed``)
    timed: _TimedProposal

    def of(self, session_ids: list[str]) -> _Launched:
        """The part of it these sessions take (the others ended: their trees are dropped)."""
        index = {sid: i for i, sid in enumerate(self.session_ids)}
        picked = [index[sid] for sid in session_ids]
        return _Launched(
            tuple(session_ids),
            tuple(self.chosen[i] for i in picked),
            tuple(self.trees[i] for i in picked),
            tuple(self.within[i] for i in picked),
            self.observed & set(session_ids),
            self.timed,
        )

    def beside(self, other: _Launched) -> _Launched:
        """This proposal and ``other``, queued in the same step for other sessions, as the step's one."""
        return _Launched(
            self.session_ids + other.session_ids,
            self.chosen + other.chosen,
            self.trees + other.trees,
            self.within + other.within,
            self.observed | other.observed,
            replace(self.timed, beside=True),
        )


@dataclass
class _SessionState:
    drafter_state: DraftSession
    hazard: HazardProfile
    candidate: Candidate  # the tree it proposes: a fixed policy's own, or the online planner's choice
    planner: TreePlanner | None = None  # online sessions only
    last_tree: DraftTree | PendingTree | None = None  # its host nodes are read when its verification is observed
    last_candidate: Candidate | None = None  # the candidate its last tree was grown as (a probe's own, where it probed)
    observe_last: bool = False  # its planner learns from its last tree's step (``_observed``)
    expected_tokens: float = 1.0  # what the last plan expected to emit per step
    proposed_within: Bound | None = None  # the online bound its last tree kept within (None: none, or a probe past it)
    steps_to_replan: int = 0  # proposals left before the plan is made again
    cache_scope: str | None = None  # its prefix-cache scope; None: its entries are not cached (it was not looked up)


class DraftRuntime:
    """Thread-safe: one lock serialises steps (several gateways may share one draft)."""

    def __init__(
        self,
        head: Eagle3Head,
        working_set: WorkingSetConfig = WorkingSetConfig(),
        cuda_graphs: bool = True,
        warm_up_batches: tuple[int, ...] = (1,),
        quantization: Quantization = "none",
        propose_ahead: bool = True,
        prefix_cache_tokens: int = 0,
    ) -> None:
        """``warm_up_batches``: the batch sizes ``warm_up`` proposes at (a server's expected batches).
        ``quantization``: of the head's per-depth matmuls (``serving_weights``). ``propose_ahead``: queue the
        next proposal behind entries written on the device (the module's docstring). ``prefix_cache_tokens``:
        entries the prefix cache keeps (0: none)."""
        self.head = head
        self.warm_up_batches = warm_up_batches
        self.working_set = working_set
        self.drafter = Drafter(head, cuda_graphs, quantization)
        self.sessions: dict[str, _SessionState] = {}
        c, weight = head.config, head.fc.weight
        self.prefix_cache = (
            DraftPrefixCache(prefix_cache_tokens, PREFIX_BLOCK_TOKENS, c.num_layers, c.num_kv_heads, c.head_dim,
                             weight.dtype, weight.device)
            if prefix_cache_tokens >= PREFIX_BLOCK_TOKENS else None
        )  # fmt: skip
        self._lookup_scopes: dict[str, str] = {}  # looked-up sessions not started yet -> their cache scope
        self.global_hazard = HazardProfile(MAX_DEPTH, GLOBAL_DECAY)
        self.step_cost = StepCostModel()  # verify seconds against the batch's tree tokens, draft seconds per depth
        self.shared_measurements = SharedMeasurements()  # online: every request's, the prior of each one's own
        self.candidate_grid = CANDIDATE_GRID  # the dynamic trees an online session chooses among, beside its own
        self.proposals = 0  # batch proposals so far: whose trees the planners learn from (``_observed``)
        self.batch_plan = BatchPlanner()  # the bound every online session's tree keeps within, and when one probes
        self.bound_audit = BoundAudit()  # per bound: what the batch planner predicted, what its steps delivered
        self.propose_ahead = propose_ahead
        self.proposals_ahead = 0  # proposals queued ahead that a step took
        self._timed_proposal: _TimedProposal | None = None
        self._ahead: _Launched | None = None  # queued by ``accept_on_device``, for the next step to take
        self._unobserved: list[_VerifiedStep] = []  # verified steps of a step that took its trees ahead
        self._proposing_step_started: float | None = None  # when the last step began, if it proposed
        self._lock = threading.Lock()

    @property
    def last_proposal_depth(self) -> int:
        """Draft depths the last batch proposal ran (its deepest plan): what its device time grew with."""
        return self._timed_proposal.depth if self._timed_proposal is not None else 0

    @property
    def bounds_proposed(self) -> collections.Counter[Bound]:
        """Proposals per online batch bound so far."""
        return collections.Counter({bound: report.proposals for bound, report in self.bound_audit.reports().items()})

    def step(self, batch: DraftBatch) -> DraftBatchResult:
        """Release, start, accept, then propose for every session asked; failures stay per session."""
        failures: dict[str, DiffSpecError] = {}
        with self._lock:
            started = time.perf_counter()
            released = {sid: self._release(sid) for sid in batch.releases if sid in self.sessions}
            for sid in batch.releases:
                self._drop_lookup(sid)
            for lookup in batch.lookups:
                self._guard(lookup.session_id, failures, self._lookup, lookup)
            cached = {lookup.session_id: self._pinned(lookup.session_id) for lookup in batch.lookups}
            if released and all(s.planner is None for s in self.sessions.values()):
                self.batch_plan = BatchPlanner()  # the online batch ended: the next online session starts a new one
            if batch.verify_cost is not None:
                self.step_cost.observe_verify(batch.verify_cost.rows, batch.verify_cost.seconds)
                self._observe_step_cost(started, batch.verify_cost.seconds)
            with record_function("draft.start"):
                for start in batch.starts:
                    self._guard(start.session_id, failures, self._start, start)
            with record_function("draft.accept"):
                extensions: list[tuple[str, Extension]] = []
                verified: dict[str, _VerifiedStep] = {}
                for accept in batch.accepts:
                    try:
                        extension, step = self._accept(accept)
                    except DiffSpecError as failure:
                        failures[accept.session_id] = failure.with_traceback(None)  # no cycle through its frames
                        continue
                    extensions.append((accept.session_id, extension))
                    if step is not None:
                        verified[accept.session_id] = step
                settled = self._extend_all(extensions, failures)
            proposes = [sid for sid in batch.proposes if sid not in failures]
            for sid in proposes:
                if sid not in self.sessions:
                    failures[sid] = InvalidRequest(f"unknown draft session {sid!r}")
            with record_function("draft.observe"):  # steps taken ahead left: before anything is planned
                self._observe_unobserved()
            with record_function("draft.propose"):
                trees, taken_ahead = self._propose([sid for sid in proposes if sid not in failures], settled)
            self._proposing_step_started = started if trees else None
            observing = [step for sid, step in verified.items() if sid not in failures]
            if taken_ahead:  # the device idles until the verify launches: observed behind the verify's forward
                self._unobserved = observing
            else:  # the new proposal runs on the device meanwhile
                with record_function("draft.observe"):
                    for step in observing:
                        self._observe(step)
            for sid in failures:
                self.sessions.pop(sid, None)
                self._drop_lookup(sid)
        return DraftBatchResult(trees, released, failures, cached)

    def accept_on_device(self, accepts: dict[str, DeviceAccept], ending: frozenset[str] = frozenset()) -> set[str]:
        """Write the entries of verify acceptances the device computed (in one process with the target), while
        that verify runs; the next ``step``'s accepts settle them. Sessions the verify surely ends (``ending``:
        it emits their last token) need neither. When the written ones are every other session, their next
        proposal is queued behind them (``propose_ahead``). Returns the sessions written; the others (unknown
        here, or whose write failed) are extended by their accept as usual."""
        with self._lock:
            ids = [sid for sid in accepts if sid in self.sessions and sid not in ending]
            continuing = len(self.sessions.keys() - ending)
            sessions = [self.sessions[sid].drafter_state for sid in ids]
            try:
                with record_function("draft.accept_on_device"):
                    self.drafter.extend_on_device([DeviceExtension(s, accepts[sid]) for s, sid in zip(sessions, ids)])
            except (RuntimeError, ValueError) as failure:
                log.warning("writing accepted entries on the device failed, accepts extend instead: %s", failure)
                for session in sessions:
                    self.drafter.discard_unsettled(session)
                return set()
            with record_function("draft.observe"):  # the verify's forward runs meanwhile
                self._observe_unobserved()
            if self.propose_ahead and ids and len(ids) == continuing:
                with record_function("draft.propose_ahead"):
                    self._ahead = self._launch_ahead(ids)
            return set(ids)

    def _launch_ahead(self, session_ids: list[str]) -> _Launched | None:
        """The proposal the next step would make for these sessions, queued now from their unsettled entries; None
        when it cannot be (a tree with no depth needs its root on the host)."""
        try:
            return self._launch(session_ids, self._plan_batch)
        except (RuntimeError, ValueError) as failure:
            log.warning("no proposal ahead, the next step proposes: %s", failure)
            return None

    @torch.no_grad()
    def warm_up(self, context_tokens: int = 256, whole_context_only: bool = False) -> int:
        """Propose once, over throwaway sessions with and without the working set, every tree an ``online``
        session starts from (its dynamic candidates, its probes and the first hazard-shaped tree), at every batch
        of ``warm_up_batches``: each
        proposal shape's Triton kernels compile and its graph is recorded here rather than inside a request.
        ``whole_context_only``: the session over the whole context alone, for a later call at another context
        length (a working-set session stages its budget whatever its length, and the first call compiled the
        prompt's long-chunk kernels). Returns the proposals made."""
        c, weight = self.head.config, self.head.fc.weight
        features = torch.zeros(context_tokens, 3 * c.target_hidden_size, dtype=weight.dtype, device=weight.device)
        # one session over the whole context, one with the working set (staged at its budget, whatever its length)
        salience_choices = (None,) if whole_context_only else (None, self.working_set)
        sessions = [self.drafter.start([0] * context_tokens, features, 0, salience) for salience in salience_choices]
        planner = TreePlanner.start(self.candidate_grid[0], SharedMeasurements(), self.candidate_grid)
        candidates = list(dict.fromkeys([*planner.dynamic, *planner.probes, planner.shaped]))  # probes may be some
        for session in sessions:
            for batch in self.warm_up_batches:
                for candidate in candidates:
                    request = ProposalRequest(session, list(candidate.plan), candidate.budget)
                    self.drafter.propose_many([request] * batch)
        if not whole_context_only:  # a prompt's long chunk projects the last layer's k and v alone: compiled here too
            long_features = features.new_zeros(KV_ONLY_MIN_ROWS, features.shape[1])
            self.drafter.start([0] * KV_ONLY_MIN_ROWS, long_features, 0)
        return len(sessions) * len(candidates) * len(self.warm_up_batches)

    @staticmethod
    def _guard(session_id: str, failures: dict[str, DiffSpecError], work, item) -> None:  # noqa: ANN001
        try:
            work(item)
        except DiffSpecError as failure:
            # without its traceback: the frames it holds hold the session, and it is held by ``failures``, whose
            # frame it holds, a cycle that would keep a failed session's KV until the cyclic collector runs
            failures[session_id] = failure.with_traceback(None)

    def _lookup(self, lookup: PrefixLookup) -> None:
        """Pin the lookup's cached entries for its session (none without a cache)."""
        if lookup.session_id in self.sessions or lookup.session_id in self._lookup_scopes:
            raise InvalidRequest(f"draft session {lookup.session_id!r} already exists")
        if not lookup.prompt_ids:
            raise InvalidRequest("a prompt needs at least one token")
        self._check_token_ids(lookup.prompt_ids)
        self._lookup_scopes[lookup.session_id] = lookup.cache_scope
        if self.prefix_cache is not None:
            self.prefix_cache.lookup(lookup.session_id, lookup.cache_scope, lookup.prompt_ids)

    def _pinned(self, session_id: str) -> int:
        """Leading prompt entries the session's lookup pinned."""
        return self.prefix_cache.pinned(session_id) if self.prefix_cache is not None else 0

    def _drop_lookup(self, session_id: str) -> None:
        """A looked-up session that will not start (released, or failed): its pin goes."""
        if self._lookup_scopes.pop(session_id, None) is not None and self.prefix_cache is not None:
            self.prefix_cache.unpin(session_id)

    def _start(self, start: DraftStart) -> None:
        policy, budget = validate_options(start.options)
        expected = 3 * self.head.config.target_hidden_size
        features, cached = start.features, start.cached_positions
        pinned = self._pinned(start.session_id)
        whole_blocks = cached % PREFIX_BLOCK_TOKENS == 0
        if cached and not (0 < cached <= min(pinned, len(start.prompt_ids) - 1) and whole_blocks):
            raise InvalidRequest(f"{cached} cached prompt entries; the session's lookup pinned {pinned}, in blocks of "
                                 f"{PREFIX_BLOCK_TOKENS}")
        rows = len(start.prompt_ids) - cached
        if features.ndim != 2 or tuple(features.shape) != (rows, expected):
            raise InvalidRequest(f"features of shape {tuple(features.shape)}; expected ({rows}, {expected})")
        if start.session_id in self.sessions:
            raise InvalidRequest(f"draft session {start.session_id!r} already exists")
        self._check_token_ids([*start.prompt_ids, start.first_token])
        salience = self.working_set if start.options.salience else None
        scope = self._lookup_scopes.pop(start.session_id, None)
        cache = self.prefix_cache
        load = (lambda context: cache.load(start.session_id, context, cached)) if cache is not None else None
        try:
            state = self.drafter.start(start.prompt_ids, features, start.first_token, salience, load)
        finally:
            if cache is not None:
                cache.unpin(start.session_id)  # taken, or the start failed
        if cache is not None and scope is not None:
            cache.store(scope, state.token_ids, state.context)
        hazard = HazardProfile(MAX_DEPTH, REQUEST_DECAY, prior=self.global_hazard)
        online = policy.name == "online"
        planner = TreePlanner.start(budget, self.shared_measurements, self.candidate_grid) if online else None
        candidate = planner.current if planner is not None else fixed_candidate(policy, budget)
        self.sessions[start.session_id] = _SessionState(state, hazard, candidate, planner, cache_scope=scope)
        # sessions started together replan in different steps, so no step plans for all of them
        self.sessions[start.session_id].steps_to_replan = len(self.sessions) % REPLAN_EVERY

    def _accept(self, accept: DraftAccept) -> tuple[Extension, _VerifiedStep | None]:
        """Check an accept: the entries it commits, and its verified tree's step to observe (None when the
        target verified no tree of this session's: an Auto step in its stead)."""
        session = self._session(accept.session_id)
        emitted, features = accept.emitted_tokens, accept.features
        expected = 3 * self.head.config.target_hidden_size
        if not emitted or tuple(features.shape) != (len(emitted), expected):
            raise InvalidRequest(
                f"{len(emitted)} emitted tokens with features of shape {tuple(features.shape)}; "
                f"expected ({len(emitted)}, {expected})"
            )
        self._check_token_ids(emitted)
        step = None
        if session.last_tree is not None and accept.verified_draft_tree:
            learnt_as = session.last_candidate if session.observe_last else None
            step = _VerifiedStep(session, session.last_tree, emitted[:-1], session.proposed_within, learnt_as)
        session.last_tree, session.observe_last = None, False  # taken for observation, or nothing of it was verified
        return Extension(session.drafter_state, features, emitted), step

    def _extend_all(self, extensions: list[tuple[str, Extension]], failures: dict[str, DiffSpecError]) -> set[str]:
        """Every accepted session's entries in one drafter pass (those written on the device already settled:
        ``accept_on_device``); if that pass fails, each of them fails. Returns the sessions that kept the entries
        written on the device."""
        try:
            kept = self.drafter.commit_accepted([extension for _, extension in extensions])
        except (RuntimeError, ValueError) as failure:
            failures.update({sid: InvalidRequest(f"draft extension failed: {failure}") for sid, _ in extensions})
            return set()
        return {sid for (sid, _), settled in zip(extensions, kept) if settled}

    def _observe_step_cost(self, started: float, verify_seconds: float) -> None:
        """The step that ended now, when the last one proposed and this batch carries its verify's cost: from
        the start of that draft call to the start of this one is one whole step of the engine (its draft
        call, its target call and the loop around them). A step whose proposal was its shape's first measures
        nothing: the recording is in it (``_TimedProposal.first_of_shape``); nor does one that proposed twice."""
        last = self._timed_proposal
        if self._proposing_step_started is not None and last is not None and not (last.first_of_shape or last.beside):
            step_seconds, proposal_seconds = started - self._proposing_step_started, last.timer.seconds()
            self.step_cost.observe_step(step_seconds, proposal_seconds, verify_seconds)
            if last.bound is not None:
                overhead = step_seconds - proposal_seconds - verify_seconds
                self.bound_audit.measured(last.bound, StepSeconds(overhead, proposal_seconds, verify_seconds))

    def _propose(self, session_ids: list[str], settled: set[str]) -> tuple[dict[str, DraftTree | PendingTree], bool]:
        """Trees for several sessions, grown together (one head pass per depth for all). The sessions the
        proposal queued ahead holds, whose entries their accepts kept (``settled``), take its trees; the others
        propose beside it (``_plan_beside``), or, when it holds none of them, as a batch of their own. Returns
        the trees, and whether some were the ones queued ahead."""
        ahead, self._ahead = self._ahead, None
        if not session_ids:
            return {}, False
        held = set(ahead.session_ids) & settled if ahead is not None else set()
        taken = [sid for sid in session_ids if sid in held]
        others = [sid for sid in session_ids if sid not in held]
        for sid in others:  # entries written on the device that no accept settled: not this step's
            self.drafter.discard_unsettled(self.sessions[sid].drafter_state)
        if ahead is not None and taken:
            launched = ahead.of(taken)
            self.proposals_ahead += 1
            if others:
                launched = launched.beside(self._launch(others, self._plan_beside))
            # the settled sessions' chunk scoring waits for their next write, behind the verify (extend_on_device)
        else:
            launched = self._launch(others, self._plan_batch)
        last = self._timed_proposal
        if last is not None and not last.first_of_shape:  # it ran on the device by now: its span is a read
            self.step_cost.observe_draft(last.depth, last.timer.seconds(), last.batch, last.attended_tokens)
        self._timed_proposal = launched.timed
        for i, sid in enumerate(launched.session_ids):
            session = self.sessions[sid]
            session.last_tree, session.proposed_within = launched.trees[i], launched.within[i]
            session.last_candidate = launched.chosen[i]
            session.observe_last = sid in launched.observed
        return dict(zip(launched.session_ids, launched.trees)), bool(taken)

    def _launch(
        self, session_ids: list[str], plan: Callable[[list[_SessionState]], list[Candidate]]
    ) -> _Launched:
        """Plan the sessions' trees (``plan``) and queue their proposal on the device."""
        sessions = [self.sessions[sid] for sid in session_ids]
        with record_function("draft.plan"):
            chosen = plan(sessions)
        requests = [ProposalRequest(s.drafter_state, list(c.plan), c.budget) for s, c in zip(sessions, chosen)]
        shapes_met = len(self.drafter.proposer.shapes_met)
        timer = DeviceTimer(self.head.fc.weight.device)
        timer.start()
        trees = self.drafter.propose_pending(requests)
        timer.stop()
        first_of_shape = len(self.drafter.proposer.shapes_met) > shapes_met
        within = self._within_bound(sessions, chosen)
        step_bound = within[0] if None not in within else None  # every tree within: the step measures the bound
        timed = _TimedProposal(
            max(c.depth for c in chosen), len(sessions), _attended_tokens(sessions), timer, step_bound, first_of_shape
        )
        observed = frozenset(session_ids[i] for i in self._observed(sessions, chosen))
        return _Launched(tuple(session_ids), tuple(chosen), tuple(trees), tuple(within), observed, timed)

    def _within_bound(self, sessions: list[_SessionState], chosen: list[Candidate]) -> list[Bound | None]:
        """Per session, the online bound its tree kept within (``bound_audit``); None without online sessions,
        and for a probe past the bound: neither its tree nor the verify padded to it measure the bound. A fixed
        policy's tree widens the bound the batch is predicted for, so it is part of that prediction."""
        bound = self.batch_plan.bound
        if bound is None or all(s.planner is None for s in sessions):
            return [None] * len(sessions)
        return [bound if s.planner is None or bound.fits(c) else None for s, c in zip(sessions, chosen)]

    def _plan_batch(self, sessions: list[_SessionState]) -> list[Candidate]:
        """Each session's tree: a fixed policy's own; an ``online`` one's best within the batch's bound
        (``batch_plan``), chosen again every few proposals.

        Between choices, online sessions re-plan within the bound in turn, each every ``REPLAN_EVERY``
        proposals (sessions started together are staggered, so a step re-plans about a quarter of the
        batch), and a session whose tree lies outside the bound re-plans at once. A session on shaped trees
        rechecks its dynamic tree now and then (``TreePlanner.proposal``), and one online session proposes its
        probe instead, when the batch can afford it (``batch_plan.ProbeSchedule``).
        """
        online_indices = [i for i, s in enumerate(sessions) if s.planner is not None]
        online = [sessions[i] for i in online_indices]
        context = sum(s.drafter_state.num_entries for s in sessions) // len(sessions)
        self.step_cost.note_batch(context)
        cost = BatchCost(self.step_cost, len(sessions), context, _attended_tokens(sessions))
        for session in sessions:
            if session.planner is None and session.steps_to_replan <= 0:
                passes = session.hazard.pass_table(max(1, session.candidate.depth))
                session.expected_tokens = expected_tokens(passes, session.candidate.widths)
                session.steps_to_replan = REPLAN_EVERY
        if online:
            self._bound_online(sessions, online, cost)
        for session in sessions:
            session.steps_to_replan -= 1
        bound = self.batch_plan.bound
        chosen = [s.planner.proposal(bound) if s.planner is not None and bound is not None else s.candidate
                  for s in sessions]  # fmt: skip
        probing = self.batch_plan.prober(len(online_indices))
        self.proposals += 1
        if probing is not None:
            i = online_indices[probing]
            planner = sessions[i].planner
            assert planner is not None
            probe = self.batch_plan.affordable_probe(planner.probes, cost)
            if probe is not None:
                chosen[i] = probe
        return chosen

    def _plan_beside(self, sessions: list[_SessionState]) -> list[Candidate]:
        """The trees of sessions proposing beside a proposal queued ahead (ones that joined the batch since it
        was planned): a fixed policy's own, an online session's own within the batch's bound. The batch's
        bound stays as the proposal ahead left it: the next plan, for the whole batch, chooses it again."""
        bound = self.batch_plan.bound
        for session in sessions:
            if session.planner is not None and bound is not None and not bound.fits(session.candidate):
                session.candidate, session.expected_tokens = session.planner.choose(session.hazard, bound)
        return [session.candidate for session in sessions]

    def _bound_online(self, sessions: list[_SessionState], online: list[_SessionState], cost: BatchCost) -> None:
        """Choose the batch's bound when due, then re-plan the online sessions whose turn it is within it."""
        plan = self.batch_plan
        if plan.due(len(sessions)):
            outlooks = [
                SessionOutlook(s.planner.expectations(s.hazard), False) if s.planner is not None
                else SessionOutlook({s.candidate: s.expected_tokens}, True)
                for s in sessions
            ]  # fmt: skip
            if plan.bound is None:
                chosen = plan.start([Bound(s.candidate.tokens, s.candidate.depth) for s in online], outlooks, cost)
            else:
                bounds = [b for s in online if s.planner is not None for b in s.planner.bounds()]
                chosen = plan.choose(bounds, outlooks, cost)
            assert plan.choice is not None
            self.bound_audit.chose(chosen, plan.choice)
        plan.step()
        bound, choice = plan.bound, plan.choice
        assert bound is not None and choice is not None
        self.bound_audit.proposed(bound, choice)
        for session in online:
            if session.steps_to_replan <= 0 or not bound.fits(session.candidate):
                assert session.planner is not None
                session.candidate, session.expected_tokens = session.planner.choose(session.hazard, bound)
                if session.steps_to_replan <= 0:  # a re-plan forced by the bound keeps the session's turn
                    session.steps_to_replan = REPLAN_EVERY

    def _observed(self, sessions: list[_SessionState], chosen: list[Candidate]) -> list[int]:
        """The online sessions whose trees their planners will learn from: ``OBSERVED_PER_STEP`` of them in
        turn (a large batch's host time stays bounded), and a probe or a recheck always."""
        online = [i for i, s in enumerate(sessions) if s.planner is not None]
        stride = max(1, -(-len(online) // OBSERVED_PER_STEP))
        turn = set(online[self.proposals % stride :: stride])
        return [i for i in online if i in turn or chosen[i] is not sessions[i].candidate]  # not its own: probe, recheck

    def _observe_unobserved(self) -> None:
        """The verified steps a step that took its trees ahead left (``step``): at the next verify's write, or
        before the next plan, whichever comes first, so every plan sees the steps it saw without them."""
        unobserved, self._unobserved = self._unobserved, []
        for step in unobserved:
            self._observe(step)

    def _observe(self, step: _VerifiedStep) -> None:
        """Feed a verified step to the session's hazard profile (the sibling rank that passed at each depth, and
        where the path stopped), then to the bound audit and an online session's planner. It runs once the next
        proposal is queued, so that proposal was planned from the steps before this one."""
        session = step.session
        tree = DraftTree.of(step.tree)
        ranks, stop = tree.sibling_ranks(step.accepted)  # a path the draft did not propose stops where it parts
        session.hazard.observe(ranks, stop_width=len(tree.children()[stop]))
        if step.bound is not None:
            self.bound_audit.emitted(step.bound, len(step.accepted) + 1)
        if session.planner is not None and step.candidate is not None:
            session.planner.observe(tree, step.candidate, session.hazard.last_passed_ranks)

    def _release(self, session_id: str) -> DraftStats:
        session = self.sessions.pop(session_id)
        state = session.drafter_state
        self.drafter.discard_unsettled(state)  # a last verify's entries no accept settled: not its context
        if self.prefix_cache is not None and session.cache_scope is not None:
            self.prefix_cache.store(session.cache_scope, state.token_ids, state.context)
        return DraftStats(
            hazard=session.hazard.hazard(session.candidate.widths),
            working_set_tokens=state.context.attended_tokens,
            context_tokens=state.num_entries,
            working_set_updates=state.context.working_set_updates,
        )

    def _session(self, session_id: str) -> _SessionState:
        if session_id not in self.sessions:
            raise InvalidRequest(f"unknown draft session {session_id!r}")
        return self.sessions[session_id]

    def _check_token_ids(self, ids: list[int]) -> None:
        vocab = self.head.config.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):  # two C loops: a 64K prompt's ids are checked per request
            bad = [t for t in ids if not 0 <= t < vocab]
            raise InvalidRequest(f"token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
