"""A target step's deferral fields on the wire: kept, and the collected sessions put in the stream's scope."""

from __future__ import annotations

from target_service.backend import PrefillWork, TargetBatch
from target_service.messages import batch_from_proto, batch_to_proto


def test_a_deferred_step_and_its_collects_cross_the_wire_in_the_stream_scope():
    batch = TargetBatch(prefills=[PrefillWork("a", 4)], first_tokens_next_step=True, collects=["b"])
    decoded, malformed = batch_from_proto(batch_to_proto(batch), "stream/")
    assert not malformed and decoded.first_tokens_next_step and decoded.collects == ["stream/b"]
    assert [w.session_id for w in decoded.prefills] == ["stream/a"]
    plain, _ = batch_from_proto(batch_to_proto(TargetBatch(prefills=[PrefillWork("a", 4)])), "stream/")
    assert not plain.first_tokens_next_step and plain.collects == []


def test_a_batch_that_only_collects_is_work():
    assert TargetBatch(collects=["a"]) and not TargetBatch()
