"""Draft protocol dataclasses <-> ``diffspec.v1.draft`` messages, used by the servicer and the client alike."""

from __future__ import annotations

from diffspec.v1 import draft_pb2
from draft_service.backend import DraftOptions, DraftStats


def options_to_proto(options: DraftOptions) -> draft_pb2.DraftOptions:
    return draft_pb2.DraftOptions(policy=options.policy, tree_config=options.tree_config, salience=options.salience)


def options_from_proto(message: draft_pb2.DraftOptions) -> DraftOptions:
    return DraftOptions(policy=message.policy, tree_config=message.tree_config, salience=message.salience)


def stats_to_proto(stats: DraftStats) -> draft_pb2.StatsReply:
    return draft_pb2.StatsReply(
        hazard=stats.hazard, working_set_tokens=stats.working_set_tokens, context_tokens=stats.context_tokens
    )


def stats_from_proto(message: draft_pb2.StatsReply) -> DraftStats:
    return DraftStats(
        hazard=list(message.hazard),
        working_set_tokens=message.working_set_tokens,
        context_tokens=message.context_tokens,
    )
