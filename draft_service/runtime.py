"""The draft runtime: the EAGLE-3 head, its sessions, and the tree plan each policy asks for."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

import torch

from diffspec.errors import InvalidRequest
from diffspec.tree import DraftTree
from draft_service.backend import DraftOptions, DraftStats
from draft_service.drafter import Drafter, DraftSession, ProposalRequest
from draft_service.eagle3_head import Eagle3Head
from draft_service.hazard import HazardProfile, StepCostModel, plan_tree, widths_to_plan
from draft_service.tree_budget import MAX_DEPTH, DepthPlan, TreeBudget, TreePolicy
from draft_service.working_set import WorkingSetConfig

REQUEST_DECAY = 0.9  # a request's hazard forgets old steps fast: it follows the text
GLOBAL_DECAY = 0.995  # the global prior moves slowly


@dataclass
class _SessionState:
    drafter_state: DraftSession
    policy: TreePolicy
    budget: TreeBudget
    hazard: HazardProfile
    widths: list[int] = field(default_factory=list)  # children per depth of the last proposal
    last_tree: DraftTree | None = None
    proposed_at: float = 0.0  # perf_counter when the last tree left; accept() measures the verify


def validate_options(options: DraftOptions) -> tuple[TreePolicy, TreeBudget]:
    """Parse the policy and budget; raises InvalidRequest for either."""
    return TreePolicy.parse(options.policy), TreeBudget.parse(options.tree_config)


def depth_plan(policy: TreePolicy, budget: TreeBudget) -> list[DepthPlan]:
    """Per-depth expansion for the fixed policies (``online`` plans come from the hazard profile)."""
    if policy.name == "chain":
        return [DepthPlan(expand=1, children=1)] * min(budget.depth, budget.total_tokens - 1)
    if policy.name == "uniform":
        # every kept node may branch; no more parents than the budget can hold children of
        expand = math.ceil((budget.total_tokens - 1) / policy.branching)
        return [DepthPlan(expand=expand, children=policy.branching)] * budget.depth
    return [DepthPlan(expand=policy.branching, children=policy.branching)] * budget.depth


class DraftRuntime:
    """Thread-safe: one lock serialises head forwards."""

    def __init__(
        self, head: Eagle3Head, working_set: WorkingSetConfig = WorkingSetConfig(), cuda_graphs: bool = True
    ) -> None:
        self.head = head
        self.working_set = working_set
        self.drafter = Drafter(head, cuda_graphs)
        self.sessions: dict[str, _SessionState] = {}
        self.global_hazard = HazardProfile(MAX_DEPTH, GLOBAL_DECAY)
        self.step_cost = StepCostModel()  # time from a proposal leaving to its accept arriving
        self._lock = threading.Lock()

    def start(
        self, session_id: str, prompt_ids: list[int], features: torch.Tensor, first_token: int, options: DraftOptions
    ) -> None:
        policy, budget = validate_options(options)
        expected = 3 * self.head.config.target_hidden_size
        if features.ndim != 2 or features.shape != (len(prompt_ids), expected):
            raise InvalidRequest(f"features of shape {tuple(features.shape)}; expected ({len(prompt_ids)}, {expected})")
        if session_id in self.sessions:
            raise InvalidRequest(f"draft session {session_id!r} already exists")
        with self._lock:
            salience = self.working_set if options.salience else None
            state = self.drafter.start(prompt_ids, features, first_token, salience)
            hazard = HazardProfile(MAX_DEPTH, REQUEST_DECAY, prior=self.global_hazard)
            self.sessions[session_id] = _SessionState(state, policy, budget, hazard)

    def propose(self, session_id: str) -> DraftTree:
        return self.propose_batch([session_id])[0]

    def propose_batch(self, session_ids: list[str]) -> list[DraftTree]:
        """Trees for several sessions, grown together (one head pass per depth for all)."""
        sessions = [self._session(sid) for sid in session_ids]
        with self._lock:
            requests = [ProposalRequest(s.drafter_state, self._plan(s), s.budget) for s in sessions]
            started = time.perf_counter()
            trees = self.drafter.propose_many(requests)
            finished = time.perf_counter()
            self.step_cost.observe_draft(max(len(r.plan) for r in requests), finished - started)
            for session, tree in zip(sessions, trees):
                session.proposed_at, session.last_tree = finished, tree
            return trees

    def _plan(self, session: _SessionState) -> list[DepthPlan]:
        if session.policy.name == "online":
            session.widths = plan_tree(
                session.hazard, self.step_cost, session.budget.total_tokens, session.budget.depth, session.widths
            )
            return widths_to_plan(session.widths)
        plan = depth_plan(session.policy, session.budget)
        session.widths = [step.children for step in plan]
        return plan

    def accept(self, session_id: str, emitted_tokens: list[int], features: torch.Tensor) -> None:
        session = self._session(session_id)
        if not emitted_tokens or features.shape[0] != len(emitted_tokens):
            raise InvalidRequest(f"{len(emitted_tokens)} emitted tokens but features for {features.shape[0]} positions")
        with self._lock:
            if session.last_tree is not None:
                self._observe_step(session, emitted_tokens[:-1])
            self.drafter.extend(session.drafter_state, features, emitted_tokens)

    def _observe_step(self, session: _SessionState, accepted: list[int]) -> None:
        """Feed the hazard profile (sibling rank passed per depth) and the verify cost model."""
        tree = session.last_tree
        assert tree is not None
        self.step_cost.observe_verify(tree.num_nodes, time.perf_counter() - session.proposed_at)
        children, tokens = tree.children(), tree.tokens.tolist()
        node, ranks = 0, []
        for token in accepted:
            match = [rank for rank, child in enumerate(children[node]) if tokens[child] == token]
            if not match:
                break  # the target accepted a path the draft did not propose: a foreign tree
            ranks.append(match[0])
            node = children[node][match[0]]
        session.hazard.observe(ranks, stop_width=len(children[node]))
        session.last_tree = None

    def stats(self, session_id: str) -> DraftStats:
        session = self._session(session_id)
        state = session.drafter_state
        return DraftStats(
            hazard=session.hazard.hazard(session.widths),
            working_set_tokens=state.context.attended_tokens,
            context_tokens=state.num_entries,
        )

    def release(self, session_id: str) -> None:
        with self._lock:
            self.sessions.pop(session_id, None)

    def _session(self, session_id: str) -> _SessionState:
        if session_id not in self.sessions:
            raise InvalidRequest(f"unknown draft session {session_id!r}")
        return self.sessions[session_id]
