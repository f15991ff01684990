"""The draft's wire messages: a released session's stats cross the wire whole."""

from __future__ import annotations

import dataclasses

from diffspec.v1 import draft_pb2
from draft_service.backend import DraftStats
from draft_service.messages import stats_from_proto, stats_to_proto


def test_released_stats_cross_the_wire_whole():
    stats = DraftStats(hazard=[0.125, 0.5], working_set_tokens=1982, context_tokens=65661, working_set_updates=41)
    assert {f.name for f in dataclasses.fields(DraftStats)} <= set(draft_pb2.DraftStats.DESCRIPTOR.fields_by_name)
    assert stats_from_proto(draft_pb2.DraftStats.FromString(stats_to_proto(stats).SerializeToString())) == stats
