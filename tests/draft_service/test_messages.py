"""The draft's wire messages: a released session's stats, and the prefix cache's lookups and cached entries, cross the
wire whole."""

from __future__ import annotations

import dataclasses

import torch

from diffspec.tensor_wire import rows_to_tensor
from diffspec.v1 import draft_pb2
from draft_service.backend import DraftBatch, DraftBatchResult, DraftStart, DraftStats, PrefixLookup
from draft_service.messages import (
    batch_from_proto,
    batch_to_proto,
    feature_rows,
    result_from_proto,
    result_to_proto,
    stats_from_proto,
    stats_to_proto,
)
from draft_service.options import DraftOptions


def test_released_stats_cross_the_wire_whole():
    stats = DraftStats(hazard=[0.125, 0.5], working_set_tokens=1982, context_tokens=65661, working_set_updates=41)
    assert {f.name for f in dataclasses.fields(DraftStats)} <= set(draft_pb2.DraftStats.DESCRIPTOR.fields_by_name)
    assert stats_from_proto(draft_pb2.DraftStats.FromString(stats_to_proto(stats).SerializeToString())) == stats


def test_lookups_cached_entries_and_the_rows_past_them_cross_the_wire():
    """A step with a lookup and a start from 3 cached entries: the start carries the rows of its other positions
    only, and the reply's cached entries come back per session, each out of and back into the stream's scope."""
    options = DraftOptions("full", "16:0.0:4")
    batch = DraftBatch(
        releases=["gone"],
        starts=[DraftStart("s", [1, 2, 3, 4, 5], torch.ones(2, 6), 9, options, cached_positions=3)],
        lookups=[PrefixLookup("q", [1, 2, 3], "tenant")],
    )
    step, rows = batch_to_proto(batch)
    assert feature_rows(step) == step.feature_rows == 2
    wire = draft_pb2.DraftStep.FromString(step.SerializeToString())
    received = batch_from_proto(wire, rows_to_tensor(rows), "scope/")
    assert received.lookups == [PrefixLookup("scope/q", [1, 2, 3], "tenant")]
    assert received.starts[0].cached_positions == 3 and torch.equal(received.starts[0].features, torch.ones(2, 6))
    sent = result_to_proto(DraftBatchResult(cached={"scope/q": 128}), "scope/")
    reply = draft_pb2.DraftStepReply.FromString(sent.SerializeToString())
    assert result_from_proto(reply, "peer").cached == {"q": 128}
