"""Session-failure codec: each failure keeps its kind and its message across the wire (feature rows:
test_feature_rows.py; trees: test_tree.py)."""

from __future__ import annotations

import grpc
import pytest

from diffspec.errors import (
    CheckpointError,
    DeadlineExceeded,
    DiffSpecError,
    InvalidRequest,
    KVPoolExhausted,
    PeerUnavailable,
    ResourceExhausted,
)
from diffspec.v1 import tensor_pb2
from diffspec.wire import error_from_failure, failure_to_proto


# raised at the service -> its status code on the wire -> what the gateway's engine sees
FAILURES = [
    (InvalidRequest("token ids out of the vocabulary"), grpc.StatusCode.INVALID_ARGUMENT, InvalidRequest),
    (KVPoolExhausted("need 4 pages, 1 free"), grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
    (ResourceExhausted("no arena slot"), grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
    (PeerUnavailable("still loading"), grpc.StatusCode.UNAVAILABLE, PeerUnavailable),
    (DeadlineExceeded("too late"), grpc.StatusCode.DEADLINE_EXCEEDED, PeerUnavailable),
    (CheckpointError("no weights"), grpc.StatusCode.FAILED_PRECONDITION, PeerUnavailable),
    (DiffSpecError("sampling overflow"), grpc.StatusCode.INTERNAL, PeerUnavailable),
]


@pytest.mark.parametrize("raised, code, kind", FAILURES, ids=[type(f[0]).__name__ for f in FAILURES])
def test_session_failure_round_trip_keeps_the_kind_and_the_message(raised, code, kind):
    message = tensor_pb2.SessionFailure.FromString(failure_to_proto("s-7", raised).SerializeToString())
    assert message.session_id == "s-7" and message.code == code.value[0] and message.message == str(raised)
    back = error_from_failure("target service", message)
    assert type(back) is kind
    if kind is PeerUnavailable:  # the peer could not do the work: named, with its code and its words
        assert str(back) == f"target service unavailable ({code.name}): {raised}"
    else:  # a rejection is meant for the caller and keeps the service's message as is
        assert str(back) == str(raised)


@pytest.mark.parametrize("code", [0, 999, -1])
def test_session_failure_with_a_code_that_is_no_error_is_peer_unavailable(code):
    """OK (0) or a number grpc does not know: the session still failed, and the engine must not trust it."""
    back = error_from_failure("draft service", tensor_pb2.SessionFailure(session_id="s", code=code, message="?"))
    assert isinstance(back, PeerUnavailable) and str(back).startswith("draft service unavailable (")
