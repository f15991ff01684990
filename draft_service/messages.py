"""Draft step dataclasses <-> ``diffspec.v1.draft`` messages, for the servicer and the client alike.

A step's features travel after it as one row-chunked tensor: each start's prompt rows past its cached
entries, then each accept's rows, in the step's order (the row counts are those prompt positions and the
emitted lengths).
"""

from __future__ import annotations

from diffspec.errors import DiffSpecError
from diffspec.feature_rows import Features, WireRows, wire_rows
from diffspec.v1 import draft_pb2
from diffspec.tree_nodes import TreeNodes
from diffspec.wire import error_from_failure, failure_to_proto
from draft_service.backend import (
    DraftAccept,
    DraftBatch,
    DraftBatchResult,
    DraftStart,
    DraftStats,
    PrefixLookup,
    VerifyCost,
)
from draft_service.options import DraftOptions


def options_to_proto(options: DraftOptions) -> draft_pb2.DraftOptions:
    return draft_pb2.DraftOptions(policy=options.policy, tree_config=options.tree_config, salience=options.salience)


def options_from_proto(message: draft_pb2.DraftOptions) -> DraftOptions:
    return DraftOptions(policy=message.policy, tree_config=message.tree_config, salience=message.salience)


def batch_to_proto(batch: DraftBatch) -> tuple[draft_pb2.DraftStep, WireRows | None]:
    """The step message and the feature rows that follow it, if any."""
    step = draft_pb2.DraftStep(
        releases=batch.releases,
        lookups=[
            draft_pb2.PrefixLookup(session_id=q.session_id, prompt_ids=q.prompt_ids, cache_scope=q.cache_scope)
            for q in batch.lookups
        ],
        starts=[
            draft_pb2.DraftStart(session_id=s.session_id, prompt_ids=s.prompt_ids, first_token=s.first_token,
                                 options=options_to_proto(s.options), cached_positions=s.cached_positions)  # fmt: skip
            for s in batch.starts
        ],
        accepts=[
            draft_pb2.DraftAccept(
                session_id=a.session_id, emitted_tokens=a.emitted_tokens, verified_draft_tree=a.verified_draft_tree
            )
            for a in batch.accepts
        ],
        proposes=batch.proposes,
    )
    if batch.verify_cost is not None:
        step.verify_rows, step.verify_seconds = batch.verify_cost.rows, batch.verify_cost.seconds
    rows = [wire_rows(s.features) for s in batch.starts] + [wire_rows(a.features) for a in batch.accepts]
    features = WireRows.concat(rows) if rows else None
    step.feature_rows = 0 if features is None else len(features)
    return step, features


def feature_rows(step: draft_pb2.DraftStep) -> int:
    """Rows the step's features must have: one per prompt position past each start's cached entries (a start that
    claims more than its prompt gets none, and fails in the runtime), one per emitted token of each accept."""
    prompts = sum(max(0, len(s.prompt_ids) - s.cached_positions) for s in step.starts)
    return prompts + sum(len(a.emitted_tokens) for a in step.accepts)


def batch_from_proto(step: draft_pb2.DraftStep, features: Features, scope: str) -> DraftBatch:
    """The batch with session ids put in ``scope``; ``features`` has ``feature_rows(step)`` rows (a step
    without rows gets an empty [0, 0] block, which the runtime rejects for any start or accept)."""
    row = 0

    def take(n: int) -> Features:
        nonlocal row
        row += n
        return features[row - n : row]

    starts = [
        DraftStart(scope + s.session_id, list(s.prompt_ids), take(max(0, len(s.prompt_ids) - s.cached_positions)),
                   s.first_token, options_from_proto(s.options), s.cached_positions)  # fmt: skip
        for s in step.starts
    ]
    accepts = [
        DraftAccept(scope + a.session_id, list(a.emitted_tokens), take(len(a.emitted_tokens)), a.verified_draft_tree)
        for a in step.accepts
    ]
    cost = VerifyCost(step.verify_rows, step.verify_seconds) if step.verify_rows > 0 else None
    return DraftBatch(
        releases=[scope + s for s in step.releases],
        lookups=[PrefixLookup(scope + q.session_id, list(q.prompt_ids), q.cache_scope) for q in step.lookups],
        starts=starts,
        accepts=accepts,
        proposes=[scope + s for s in step.proposes],
        verify_cost=cost,
    )


def result_to_proto(result: DraftBatchResult, scope: str) -> draft_pb2.DraftStepReply:
    reply = draft_pb2.DraftStepReply()
    for sid, tree in result.trees.items():
        reply.trees.add(session_id=sid.removeprefix(scope), tree=tree.to_nodes().to_proto())
    for sid, stats in result.released.items():
        reply.released.add(session_id=sid.removeprefix(scope), stats=stats_to_proto(stats))
    reply.failures.extend(failure_to_proto(sid.removeprefix(scope), f) for sid, f in result.failures.items())
    for sid, positions in result.cached.items():
        reply.cached.add(session_id=sid.removeprefix(scope), positions=positions)
    return reply


def result_from_proto(reply: draft_pb2.DraftStepReply, peer: str) -> DraftBatchResult:
    failures: dict[str, DiffSpecError] = {f.session_id: error_from_failure(peer, f) for f in reply.failures}
    trees = {}
    for proposed in reply.trees:
        try:
            trees[proposed.session_id] = TreeNodes.from_proto(proposed.tree)
        except DiffSpecError as bad:
            failures[proposed.session_id] = bad
    released = {r.session_id: stats_from_proto(r.stats) for r in reply.released}
    cached = {c.session_id: c.positions for c in reply.cached}
    return DraftBatchResult(trees, released, failures, cached)


def stats_to_proto(stats: DraftStats) -> draft_pb2.DraftStats:
    return draft_pb2.DraftStats(
        hazard=stats.hazard, working_set_tokens=stats.working_set_tokens, context_tokens=stats.context_tokens,
        working_set_updates=stats.working_set_updates,
    )


def stats_from_proto(message: draft_pb2.DraftStats) -> DraftStats:
    return DraftStats(
        hazard=list(message.hazard),
        working_set_tokens=message.working_set_tokens,
        context_tokens=message.context_tokens,
        working_set_updates=message.working_set_updates,
    )
