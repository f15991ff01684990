"""The draft runtime: the EAGLE-3 head, its sessions, and the tree plan each policy asks for."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

from diffspec.errors import InvalidRequest
from diffspec.tree import DraftTree
from draft_service.backend import DraftOptions, DraftStats
from draft_service.drafter import Drafter, DraftSession
from draft_service.eagle3_head import Eagle3Head
from draft_service.tree_budget import DepthPlan, TreeBudget, TreePolicy


@dataclass
class _SessionState:
    drafter_state: DraftSession
    policy: TreePolicy
    budget: TreeBudget


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

    def __init__(self, head: Eagle3Head) -> None:
        self.head = head
        self.drafter = Drafter(head)
        self.sessions: dict[str, _SessionState] = {}
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
            state = self.drafter.start(prompt_ids, features, first_token)
            self.sessions[session_id] = _SessionState(state, policy, budget)

    def propose(self, session_id: str) -> DraftTree:
        session = self._session(session_id)
        with self._lock:
            return self.drafter.propose(session.drafter_state, depth_plan(session.policy, session.budget), session.budget)

    def accept(self, session_id: str, emitted_tokens: list[int], features: torch.Tensor) -> None:
        session = self._session(session_id)
        if not emitted_tokens or features.shape[0] != len(emitted_tokens):
            raise InvalidRequest(f"{len(emitted_tokens)} emitted tokens but features for {features.shape[0]} positions")
        with self._lock:
            self.drafter.extend(session.drafter_state, features, emitted_tokens)

    def stats(self, session_id: str) -> DraftStats:
        state = self._session(session_id).drafter_state
        return DraftStats(working_set_tokens=state.kv.length, context_tokens=state.num_entries)

    def release(self, session_id: str) -> None:
        with self._lock:
            self.sessions.pop(session_id, None)

    def _session(self, session_id: str) -> _SessionState:
        if session_id not in self.sessions:
            raise InvalidRequest(f"unknown draft session {session_id!r}")
        return self.sessions[session_id]
