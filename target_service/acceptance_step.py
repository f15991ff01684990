"""The epilogue of a verify forward: each session's accepted path, its result, and what to commit.

Greedy sessions share one read of the step's argmax (the only host sync of a step, ``greedy_argmax``); a sampled
session reads its step's outcomes, every node's sample at its token index's uniform, computed on the device behind
the forward (``sampling_outcomes_of``); the sessions that want features share one gather of their committed rows.
A session that asks for logprobs gets them from the rows its emitted tokens were decided at: the root's for the
first, each accepted node's for the next, the same rows an Auto step would have used. Each session's
acceptance is computed before anything of it changes, and a session whose acceptance fails (say,
a sampling distribution that is not one) is reported on its own: the other sessions of the batch
keep their results and their commits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffspec.acceptance import Acceptance, SamplingOutcomes, accept_greedy, accept_sampling, sampling_outcomes
from diffspec.devices import HostCopy, upload
from diffspec.errors import DiffSpecError, InvalidRequest
from diffspec.sampling import target_probs, token_logprobs
from diffspec.sampling_params import SamplingParams
from diffspec.tree import DraftTree, PendingTree
from target_service.backend import VerifyResult, VerifyStep
from target_service.session import TargetSession
from target_service.step_graphs import StepOutputs


@dataclass(frozen=True)
class _Accepted:
    """One session's acceptance, before its result is built."""

    step: VerifyStep
    session: TargetSession
    acceptance: Acceptance
    rows: list[int]  # rows of the forward it commits: the root's, then each accepted node's
    tokens: list[int]  # their token ids


@dataclass(frozen=True)
class Commit:
    session_id: str
    rows: list[int]  # rows of the forward whose KV goes into the session's next slots
    tokens: list[int]  # their token ids


def accept_batch(
    steps: list[VerifyStep],
    sessions: list[TargetSession],
    ran: StepOutputs,
    argmax: list[int],
    sampled: dict[str, SamplingOutcomes],
    device_features: dict[str, torch.Tensor] | None = None,
) -> tuple[dict[str, VerifyResult], list[Commit], dict[str, DiffSpecError]]:
    """Per session: its result and its commit (root + accepted nodes), or why it failed. ``argmax``: the
    forward's argmax token of every row, read once for the greedy sessions ([] when there are none);
    ``sampled``: each sampled session's outcomes on the host; ``device_features``: the features its device
    acceptance gathered, per session that has one (``device_acceptance``: the same rows, from the same argmax
    or outcomes), whose first rows its result takes instead of a gather on the way to the next verify."""
    results: dict[str, VerifyResult] = {}
    commits: list[Commit] = []
    failures: dict[str, DiffSpecError] = {}
    accepted: list[_Accepted] = []
    for step, session, offset in zip(steps, sessions, ran.row_offsets):
        try:
            acceptance = _acceptance(step, session, offset, argmax, sampled)
        except (RuntimeError, ValueError) as failure:
            failures[step.session_id] = InvalidRequest(f"sampling failed for this request: {failure}")
            continue
        nodes = [0, *acceptance.accepted_nodes]
        tree_tokens = step.tree.token_list()
        rows, tokens = [offset + node for node in nodes], [tree_tokens[node] for node in nodes]
        accepted.append(_Accepted(step, session, acceptance, rows, tokens))
    for item, features in zip(accepted, _features(accepted, ran, device_features or {})):
        session, acceptance, tokens = item.session, item.acceptance, item.tokens
        emitted = [*tokens[1:], acceptance.bonus_token]
        session.pending_token = acceptance.bonus_token
        if session.uniforms is not None:
            session.uniforms.advance(len(emitted))
        results[item.step.session_id] = VerifyResult(
            accepted_tokens=tokens[1:],
            accepted_nodes=acceptance.accepted_nodes,
            bonus_token=acceptance.bonus_token,
            features=features,
            logprobs=token_logprobs(ran.logits[item.rows], emitted, session.sampling)
            if session.sampling.logprobs is not None
            else None,
        )
        commits.append(Commit(item.step.session_id, item.rows, tokens))
    return results, commits, failures


def greedy_argmax(sessions: list[TargetSession], ran: StepOutputs) -> torch.Tensor | None:
    """The argmax token of every row [rows] int64 on the device, when a session of the batch is greedy."""
    return ran.logits.argmax(-1) if any(session.sampling.greedy for session in sessions) else None


def _features(
    accepted: list[_Accepted], ran: StepOutputs, device_features: dict[str, torch.Tensor]
) -> list[torch.Tensor | None]:
    """Each session's features at its committed rows ([len(rows), len(layers) * hidden]; None when it wants
    none): the first rows of its device acceptance's where it has one, else one gather for all the sessions
    that want the same layers, split into per-session views."""
    features: list[torch.Tensor | None] = [None] * len(accepted)
    by_layers: dict[tuple[int, ...], list[int]] = {}  # feature layers -> indices of the sessions wanting them
    for i, item in enumerate(accepted):
        on_device = device_features.get(item.step.session_id)
        if on_device is not None and item.session.want_features:
            features[i] = on_device[: len(item.rows)]
        elif item.session.want_features:
            by_layers.setdefault(item.session.feature_layers, []).append(i)
    for layers, members in by_layers.items():
        rows = [row for i in members for row in accepted[i].rows]
        gathered = ran.forward.features_of(rows, layers).split([len(accepted[i].rows) for i in members])
        for i, session_features in zip(members, gathered):
            features[i] = session_features
    return features


