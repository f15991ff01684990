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
) -> tuple[dict[str, VerifyResult], list[Commit], dict[str, DiffSpecError]]:
    """Per session: its result and its commit (root + accepted nodes), or why it failed. ``argmax``: the
    forward's argmax token of every row, read once for the greedy sessions ([] when there are none);
    ``sampled``: each sampled session's outcomes on the host."""
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
    for item, features in zip(accepted, _features(accepted, ran)):
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


def _features(accepted: list[_Accepted], ran: StepOutputs) -> list[torch.Tensor | None]:
    """Each session's features at its committed rows ([len(rows), len(layers) * hidden]; None when it wants
    none): one gather for all the sessions that want the same layers, split into per-session views."""
    features: list[torch.Tensor | None] = [None] * len(accepted)
    by_layers: dict[tuple[int, ...], list[int]] = {}  # feature layers -> indices of the sessions wanting them
    for i, item in enumerate(accepted):
        if item.session.want_features:
            by_layers.setdefault(item.session.feature_layers, []).append(i)
    for layers, members in by_layers.items():
        rows = [row for i in members for row in accepted[i].rows]
        gathered = ran.forward.features_of(rows, layers).split([len(accepted[i].rows) for i in members])
        for i, session_features in zip(members, gathered):
            features[i] = session_features
    return features


def sampling_outcomes_of(
    steps: list[VerifyStep], sessions: list[TargetSession], ran: StepOutputs
) -> dict[str, SamplingOutcomes]:
    """Each sampled session's outcomes on the forward's device: every decision the uniforms of its next token
    indices give (one per depth its tree may reach, ``TokenUniforms``), computed behind the forward (nothing
    is read back)."""
    outcomes = {}
    device = ran.logits.device
    ends = [*ran.row_offsets[1:], ran.logits.shape[0]]
    for step, session, offset, end in zip(steps, sessions, ran.row_offsets, ends):
        if session.sampling.greedy:
            continue
        assert session.uniforms is not None
        tree = step.tree
        uniforms = upload(session.uniforms.window(tree.max_depth + 1), device)
        # a pending tree's rows: its node bound in a bucket, its real nodes (first in its device copy) unpadded
        nodes = min(tree.num_nodes, end - offset)
        on_device = tree.device_copy(device) if isinstance(tree, PendingTree) else None
        if on_device is not None:
            tokens, parents, depths = on_device.tokens[:nodes], on_device.parents[:nodes], on_device.depths[:nodes]
        else:
            host = DraftTree.of(tree)
            tokens, parents, depths = upload(torch.stack([host.tokens, host.parents, host.depths()]), device)
        probs = target_probs(ran.logits[offset : offset + nodes], session.sampling)
        outcomes[step.session_id] = sampling_outcomes(tokens, parents, depths, probs, uniforms)
    return outcomes


class SampledReads:
    """The sampled sessions' outcomes copied to the host, queued behind them: reading waits for the forward alone."""

    def __init__(self, outcomes: dict[str, SamplingOutcomes]) -> None:
        self._copies = {sid: HostCopy(torch.stack([o.accepted.long(), o.bonus])) for sid, o in outcomes.items()}

    def get(self) -> dict[str, SamplingOutcomes]:
        read = {sid: copy.get() for sid, copy in self._copies.items()}
        return {sid: SamplingOutcomes(accepted.bool(), bonus) for sid, (accepted, bonus) in read.items()}


def _acceptance(
    step: VerifyStep, session: TargetSession, offset: int, argmax: list[int], sampled: dict[str, SamplingOutcomes]
) -> Acceptance:
    if session.sampling.greedy:
        return accept_greedy(step.tree, argmax[offset : offset + step.tree.num_nodes])
    return accept_sampling(step.tree, sampled[step.session_id])