@dataclass(frozen=True)
class SampledStep:
    """Every sampled session's outcomes of one step, computed together on the forward's device."""

    outcomes: SamplingOutcomes  # [nodes of every sampled session, side by side]
    spans: dict[str, tuple[int, int]]  # session id -> its nodes' [start, end) in ``outcomes``

    def of(self, session_id: str) -> SamplingOutcomes:
        start, end = self.spans[session_id]
        return SamplingOutcomes(self.outcomes.accepted[start:end], self.outcomes.bonus[start:end])


@dataclass(frozen=True)
class _SampledTree:
    """One sampled session's part of a step, before the outcomes are computed."""

    session_id: str
    sampling: SamplingParams
    tree: DraftTree | PendingTree
    first_row: int  # its root's row of the forward
    nodes: int  # its rows: a pending tree's node bound in a bucket, its real nodes (first in its device copy)
    uniforms: torch.Tensor  # [tree.max_depth + 1] float64 on the host: its next token indices' (the root's first)


def sampling_outcomes_of(
    steps: list[VerifyStep], sessions: list[TargetSession], ran: StepOutputs
) -> SampledStep | None:
    """The sampled sessions' outcomes on the forward's device (None when no session samples): every decision the
    uniforms of their next token indices give (one per depth a tree may reach, ``TokenUniforms``), computed behind
    the forward with nothing read back. All sessions' trees lie side by side in one computation, and sessions that
    sample by the same law (temperature, top-p, top-k) share one ``target_probs``: a step's launches do not grow
    with its sampled sessions."""
    ends = [*ran.row_offsets[1:], ran.logits.shape[0]]
    by_law: dict[tuple[float, float, int], list[_SampledTree]] = {}
    for step, session, offset, end in zip(steps, sessions, ran.row_offsets, ends):
        if session.sampling.greedy:
            continue
        assert session.uniforms is not None
        law = (session.sampling.temperature, session.sampling.top_p, session.sampling.top_k)
        part = _SampledTree(step.session_id, session.sampling, step.tree, offset, min(step.tree.num_nodes, end - offset),
                            session.uniforms.window(step.tree.max_depth + 1))
        by_law.setdefault(law, []).append(part)
    if not by_law:
        return None
    parts = [part for members in by_law.values() for part in members]  # one law's sessions side by side
    device = ran.logits.device
    tokens, parents, depths = _side_by_side(parts, device)
    counts = torch.tensor([part.nodes for part in parts])
    node_starts = counts.cumsum(0) - counts
    uniform_counts = torch.tensor([len(part.uniforms) for part in parts])
    uniform_starts = uniform_counts.cumsum(0) - uniform_counts
    # per node: where its session's nodes start, and where its session's uniforms start: one upload
    starts = upload(torch.stack([node_starts, uniform_starts]).repeat_interleave(counts, dim=1), device)
    uniforms = upload(torch.cat([part.uniforms for part in parts]), device)
    probs = torch.cat([
        target_probs(torch.cat([ran.logits[p.first_row : p.first_row + p.nodes] for p in members]), members[0].sampling)
        for members in by_law.values()
    ])  # fmt: skip
    batch_parents = torch.where(parents >= 0, parents + starts[0], -1)
    outcomes = sampling_outcomes(tokens, batch_parents, probs, uniforms[starts[1] + depths])
    spans = {part.session_id: (int(start), int(start + part.nodes)) for part, start in zip(parts, node_starts)}
    return SampledStep(outcomes, spans)


def _side_by_side(parts: list[_SampledTree], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The trees' tokens, parents (each tree's own indices) and depths [their nodes, side by side] on ``device``: a
    pending tree's from its device copy, the host trees' in one upload."""
    on_device = [part.tree.device_copy(device) if isinstance(part.tree, PendingTree) else None for part in parts]
    host = {i: DraftTree.of(part.tree) for i, (part, copy) in enumerate(zip(parts, on_device)) if copy is None}
    columns: dict[int, tuple[torch.Tensor, ...]] = {
        i: (copy.tokens, copy.parents, copy.depths) for i, copy in enumerate(on_device) if copy is not None
    }
    if host:
        stacked = torch.cat([torch.stack([t.tokens, t.parents, t.depths()]) for t in host.values()], dim=1)
        columns |= dict(zip(host, upload(stacked, device).split([t.num_nodes for t in host.values()], dim=1)))
    cut = [[column[: part.nodes] for column in columns[i]] for i, part in enumerate(parts)]
    tokens, parents, depths = (torch.cat([c[k] for c in cut]) for k in range(3))
    return tokens, parents, depths


class SampledReads:
    """The sampled sessions' outcomes copied to the host in one copy queued behind them: reading waits for the
    forward alone."""

    def __init__(self, sampled: SampledStep | None) -> None:
        self._spans: dict[str, tuple[int, int]] = {}
        self._copy: HostCopy | None = None
        if sampled is not None:
            self._spans = sampled.spans
            self._copy = HostCopy(torch.stack([sampled.outcomes.accepted.long(), sampled.outcomes.bonus]))

    def get(self) -> dict[str, SamplingOutcomes]:
        if self._copy is None:
            return {}
        accepted, bonus = self._copy.get()
        return {sid: SamplingOutcomes(accepted[a:b].bool(), bonus[a:b]) for sid, (a, b) in self._spans.items()}


def _acceptance(
    step: VerifyStep, session: TargetSession, offset: int, argmax: list[int], sampled: dict[str, SamplingOutcomes]
) -> Acceptance:
    if session.sampling.greedy:
        return accept_greedy(step.tree, argmax[offset : offset + step.tree.num_nodes])
    return accept_sampling(step.tree, sampled[step.session_id])
